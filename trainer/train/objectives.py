"""What a micro-batch's loss is, per task: the token loss (language_modeling, dummy_lm, sft)
or the DPO loss (dpo). Each returns the summed loss of its batch and the sums the records
report (dpo's rewards; a mixture of experts' load-balancing loss, which the token loss
adds); the trainer divides the gradients (after backward) and the logged loss by the
update's sample size over all ranks.

DPO (Rafailov et al., 2023), as TRL's DPOTrainer computes its sigmoid loss: a sequence's
log-probability is the sum over its completion tokens; with the policy's and the frozen
reference's, each pair's implicit rewards are ``beta * (logp - ref_logp)`` of chosen and
rejected, and its loss ``-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)`` of their margin
m (eps: --dpo-label-smoothing, the conservative DPO of Mitchell, 2023).
"""

import torch
import torch.nn.functional as F

from models.config import moe_layers
from trainer.parallel.ranks import on_device_sum

DPO_EXTRAS = ("reward_chosen", "reward_rejected", "reward_correct")
# the load-balancing loss's share times each micro-batch's tokens, summed (trainer/train/meters.py)
MOE_EXTRAS = ("moe_aux_loss",)


class TokenLoss:
    """Summed cross-entropy (nats) over the batch's non-pad targets; with per-document
    attention (--task sft, --per-document-attention) each sequence of a packed row attends
    to itself only."""

    extras = ()

    def __init__(self, cfg, env=None):
        task = cfg.task
        self.per_document = task._name == "sft" or bool(task.get("per_document_attention", False))
        # a mixture of experts' load-balancing loss, in training (models/moe.py)
        self.balance = LoadBalancing(cfg, env) if moe_layers(cfg.model) else None
        if self.balance is not None:
            self.extras = self.balance.extras

    def __call__(self, model, batch, device, **kwargs):
        segments = batch.get("segments") if self.per_document else None
        if "context" in batch:  # context parallelism: this rank's positions, documents in its mask
            kwargs["context"], segments = batch["context"], None
        if segments is not None:
            kwargs["segments"] = segments.to(device, non_blocking=True)
        loss = model(
            batch["src_tokens"].to(device, non_blocking=True),
            target=batch["target"].to(device, non_blocking=True),
            **kwargs,
        )
        if self.balance is None:
            return loss, None
        return self.balance(getattr(model, "module", model), loss, batch["ntokens"])


class LoadBalancing:
    """transformers' load-balancing loss of a mixture of experts (load_balancing_loss_func):
    E · Σ_e f_e · P_e over all sparse layers' tokens, f_e the share of the tokens' top-k
    choices that fell on expert e and P_e its mean router probability, added to the mean
    token loss times --moe-aux-loss-coef. Both are means over the micro-batch of every rank
    (the batch one process would see): the choices and token counts, which have no gradient,
    are summed over the data-parallel ranks, and each rank adds its share of the P_e sum, so
    that the ranks' terms add up to the whole batch's. It is added to the summed token loss
    weighted by the micro-batch's sample size (tokens; dpo's pairs, whose policy forward it
    balances, as TRL's DPOTrainer adds it), which the update's division by its sample size
    undoes.

    The records also show each sparse layer's load: its busiest expert's choices over the mean
    expert's (1: even; E / k: every token on the same experts), from the same counts."""

    def __init__(self, cfg, env):
        self.coef, self.env = cfg.model.moe_aux_loss_coef, env
        self.layers = sorted(moe_layers(cfg.model))
        self.extras = MOE_EXTRAS + tuple(f"moe_load_{i}" for i in self.layers)

    def __call__(self, lm, loss, samples):
        stats = lm.router_stats()
        if not lm.training or not stats:
            return loss, torch.zeros(len(self.extras), dtype=torch.float64, device=loss.device)
        choices = torch.stack([s.choices for s in stats]).double()  # layer × expert
        L, E = choices.shape
        routed = torch.stack([torch.as_tensor(s.tokens, dtype=torch.float64, device=choices.device) for s in stats])
        local = torch.tensor([samples], dtype=torch.float64, device=choices.device)
        counts = torch.cat([choices.reshape(-1), routed, local])
        if self.env is not None:
            counts = on_device_sum(counts, self.env)
        choices, routed, total = counts[: L * E].view(L, E), counts[L * E : L * E + L].sum(), counts[-1]
        probs = sum(s.probs_sum for s in stats).double()
        share = E * (choices.sum(0) * probs).sum() / routed**2  # this rank's part of the aux loss
        weighted = share * total
        loss = loss + (self.coef * weighted).to(loss.dtype)
        # every rank has the whole micro-batch's loads: each adds them weighted by its own share
        loads = choices.max(1).values / choices.mean(1).clamp(min=1e-9) * samples
        ids = lm.sparse_layer_ids(stats)
        for i, counted in zip(ids, choices):  # the whole batch's choices move the balancing biases
            if lm.layers[i].moe.update_load is not None:
                lm.layers[i].moe.update_load += counted.to(lm.layers[i].moe.update_load.dtype)
        ran, none = dict(zip(ids, loads.unbind())), loads.new_zeros(())
        per_layer = torch.stack([ran.get(i, none) for i in self.layers])  # LayerDrop's skipped: 0
        return loss, torch.cat([weighted.detach()[None], per_layer])


class DPOLoss:
    """The sigmoid DPO loss summed over a batch's pairs (rows: the B chosen sequences, then
    the B rejected), with the sums of the chosen and rejected rewards and of the pairs
    ranked right."""

    extras = DPO_EXTRAS

    def __init__(self, cfg, reference, env=None):
        self.reference = reference  # frozen: eval mode, no gradients, no optimizer state
        self.beta, self.smoothing = cfg.task.dpo_beta, cfg.task.dpo_label_smoothing
        self.balance = LoadBalancing(cfg, env) if moe_layers(cfg.model) else None
        if self.balance is not None:
            self.extras = DPO_EXTRAS + self.balance.extras

    def __call__(self, model, batch, device, **kwargs):
        tokens = batch["src_tokens"].to(device, non_blocking=True)
        target = batch["target"].to(device, non_blocking=True)
        context = batch.get("context")  # context parallelism: this rank's positions of each row
        with torch.no_grad():
            reference_nll = self.reference(tokens, target=target, per_row=True, context=context)
        policy_nll = model(tokens, target=target, per_row=True, context=context, **kwargs)
        if context is not None:  # the rows' whole sums, from every rank's positions of them
            reference_nll, policy_nll = context.sum_rows(reference_nll), context.sum_rows(policy_nll)
        # log-probabilities are minus the summed cross-entropies
        log_ratio = (reference_nll - policy_nll).float()
        pairs = log_ratio.shape[0] // 2
        chosen, rejected = self.beta * log_ratio[:pairs], self.beta * log_ratio[pairs:]
        margin = chosen - rejected
        losses = -(1 - self.smoothing) * F.logsigmoid(margin) - self.smoothing * F.logsigmoid(-margin)
        chosen, rejected = chosen.detach(), rejected.detach()
        sums = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum()])
        loss = losses.sum()
        if context is not None:  # every rank of the group has the pairs' losses: count them once
            loss, sums = context.count_once(loss), context.count_once(sums)
            pairs = pairs if context.first else 0
        if self.balance is None:
            return loss, sums
        loss, balance = self.balance(getattr(model, "module", model), loss, pairs)
        return loss, torch.cat([sums.double(), balance])


def build_objective(cfg, reference=None, env=None):
    if cfg.task._name == "dpo":
        return DPOLoss(cfg, reference, env)
    return TokenLoss(cfg, env)
