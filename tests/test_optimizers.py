"""--optimizer adafactor, lamb, adagrad, adamax and adadelta: each step equals its reference
(transformers' Adafactor, which is fairseq's; torch's; fairseq's and apex's formulas) on the
same gradients, and training is the same in one process, on 2 DDP ranks and on 2 FSDP
ranks (with --update-freq 2 too), through checkpoints resumed on 1 and 4 ranks. The model's
rows split unevenly (255 embeddings, 127 feed-forward units), so FSDP pads shards."""

import pytest
import torch

from helpers import DUMMY, compose, multi_rank_losses, train_here, train_updates, update_losses
from trainer.errors import UsageError
from trainer.train.adafactor import Adafactor
from trainer.train.lamb import LAMB
from trainer.train.pointwise_optim import Adamax, ShardLocalAdadelta, ShardLocalAdagrad

UPDATES = 5
UNEVEN = [a for a in DUMMY if a not in ("--lr", "0.003")] + ["--dict-size", "255", "--decoder-ffn-embed-dim", "127"]
FSDP = ["--ddp-backend", "fully_sharded"]
OPTIMIZERS = {
    # the parameter's RMS, the first moment and weight decay: every sum Adafactor takes
    "adafactor": ["--optimizer", "adafactor", "--lr", "0.3", "--scale-parameter", "--beta1", "0.9"],
    "adafactor_relative_step": ["--optimizer", "adafactor", "--relative-step", "--weight-decay", "0.1"],
    "lamb": ["--optimizer", "lamb", "--lr", "0.01", "--weight-decay", "0.1"],
    "adagrad": ["--optimizer", "adagrad", "--lr", "0.01", "--weight-decay", "0.01"],
    "adamax": ["--optimizer", "adamax", "--lr", "0.002", "--weight-decay", "0.01", "--no-bias-correction"],
    "adadelta": ["--optimizer", "adadelta", "--lr", "1.0", "--adadelta-rho", "0.95"],
}


# ---------------------------------------------------------------- references, same gradients
def _steps(make, params, grads):
    """The parameters after stepping copies of `params` through each gradient list."""
    copies = [p.detach().clone().requires_grad_() for p in params]
    optimizer = make(copies)
    for gs in grads:
        for p, g in zip(copies, gs):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach() for p in copies]


def _problem():
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,), (2, 3, 4)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 0.3 for s in shapes] for _ in range(4)]
    return params, grads


def lamb_reference(params, grads, lr, betas, eps, wd, max_grad_norm=1.0):
    """apex FusedLAMB (adam_w_mode, grad_averaging, bias_correction, use_nvlamb=False)."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, gs in enumerate(grads, 1):
        norm = torch.sqrt(sum((g * g).sum() for g in gs))
        clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
        for i, (p, g) in enumerate(zip(params, gs)):
            g = g / clip
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            u = (m[i] / (1 - betas[0] ** t)) / ((v[i] / (1 - betas[1] ** t)).sqrt() + eps) + wd * p
            pn, un = p.norm(), u.norm()
            ratio = pn / un if wd != 0 and pn != 0 and un != 0 else 1.0
            params[i] = p - lr * ratio * u
    return params


def adamax_reference(params, grads, lr, betas, eps, wd, bias_correction):
    """fairseq/optim/adamax.py's step."""
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    u = [torch.zeros_like(p) for p in params]
    for t, gs in enumerate(grads, 1):
        for i, g in enumerate(gs):
            m[i] = m[i] * betas[0] + g * (1 - betas[0])
            u[i] = torch.maximum(u[i] * betas[1], g.abs())
            step = lr / (1 - betas[0] ** t) if bias_correction else lr
            params[i] = params[i] * (1 - wd * lr) - step * m[i] / (u[i] + eps)
    return params


def test_each_step_is_its_references():
    from transformers.optimization import Adafactor as FairseqAdafactor

    params, grads = _problem()
    relative = dict(beta1=0.9, weight_decay=0.1, scale_parameter=True, relative_step=True, warmup_init=True)
    external = dict(scale_parameter=False, relative_step=False)
    adagrad = dict(lr=0.1, weight_decay=0.01)
    adadelta = dict(lr=1.0, rho=0.95, eps=1e-6, weight_decay=0.01)
    cases = [
        (lambda ps: Adafactor(ps, lr=0.01), lambda ps: FairseqAdafactor(ps, lr=0.01, **external)),
        (lambda ps: Adafactor(ps, lr=None, **relative), lambda ps: FairseqAdafactor(ps, lr=None, **relative)),
        (lambda ps: ShardLocalAdagrad(ps, **adagrad), lambda ps: torch.optim.Adagrad(ps, **adagrad)),
        (lambda ps: ShardLocalAdadelta(ps, **adadelta), lambda ps: torch.optim.Adadelta(ps, **adadelta)),
    ]
    for ours, reference in cases:
        for a, b in zip(_steps(ours, params, grads), _steps(reference, params, grads)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for bias_correction in (True, False):
        ours = _steps(
            lambda ps, bc=bias_correction: Adamax(ps, lr=0.01, weight_decay=0.1, bias_correction=bc),
            params,
            grads,
        )
        ref = adamax_reference(params, grads, 0.01, (0.9, 0.999), 1e-8, 0.1, bias_correction)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours, ref))
    for wd in (0.0, 0.1):  # the trust ratio only with weight decay, as apex's
        ours = _steps(lambda ps, wd=wd: LAMB(ps, lr=0.01, weight_decay=wd), params, grads)
        ref = lamb_reference(params, grads, 0.01, (0.9, 0.999), 1e-8, wd)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours, ref))


# ---------------------------------------------------------------- one process == DDP == FSDP
# 2 ranks, 8 sequences an update in each: --update-freq 2 runs each rank's 4 in two halves
BACKENDS = {
    "ddp": ["--batch-size", "4"],
    "fsdp": ["--batch-size", "4"] + FSDP,
    "fsdp_update_freq": ["--batch-size", "2", "--update-freq", "2"] + FSDP,
}


@pytest.mark.parametrize(
    "name,backends",
    [
        ("adafactor", list(BACKENDS)),
        ("lamb", ["fsdp", "fsdp_update_freq"]),  # DDP steps whole tensors, as one process does
        # elementwise, stepped on the local shards: FSDP's layout is what could go wrong
        ("adagrad", ["fsdp_update_freq"]),
        ("adamax", ["fsdp_update_freq"]),
        ("adadelta", ["fsdp_update_freq"]),
    ],
)
def test_ranks_train_as_one_process(name, backends, tmp_path):
    """Each update's loss and gradient norm on 2 ranks are one process's, whose batches hold
    both ranks' sequences: the sums over the shard group make Adafactor's statistics and
    LAMB's norms those of whole parameters, over rows that split unevenly."""
    refs = {}  # one process, by --update-freq: its batches are the ranks' batches merged
    for backend in backends:
        update_freq = 2 if "--update-freq" in BACKENDS[backend] else 1
        if update_freq not in refs:
            flags = ["--batch-size", str(4 // update_freq), "--update-freq", str(update_freq)]
            refs[update_freq] = update_losses(UNEVEN + OPTIMIZERS[name] + flags, UPDATES, with_gnorm=True, merge=2)
        ref_losses, ref_gnorms = refs[update_freq]
        assert min(ref_losses[2:]) < ref_losses[0]  # it learns (the dummy batches are noisy)
        losses, gnorms = multi_rank_losses(UNEVEN + OPTIMIZERS[name] + BACKENDS[backend], 2, UPDATES, tmp_path)
        assert losses == pytest.approx(ref_losses, rel=1e-5), backend
        assert gnorms == pytest.approx(ref_gnorms, rel=1e-5), backend


# ---------------------------------------------------------------- checkpoints
SAVE = [a for a in UNEVEN if a != "--no-save"] + ["--disable-validation", "--max-update", "5", "--batch-size", "4"]


# adagrad's and adadelta's state is parameter-shaped and sharded like adamax's (and Adam's,
# whose resharded resume tests/test_checkpoint_resume.py checks): adamax stands for the three.
@pytest.mark.parametrize("name", ["adafactor", "lamb", "adamax"])
def test_state_resumes_on_one_and_on_four_ranks(tmp_path, capfd, name):
    """State saved on 2 FSDP ranks (Adafactor's rows sharded like the parameter's, its columns
    replicated) continues the same curve in one process and on 4 hybrid-sharded ranks (2
    replicas of 2 shards, so the sums skip the replicas); another --optimizer is refused.
    16 sequences an update in each: 4 batches of 4."""
    flags = SAVE + OPTIMIZERS[name]
    whole = train_updates(
        flags + FSDP + ["--update-freq", "2", "--save-interval-updates", "3", "--save-dir", str(tmp_path / "a")],
        2,
        tmp_path,
    )
    saved = ["--restore-file", str(tmp_path / "a" / "checkpoint_1_3")]
    one = train_updates(flags + saved + ["--update-freq", "4", "--save-dir", str(tmp_path / "b")], 1, tmp_path)
    hybrid = ["--ddp-backend", "hybrid_shard", "--shard-group-size", "2"]
    four = train_updates(flags + saved + hybrid + ["--save-dir", str(tmp_path / "c")], 4, tmp_path)
    assert sorted(one) == sorted(four) == [4, 5]
    for n in (4, 5):
        assert one[n] == pytest.approx(whole[n], rel=1e-5), f"update {n} on 1 rank"
        assert four[n] == pytest.approx(whole[n], rel=1e-5), f"update {n} on 4 ranks"
    if name != "adafactor":
        return
    other = ["--optimizer", "lamb", "--lr", "0.01", "--save-dir", str(tmp_path / "d")]
    _, r = train_here(SAVE + saved + other, capfd, check=False)
    assert r.returncode != 0
    refusal = "holds --optimizer adafactor's state, not lamb's; resume with --optimizer adafactor, or pass --reset"
    assert refusal in r.stderr + r.stdout


# ---------------------------------------------------------------- fp16, bad values
@pytest.mark.parametrize("name", ["adafactor", "lamb"])
def test_fp16_overflow_skips_the_step(name):
    """An fp16 overflow skips the update on every rank before the optimizer runs its
    collectives: no parameter moves and no state is made; the next update steps once."""
    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(UNEVEN + OPTIMIZERS[name] + FSDP + ["--batch-size", "2", "--fp16", "--fp16-init-scale", str(2**40)])
    env = ranks.init_rank(cfg, Rendezvous("", 1), needs_process_group=True)
    try:
        task, trainer, _ = build(cfg, env)
        batches = task.batch_iterator(cfg.dataset.train_subset, training=True).next_epoch_itr()
        before = [p.detach().full_tensor().clone() for p in trainer.model.parameters()]
        trainer.train_step([next(batches)])
        assert not trainer.settle() and trainer.num_updates == 0
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, trainer.model.parameters()))
        assert not trainer.optimizer.state
        trainer.scaler.update(new_scale=256.0)
        trainer.train_step([next(batches)])
        assert trainer.settle() and trainer.num_updates == 1
        assert {float(s["step"]) for s in trainer.optimizer.state.values()} == {1.0}
        assert not all(torch.equal(a, p.full_tensor()) for a, p in zip(before, trainer.model.parameters()))
    finally:
        ranks.teardown()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--optimizer", "lamb", "--lamb-eps=-1e-8"], "optimizer.lamb_eps must be >= 0"),
        (["--optimizer", "adamax", "--adamax-betas", "(0.9, 1.0)"], r"--adamax-betas must each be in \[0, 1\)"),
        (["--optimizer", "adafactor", "--adafactor-eps", "(-1e-30, 1e-3)"], "--adafactor-eps needs two numbers >= 0"),
        (["--optimizer", "adafactor", "--beta1", "1.5"], r"--beta1 must be in \[0, 1\)"),
        (["--optimizer", "adafactor", "--warmup-init"], "--warmup-init warms up Adafactor's relative step"),
        (["--optimizer", "adafactor", "--relative-step", "--lr", "0.01"], "--relative-step computes Adafactor's lr"),
        (["--optimizer", "adadelta", "--anneal-eps"], "--anneal-eps: fairseq's adadelta accepts it and never reads"),
        (["--optimizer", "adam", "--clip-threshold", "2"], "--clip-threshold is read by --optimizer adafactor only"),
    ],
)
def test_bad_values_are_refused_in_one_line(flags, message):
    with pytest.raises(UsageError, match=message) as refused:
        compose(UNEVEN + flags)
    assert "\n" not in str(refused.value)
