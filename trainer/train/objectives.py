"""What a micro-batch's loss is, per task: the token loss (language_modeling, dummy_lm, sft)
or the DPO loss (dpo). Each returns the summed loss of its batch and, for dpo, sums the
records report (rewards); the trainer divides the gradients (after backward) and the logged
loss by the update's sample size over all ranks.

DPO (Rafailov et al., 2023), as TRL's DPOTrainer computes its sigmoid loss: a sequence's
log-probability is the sum over its completion tokens; with the policy's and the frozen
reference's, each pair's implicit rewards are ``beta * (logp - ref_logp)`` of chosen and
rejected, and its loss ``-(1 - eps) log sigmoid(m) - eps log sigmoid(-m)`` of their margin
m (eps: --dpo-label-smoothing, the conservative DPO of Mitchell, 2023).
"""

import torch
import torch.nn.functional as F

DPO_EXTRAS = ("reward_chosen", "reward_rejected", "reward_correct")


class TokenLoss:
    """Summed cross-entropy (nats) over the batch's non-pad targets; with per-document
    attention (--task sft, --per-document-attention) each sequence of a packed row attends
    to itself only."""

    extras = ()

    def __init__(self, cfg):
        task = cfg.task
        self.per_document = task._name == "sft" or bool(task.get("per_document_attention", False))

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
        return loss, None


class DPOLoss:
    """The sigmoid DPO loss summed over a batch's pairs (rows: the B chosen sequences, then
    the B rejected), with the sums of the chosen and rejected rewards and of the pairs
    ranked right."""

    extras = DPO_EXTRAS

    def __init__(self, cfg, reference):
        self.reference = reference  # frozen: eval mode, no gradients, no optimizer state
        self.beta, self.smoothing = cfg.task.dpo_beta, cfg.task.dpo_label_smoothing

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
        if context is not None:  # every rank of the group has the pairs' losses: count them once
            return context.count_once(losses.sum()), context.count_once(sums)
        return losses.sum(), sums


def build_objective(cfg, reference=None):
    if cfg.task._name == "dpo":
        return DPOLoss(cfg, reference)
    return TokenLoss(cfg)
