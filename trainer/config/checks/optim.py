"""Checks of the optimization groups: optimization (updates, lr, clipping) and optimizer —
their pairings, their options' ranges, and options set for an optimizer that does not read
them (the lr_scheduler group's: lr_scheduler.py)."""

from dataclasses import MISSING

from trainer.config.checks.values import get, non_negative, positive
from trainer.config.flags import flag_name, iter_fields
from trainer.errors import UsageError

# Options read by some optimizers only: set (away from its default) for another, each
# would be accepted and ignored.
OPTION_READERS = {
    "optimizer.momentum": ("sgd", "nag"),
    # muon steps all but the decoder layers' matrices with AdamW
    "optimizer.adam_betas": ("adam", "adamw", "cpu_adam", "muon"),
    "optimizer.adam_eps": ("adam", "adamw", "cpu_adam", "muon"),
    "optimizer.adafactor_eps": ("adafactor",),
    "optimizer.clip_threshold": ("adafactor",),
    "optimizer.decay_rate": ("adafactor",),
    "optimizer.beta1": ("adafactor",),
    "optimizer.scale_parameter": ("adafactor",),
    "optimizer.relative_step": ("adafactor",),
    "optimizer.warmup_init": ("adafactor",),
    "optimizer.lamb_betas": ("lamb",),
    "optimizer.lamb_eps": ("lamb",),
    "optimizer.adamax_betas": ("adamax",),
    "optimizer.adamax_eps": ("adamax",),
    "optimizer.no_bias_correction": ("adamax",),
    "optimizer.adadelta_rho": ("adadelta",),
    "optimizer.adadelta_eps": ("adadelta",),
    "optimizer.anneal_eps": ("adadelta",),
    "optimizer.muon_momentum": ("muon",),
    "optimizer.muon_nesterov": ("muon",),
    "optimizer.muon_ns_steps": ("muon",),
    "optimizer.muon_ns_coefficients": ("muon",),
    "optimizer.muon_eps": ("muon",),
    "optimizer.muon_adjust_lr_fn": ("muon",),
}


def check_optimization(cfg):
    positive(cfg, "optimization.update_freq")
    non_negative(cfg, "optimization.lr", "optimization.max_update", "optimization.max_epoch", "optimization.clip_norm")


def check_optimizer(cfg):
    optimizer = cfg.optimizer
    non_negative(cfg, "optimizer.weight_decay")
    for flag, betas in (
        ("--adam-betas", optimizer.adam_betas),
        ("--lamb-betas", optimizer.lamb_betas),
        ("--adamax-betas", optimizer.adamax_betas),
    ):
        _check_betas(flag, list(betas))
    non_negative(
        cfg,
        "optimizer.adam_eps",
        "optimizer.momentum",
        "optimizer.lamb_eps",
        "optimizer.adamax_eps",
        "optimizer.adadelta_eps",
    )
    check_options_read(cfg, "optimizer", OPTION_READERS)
    if optimizer._name == "adafactor":
        check_adafactor(cfg)
    if optimizer._name == "adadelta":
        if not 0.0 <= optimizer.adadelta_rho <= 1.0:
            raise UsageError(f"--adadelta-rho must be in [0, 1], got {optimizer.adadelta_rho}")
        if optimizer.anneal_eps:
            raise UsageError(
                "--anneal-eps: fairseq's adadelta accepts it and never reads it (torch's Adadelta has no such "
                "option); drop it"
            )
    if optimizer._name == "muon":
        _check_muon(optimizer)
    if optimizer._name == "cpu_adam" and not cfg.distributed_training.cpu_offload:
        raise UsageError(
            "--optimizer cpu_adam steps Adam on the host, over the shards --cpu-offload keeps there "
            "(fairseq's pairing); add --cpu-offload (with --ddp-backend fully_sharded), or use "
            "--optimizer adam"
        )


def _check_betas(flag, betas):
    if len(betas) != 2:
        raise UsageError(f'{flag} needs two numbers like "(0.9, 0.98)", got {betas}')
    if not all(0.0 <= b < 1.0 for b in betas):
        raise UsageError(f"{flag} must each be in [0, 1), got {betas}")


def check_adafactor(cfg):
    """fairseq's Adafactor refuses a manual lr with --relative-step, and --warmup-init
    without it; shardlm's --lr has a default, so only an --lr away from it is refused."""
    optimizer, eps = cfg.optimizer, list(cfg.optimizer.adafactor_eps)
    if len(eps) != 2 or any(e < 0 for e in eps):
        raise UsageError(f'--adafactor-eps needs two numbers >= 0 like "(1e-30, 1e-3)", got {eps}')
    if optimizer.clip_threshold <= 0:
        raise UsageError(f"--clip-threshold must be positive (the update's top RMS), got {optimizer.clip_threshold:g}")
    if optimizer.decay_rate >= 0:
        raise UsageError(
            f"--decay-rate must be negative (the second moment's decay is 1 - step**decay_rate), "
            f"got {optimizer.decay_rate}"
        )
    if optimizer.beta1 is not None and not 0.0 <= optimizer.beta1 < 1.0:
        raise UsageError(f"--beta1 must be in [0, 1), got {optimizer.beta1}")
    if optimizer.warmup_init and not optimizer.relative_step:
        raise UsageError("--warmup-init warms up Adafactor's relative step: add --relative-step, or drop --warmup-init")
    if optimizer.relative_step:
        lr_default = next(f.default for g, f in iter_fields() if (g, f.name) == ("optimization", "lr"))
        if cfg.optimization.lr != lr_default:
            raise UsageError(
                f"--relative-step computes Adafactor's lr itself (min(1e-2, 1/sqrt(step))), so --lr "
                f"{cfg.optimization.lr} would be ignored; drop --lr (fairseq refuses both together too)"
            )
        schedule = cfg.lr_scheduler
        if schedule._name != "fixed" or schedule.warmup_updates:
            raise UsageError(
                f"--relative-step computes Adafactor's lr itself, so --lr-scheduler {schedule._name} "
                f"(--warmup-updates {schedule.warmup_updates}) would be ignored; drop them or --relative-step"
            )


def _check_muon(optimizer):
    if not 0.0 <= optimizer.muon_momentum < 1.0:
        raise UsageError(f"--muon-momentum must be in [0, 1), got {optimizer.muon_momentum}")
    if not 0 < optimizer.muon_ns_steps < 100:  # torch.optim.Muon's bound
        raise UsageError(f"--muon-ns-steps must be in 1..99, got {optimizer.muon_ns_steps}")
    if len(optimizer.muon_ns_coefficients) != 3:
        raise UsageError(
            f'--muon-ns-coefficients needs three numbers like "(3.4445, -4.775, 2.0315)", '
            f"got {list(optimizer.muon_ns_coefficients)}"
        )
    if not optimizer.muon_eps > 0:
        raise UsageError(f"--muon-eps must be positive (the floor of the update's norm), got {optimizer.muon_eps}")


def check_options_read(cfg, group, readers_of, hints=None):
    """GROUP's options that only some of its choices read (readers_of: {key: choices}):
    refused, set away from their defaults, for a choice that would ignore them; hints: {key:
    the refusal's last words} where another option is what the user meant."""
    fields = {f"{g}.{f.name}": f for g, f in iter_fields()}
    chosen = cfg[group]._name
    for key, readers in readers_of.items():
        f = fields[key]
        default = f.default_factory() if f.default is MISSING else f.default
        value = list(get(cfg, key)) if isinstance(default, list) else get(cfg, key)
        if chosen not in readers and value != default:
            flag = "--optimizer" if group == "optimizer" else "--lr-scheduler"
            names = f"{', '.join(readers[:-1])} or {readers[-1]}" if len(readers) > 1 else readers[0]
            hint = (hints or {}).get(key, "")
            raise UsageError(f"{flag_name(f)} is read by {flag} {names} only (got {chosen}); drop it{hint}")
