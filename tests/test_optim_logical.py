"""--optimizer adafactor and lamb step the tensors users have: Adafactor's factored second
moments, its update clipping and parameter scale, and LAMB's trust ratio are taken over
q_proj, k_proj, v_proj, gate_proj and up_proj each (models/layer.py: weight_blocks), not
over shardlm's stacked qkv_proj and fc1, as transformers and fairseq step them. Checked
on a Llama-shaped model (grouped-query attention, a gated feed-forward, RMSNorm, no
biases) on 2 FSDP ranks, where q_proj's rows straddle the two shards, against the
reference optimizer stepping separate parameters with the same gradients. The other
optimizers are elementwise (adam, adamw, cpu_adam, sgd, nag, adagrad, adadelta, adamax)
or already whole per matrix (muon: tests/test_muon.py)."""

import zlib

import pytest
import torch

from helpers import DUMMY, compose, run_ranks

H, KV, D, FFN = 3, 1, 8, 40  # qkv_proj: 24 + 8 + 8 rows, 20 a rank: q_proj on both ranks
LLAMA = DUMMY + ["--batch-size", "2", "--norm-type", "rmsnorm", "--gated-ffn", "--rope", "--no-bias"]
LLAMA += ["--decoder-embed-dim", "24", "--decoder-attention-heads", str(H), "--decoder-kv-heads", str(KV)]
LLAMA += ["--decoder-head-dim", str(D), "--decoder-ffn-embed-dim", str(FFN), "--decoder-layers", "2"]
FSDP = ["--ddp-backend", "fully_sharded"]
# Each logical tensor's weights and gradients at a size of its own, as a trained model's
# are (v_proj's weights small, its gradients large): what stacked statistics mix up.
SCALES = {
    "q_proj": (1.0, 1.0),
    "k_proj": (0.5, 0.3),
    "v_proj": (0.1, 3.0),
    "gate_proj": (1.0, 0.5),
    "up_proj": (0.3, 2.0),
}
ADAFACTOR = ["--optimizer", "adafactor", "--lr", "0.01", "--scale-parameter", "--beta1", "0.9", "--weight-decay", "0.1"]
LAMB_FLAGS = ["--optimizer", "lamb", "--lr", "0.01", "--weight-decay", "0.1"]
STEPS = 2


def hf_split(name, t):
    """[(Hugging Face name, tensor)] of shardlm's parameter `name`: qkv_proj as q_proj,
    k_proj, v_proj; the gated fc1 as gate_proj, up_proj; any other as itself."""
    prefix, module, kind = name.rsplit(".", 2) if name.count(".") >= 2 else ("", "", name)
    if module == "qkv_proj":
        parts = zip(("q_proj", "k_proj", "v_proj"), t.split((H * D, KV * D, KV * D)))
    elif module == "fc1":
        parts = zip(("gate_proj", "up_proj"), t.split((FFN, FFN)))
    else:
        return [(name, t)]
    return [(f"{prefix}.{hf}.{kind}", part) for hf, part in parts]


def drawn(name, shape, what):
    """Parameter `name`'s weights (what="init") or gradient (what=step), drawn whole from a
    seed per logical tensor and scaled by its SCALES, so every process draws the same."""
    parts = []
    for hf, part in hf_split(name, torch.empty(shape)):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{hf}/{what}".encode()))
        weight_scale, grad_scale = SCALES.get(hf.split(".")[-2], (1.0, 1.0))
        parts.append(torch.randn(part.shape, generator=gen) * (weight_scale if what == "init" else grad_scale))
    return torch.cat(parts)


def _stepped(index, argv, port, out):
    """One of 2 FSDP ranks: the model built as `train` builds it, its weights and STEPS
    gradients drawn whole (each rank keeps its rows), stepped by the run's optimizer; rank 0
    saves the whole weights before and after and which parameters have weight decay."""
    from torch.distributed.tensor import distribute_tensor

    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", 2, rank=index, local_rank=index, local_world_size=2)
    cfg = compose(argv)
    env = ranks.init_rank(cfg, rdv, needs_process_group=True)
    try:
        _, trainer, _ = build(cfg, env)
        params = dict(trainer.model.named_parameters())

        def sharded(p, full):
            return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)

        with torch.no_grad():
            for name, p in params.items():
                p.to_local().copy_(sharded(p, drawn(name, p.shape, "init")).to_local())
        initial = {n: p.detach().full_tensor().clone() for n, p in params.items()}
        for step in range(STEPS):
            for name, p in params.items():
                p.grad = sharded(p, drawn(name, p.shape, step))
            trainer.optimizer.step()
        final = {n: p.detach().full_tensor().clone() for n, p in params.items()}
        names = {id(p): n for n, p in params.items()}
        decay = {names[id(p)]: g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
        if index == 0:
            torch.save({"initial": initial, "final": final, "decay": decay}, out)
    finally:
        ranks.teardown()


def sharded_updates(argv, tmp_path):
    """{logical tensor: its update after STEPS steps} on 2 FSDP ranks; the run's saved dict."""
    from trainer.rendezvous import free_port

    out = tmp_path / "stepped.pt"
    run_ranks(_stepped, (argv, free_port(), str(out)), 2)
    saved = torch.load(out)
    updates = {
        hf: after - before
        for name in saved["initial"]
        for (hf, before), (_, after) in zip(
            hf_split(name, saved["initial"][name]), hf_split(name, saved["final"][name])
        )
    }
    return updates, saved


def reference_updates(saved, make, split=True):
    """{logical tensor: its update} by `make(param groups)` stepping the saved initial
    weights as separate tensors (split=False: stacked as shardlm keeps them), with the
    same gradients and the same weight decay per tensor."""
    parts = hf_split if split else (lambda name, t: [(name, t)])
    initial, params, groups = {}, {}, {}
    for name, t in saved["initial"].items():
        for key, part in parts(name, t):
            initial[key], params[key] = part, torch.nn.Parameter(part.clone())
            groups.setdefault(saved["decay"][name], []).append(params[key])
    optimizer = make([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()])
    for step in range(STEPS):
        for name, t in saved["initial"].items():
            for key, grad in parts(name, drawn(name, t.shape, step)):
                params[key].grad = grad
        optimizer.step()
    moved = {key: p.detach() - initial[key] for key, p in params.items()}
    return {hf: u for key, update in moved.items() for hf, u in hf_split(key, update)}


def relative_differences(ours, reference):
    """{logical tensor: max |ours - reference| / max |reference|}."""
    return {k: float((ours[k] - r).abs().max() / r.abs().max()) for k, r in reference.items()}


# ---------------------------------------------------------------- LAMB's reference
def lamb_per_tensor(betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0):
    """apex's FusedLAMB as fairseq runs it (adam_w_mode, grad_averaging, bias_correction,
    use_nvlamb=False: the trust ratio only where weight decay is on), each tensor its own:
    the gradients scaled down to a global norm of max_grad_norm, Adam's bias-corrected
    direction plus decoupled weight decay, times ||w|| / ||update|| of that tensor alone.
    apex is a CUDA build, not installable here; this is its csrc/multi_tensor_lamb.cu."""

    class Lamb(torch.optim.Optimizer):
        def __init__(self, groups, lr):
            super().__init__(groups, dict(lr=lr, weight_decay=0.0))

        @torch.no_grad()
        def step(self):
            params = [p for g in self.param_groups for p in g["params"]]
            norm = torch.stack([p.grad.norm() for p in params]).norm()
            clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state.update(t=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                    state["t"] += 1
                    g, t = p.grad / clip, state["t"]
                    state["m"].mul_(betas[0]).add_(g, alpha=1 - betas[0])
                    state["v"].mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
                    u = (state["m"] / (1 - betas[0] ** t)) / ((state["v"] / (1 - betas[1] ** t)).sqrt() + eps)
                    u = u + group["weight_decay"] * p
                    ratio = 1.0
                    if group["weight_decay"] != 0 and p.norm() != 0 and u.norm() != 0:
                        ratio = p.norm() / u.norm()
                    p.sub_(group["lr"] * ratio * u)

    return lambda groups: Lamb(groups, lr=0.01)


def test_lamb_reference_is_our_lamb_on_a_plain_linear():
    """The reference above and trainer/train/lamb.py agree where nothing is stacked: a
    Linear's weight (decayed: trust ratio) and bias (not), 3 steps."""
    from trainer.train.lamb import LAMB

    torch.manual_seed(0)
    results = []
    for make in (lamb_per_tensor(), lambda groups: LAMB(groups, lr=0.01)):
        layer = torch.nn.Linear(6, 5)
        layer.weight.data.mul_(3.0)
        optimizer = make(
            [{"params": [layer.weight], "weight_decay": 0.1}, {"params": [layer.bias], "weight_decay": 0.0}]
        )
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            layer.weight.grad, layer.bias.grad = torch.randn(5, 6, generator=gen), torch.randn(5, generator=gen)
            optimizer.step()
        results.append([layer.weight.detach(), layer.bias.detach()])
        torch.manual_seed(0)
    for ours, reference in zip(results[1], results[0]):
        assert torch.allclose(ours, reference, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the logical tensors, on 2 FSDP ranks
def adafactor_reference():
    """transformers' Adafactor (fairseq's) with the arguments the ADAFACTOR flags give."""
    from transformers.optimization import Adafactor

    return lambda groups: Adafactor(
        groups,
        lr=0.01,
        eps=(1e-30, 1e-3),
        clip_threshold=1.0,
        decay_rate=-0.8,
        beta1=0.9,
        scale_parameter=True,
        relative_step=False,
        warmup_init=False,
    )


@pytest.mark.parametrize(
    "model,flags,reference,tensors",
    [
        (LLAMA, ADAFACTOR, adafactor_reference, 2 * 9 + 3),
        # fairseq's q_proj, k_proj, v_proj have biases, stacked in qkv_proj.bias (Adafactor's
        # update clipping and parameter scale are per tensor; LAMB decays no bias)
        ([a for a in LLAMA if a != "--no-bias"], ADAFACTOR, adafactor_reference, 2 * 9 + 3 + 2 * 7),
        (LLAMA, LAMB_FLAGS, lamb_per_tensor, 2 * 9 + 3),
    ],
    ids=["adafactor", "adafactor_biases", "lamb"],
)
def test_each_logical_tensor_steps_as_a_separate_parameter(model, flags, reference, tensors, tmp_path):
    """Two steps on 2 FSDP ranks move every logical tensor as the reference optimizer moves
    it as a parameter of its own, to float32's rounding (the weights' rounding seen in an
    update about 1 % of them: 1e-4 of its largest element); the reference stepping the
    stacked tensors moves some of them by tens of percent more, so the comparison sees
    the difference."""
    ours, saved = sharded_updates(model + FSDP + flags, tmp_path)
    separate = relative_differences(ours, reference_updates(saved, reference()))
    stacked = relative_differences(ours, reference_updates(saved, reference(), split=False))
    # q, k, v, o, gate, up, down and 2 norms a layer (and 7 biases); embeddings, final norm, output
    assert len(separate) == tensors
    assert max(separate.values()) < 1e-4, {k: v for k, v in separate.items() if v >= 1e-4}
    assert max(stacked.values()) > 1e-2
