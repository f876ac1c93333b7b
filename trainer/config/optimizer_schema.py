"""The optimizer group of the config schema (trainer/config/schema.py): one field per option
of every optimizer, each read by the optimizers named in trainer/config/checks/optim.py's
OPTION_READERS and refused for the others."""

from dataclasses import dataclass
from typing import List, Optional

from trainer.config.option_field import option as _f


@dataclass
class OptimizerConfig:
    """trainer/train/optim.py: build_optimizer; adafactor.py, lamb.py and pointwise_optim.py
    (adagrad, adamax, adadelta); muon.py."""

    _name: str = _f(
        "adam",
        "optimizer (adam's weight decay is decoupled, as in fairseq and AdamW)",
        flag="--optimizer",
        choices=(
            "adam",
            "adamw",
            "cpu_adam",
            "sgd",
            "nag",
            "adafactor",
            "lamb",
            "adagrad",
            "adamax",
            "adadelta",
            "muon",
        ),
    )
    adam_betas: List[float] = _f([0.9, 0.999], 'Adam betas, e.g. "(0.9, 0.98)"')
    adam_eps: float = _f(1e-8, "Adam epsilon")
    weight_decay: float = _f(0.0, "weight decay (never applied to biases, norms and embeddings)")
    momentum: float = _f(0.0, "sgd and nag momentum (--optimizer nag's default: 0.99)")
    # trainer/train/adafactor.py
    adafactor_eps: List[float] = _f(
        [1e-30, 1e-3], 'adafactor: epsilons for the squared gradient and the parameter scale, e.g. "(1e-30, 1e-3)"'
    )
    clip_threshold: float = _f(1.0, "adafactor: clip each update to this root mean square")
    decay_rate: float = _f(-0.8, "adafactor: the second moment's decay is 1 - step**decay_rate")
    beta1: Optional[float] = _f(None, "adafactor: first-moment beta (default: none kept)")
    scale_parameter: bool = _f(False, "adafactor: scale the lr by the parameter's root mean square")
    relative_step: bool = _f(False, "adafactor: lr = min(1e-2, 1/sqrt(step)) instead of --lr and its schedule")
    warmup_init: bool = _f(False, "adafactor: with --relative-step, lr = min(1e-6 * step, 1/sqrt(step))")
    # trainer/train/lamb.py
    lamb_betas: List[float] = _f([0.9, 0.999], 'lamb betas, e.g. "(0.9, 0.999)"')
    lamb_eps: float = _f(1e-8, "lamb epsilon")
    # trainer/train/pointwise_optim.py
    adamax_betas: List[float] = _f([0.9, 0.999], 'adamax betas, e.g. "(0.9, 0.999)"')
    adamax_eps: float = _f(1e-8, "adamax epsilon")
    no_bias_correction: bool = _f(False, "adamax: no bias correction of the step size")
    adadelta_rho: float = _f(0.9, "adadelta: the squared gradients' running average coefficient")
    adadelta_eps: float = _f(1e-6, "adadelta epsilon")
    anneal_eps: bool = _f(False, "adadelta: fairseq's flag, which its adadelta never reads (refused)")
    # torch.optim.Muon's options and defaults; its weight decay is --weight-decay.
    muon_momentum: float = _f(0.95, "muon: momentum of the decoder layers' matrices")
    muon_nesterov: bool = _f(True, "muon: Nesterov momentum")
    muon_ns_steps: int = _f(5, "muon: Newton-Schulz iterations per update")
    muon_ns_coefficients: List[float] = _f(
        [3.4445, -4.7750, 2.0315], 'muon: the Newton-Schulz polynomial\'s (a, b, c), e.g. "(3.4445, -4.775, 2.0315)"'
    )
    muon_eps: float = _f(1e-7, "muon: the floor of the update's norm before Newton-Schulz")
    muon_adjust_lr_fn: str = _f(
        "original",
        "muon: the lr of each matrix: original (Keller Jordan's, lr * sqrt(max(1, rows / cols))) or "
        "match_rms_adamw (Moonshot's, lr * 0.2 * sqrt(max(rows, cols)): AdamW's lr and weight decay carry over)",
        choices=("original", "match_rms_adamw"),
    )
