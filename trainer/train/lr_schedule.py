"""The learning-rate schedules: the lr of each update (LRSchedule). fairseq's fixed,
inverse_sqrt, polynomial_decay, cosine and reduce_lr_on_plateau in the class; warmup-stable-
decay (wsd) and fairseq's tri_stage, triangular, step and manual each one function below,
which builds the schedule's lr(num_updates, epoch) from the config.

Each lr(n) is fairseq's step_update(n): the lr of update n + 1 (fairseq's trainer calls
step_update(0) before the first update and step_update(n) after the n-th), also the lr
logged after update n."""

import math

from trainer.config.checks.lr_scheduler import parse_manual_lr, wsd_decay_updates


class LRSchedule:
    """lr as a function of num_updates: every schedule but two is stateless, so resuming
    needs only num_updates. reduce_lr_on_plateau also keeps its current lr, best metric and
    bad epochs, saved with checkpoints (`state_dict`) and stepped on each epoch's validation
    metric (`step_epoch`); manual reads the epoch too (`begin_epoch`, saved likewise)."""

    def __init__(self, cfg):
        scheduler_cfg = cfg.lr_scheduler
        self.name, self.peak = scheduler_cfg._name, cfg.optimization.lr
        self.warmup = scheduler_cfg.warmup_updates
        self.warmup_init = 0.0 if scheduler_cfg.warmup_init_lr < 0 else scheduler_cfg.warmup_init_lr
        self.end_lr, self.power, self.min_lr = (
            scheduler_cfg.end_learning_rate,
            scheduler_cfg.power,
            scheduler_cfg.min_lr,
        )
        max_update = cfg.optimization.max_update
        self.total = scheduler_cfg.total_num_update or max_update
        if self.name == "cosine":  # fairseq's cosine_lr_scheduler.py
            self.min_lr = min(scheduler_cfg.min_lr, self.peak)
            self.warmup_init = self.min_lr if scheduler_cfg.warmup_init_lr < 0 else scheduler_cfg.warmup_init_lr
            # Past the last update only (checks.py requires max_update or the period).
            self.period = (
                scheduler_cfg.lr_period_updates
                if scheduler_cfg.lr_period_updates > 0
                else max(max_update - self.warmup, 1)
            )
            self.t_mult, self.shrink = scheduler_cfg.t_mult, scheduler_cfg.lr_shrink
        if self.name == "reduce_lr_on_plateau":  # fairseq's reduce_lr_on_plateau.py over torch's ReduceLROnPlateau
            self.warmup_init = (
                scheduler_cfg.warmup_init_lr
                if scheduler_cfg.warmup_init_lr >= 0
                else 0.0
                if self.warmup > 0
                else self.peak
            )
            self.shrink, self.threshold, self.patience = (
                scheduler_cfg.lr_shrink,
                scheduler_cfg.lr_threshold,
                scheduler_cfg.lr_patience,
            )
            self.maximize = cfg.checkpoint.maximize_best_checkpoint_metric
        self.warmup_step = (self.peak - self.warmup_init) / self.warmup if self.warmup > 0 else 0.0
        if self.name == "reduce_lr_on_plateau":
            self.reset()
        self.epoch = None  # the epoch begun last (begin_epoch); None before the first
        # the schedules written as one function below: lr(num_updates, epoch)
        self.formula = SCHEDULES[self.name](cfg) if self.name in SCHEDULES else None

    def lr(self, num_updates):
        if self.formula is not None:
            return self.formula(num_updates, self.epoch)
        if self.name == "cosine":
            return self.cosine(num_updates)
        if self.name == "reduce_lr_on_plateau":
            if self.warmup > 0 and num_updates <= self.warmup:
                return self.warmup_init + num_updates * self.warmup_step
            return self.current
        # each warmup counted as its fairseq scheduler counts it
        if self.name == "fixed":
            if self.warmup > 0 and num_updates < self.warmup:
                return self.peak * (num_updates + 1) / self.warmup
            return self.peak
        if self.name == "inverse_sqrt":
            if self.warmup > 0 and num_updates < self.warmup:
                return self.warmup_init + num_updates * self.warmup_step
            return self.peak * math.sqrt(max(self.warmup, 1)) / math.sqrt(max(num_updates, 1))
        # polynomial_decay
        if self.warmup > 0 and num_updates <= self.warmup:
            return self.peak * num_updates / self.warmup
        if num_updates >= self.total:
            return self.end_lr
        frac = 1 - (num_updates - self.warmup) / max(self.total - self.warmup, 1)
        return (self.peak - self.end_lr) * frac**self.power + self.end_lr

    def cosine(self, num_updates):
        """fairseq's step_update: warmup from --warmup-init-lr (default --min-lr), then cosine
        cycles, each --t-mult times longer than the last, its max and min lr times
        --lr-shrink**cycle."""
        if num_updates < self.warmup:
            return self.warmup_init + num_updates * self.warmup_step
        curr, period, t_mult = num_updates - self.warmup, self.period, self.t_mult
        if t_mult != 1:
            i = math.floor(math.log(1 - curr / period * (1 - t_mult), t_mult))
            t_i = t_mult**i * period
            t_curr = curr - (1 - t_mult**i) / (1 - t_mult) * period
        else:
            i = math.floor(curr / period)
            t_i = period
            t_curr = curr - period * i
        shrink = self.shrink**i
        min_lr, max_lr = self.min_lr * shrink, self.peak * shrink
        return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * t_curr / t_i))

    def apply(self, optimizer, num_updates):
        lr = self.lr(num_updates)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def begin_epoch(self, epoch):
        """fairseq's step_begin_epoch, at each epoch's start (a resumed one's too): only
        manual's lr depends on it."""
        self.epoch = epoch

    # ------------------------------------------------------ reduce_lr_on_plateau
    def reset(self):
        # The lr that warmup ends on (fairseq keeps the optimizer's), or --lr without warmup.
        self.current = self.warmup_init + self.warmup * self.warmup_step if self.warmup > 0 else self.peak
        self.best = -math.inf if self.maximize else math.inf
        self.bad_epochs = 0

    def step_epoch(self, metric, num_updates):
        """At an epoch's end, with its validation metric (None when it did not validate):
        torch's ReduceLROnPlateau step (mode min or max, relative threshold, no cooldown,
        min lr 0, eps 1e-8), once warmup is over (fairseq's lr_step)."""
        if self.name != "reduce_lr_on_plateau" or metric is None or num_updates <= self.warmup:
            return
        if self.maximize:
            better = metric > self.best * (1 + self.threshold)
        else:
            better = metric < self.best * (1 - self.threshold)
        if better:
            self.best, self.bad_epochs = metric, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs > self.patience:
            new = max(self.current * self.shrink, 0.0)
            if self.current - new > 1e-8:
                self.current = new
            self.bad_epochs = 0

    def state_dict(self):
        if self.name == "manual":  # the epoch whose lr it runs at, as fairseq's optimizer keeps its lr
            return {"name": self.name, "epoch": self.epoch}
        if self.name != "reduce_lr_on_plateau":
            return None
        return {
            "name": self.name,
            "lr": self.current,
            "bad_epochs": self.bad_epochs,
            "best": self.best if math.isfinite(self.best) else None,
        }

    def load_state_dict(self, state):
        """A saved plateau's or manual's state; anything else (another schedule's, none) leaves
        this one fresh."""
        if not state or state.get("name") != self.name:
            return
        if self.name == "manual":
            self.epoch = state["epoch"]
            return
        if self.name != "reduce_lr_on_plateau":
            return
        self.current, self.bad_epochs = state["lr"], state["bad_epochs"]
        if state["best"] is not None:
            self.best = state["best"]


# ------------------------------------------------------------ one function each
# Each takes the config and returns lr(num_updates, epoch), epoch the one begun last (None
# before the first); only manual reads it. The config is checked (checks/lr_scheduler.py):
# no division here is by zero.


def wsd(cfg):
    """Warmup, stable, decay (MiniCPM's WSD, arXiv:2404.06395; torchtitan's decay_ratio).
    With W = --warmup-updates, M = --max-update, D = the decay's length (--decay-updates,
    or --decay-ratio times M rounded), lr_0 = --warmup-init-lr (-1: 0), the lr after n
    updates is

        n < W               lr_0 + (lr - lr_0) * n / W
        W <= n < M - D      lr
        M - D <= n          min_lr + (lr - min_lr) * f(min(1, (n - M + D) / D))

    f(p) = 1 - p (linear), (1 + cos(pi * p)) / 2 (cosine), 1 - sqrt(p) (1-sqrt). The decay's
    first update runs at --lr and its last (update M) at f((D - 1) / D); the lr logged after
    it is --min-lr. D = 0: no decay. A function of n alone, so a run restored from a
    stable-phase checkpoint with a new --max-update and --decay-updates decays from there
    (a branch), and a run restored mid-decay continues it."""
    schedule, peak, max_update = cfg.lr_scheduler, cfg.optimization.lr, cfg.optimization.max_update
    warmup, final = schedule.warmup_updates, schedule.min_lr
    init = 0.0 if schedule.warmup_init_lr < 0 else schedule.warmup_init_lr
    decay = wsd_decay_updates(schedule, max_update)
    shape = {
        "linear": lambda p: 1 - p,
        "cosine": lambda p: (1 + math.cos(math.pi * p)) / 2,
        "1-sqrt": lambda p: 1 - math.sqrt(p),
    }[schedule.decay_type]

    def lr(n, epoch):
        if n < warmup:
            return init + (peak - init) * n / warmup
        if decay == 0 or n < max_update - decay:
            return peak
        return final + (peak - final) * shape(min(1.0, (n - max_update + decay) / decay))

    return lr


def tri_stage(cfg):
    """fairseq's tri_stage_lr_scheduler.py: from --init-lr-scale * lr up to lr over
    --warmup-steps (W), lr for --hold-steps (H), then exponentially down to
    --final-lr-scale * lr over --decay-steps (D), and there after (--phase-ratio: the three
    as fractions of --max-update, each rounded down):

        n < W               init + (lr - init) * n / W
        n < W + H           lr
        n <= W + H + D      lr * exp(log(final_lr_scale) * (n - W - H) / D)
        after               final_lr_scale * lr"""
    schedule, peak, max_update = cfg.lr_scheduler, cfg.optimization.lr, cfg.optimization.max_update
    init, final = schedule.init_lr_scale * peak, schedule.final_lr_scale * peak
    if schedule.phase_ratio:
        warmup, hold, decay = (int(max_update * r) for r in schedule.phase_ratio)
    else:
        warmup, hold, decay = schedule.warmup_steps, schedule.hold_steps, schedule.decay_steps
    rate = (peak - init) / warmup if warmup else 0.0
    decay_factor = -math.log(schedule.final_lr_scale) / decay

    def lr(n, epoch):
        if n < warmup:
            return init + rate * n
        if n < warmup + hold:
            return peak
        if n <= warmup + hold + decay:
            return peak * math.exp(-decay_factor * (n - warmup - hold))
        return final

    return lr


def triangular(cfg):
    """fairseq's triangular_lr_scheduler.py (cyclical lr, arXiv:1506.01186): cycles of
    --lr-period-updates, up from lr to --max-lr in the first half and back down in the
    second; cycle c's top is --max-lr * --lr-shrink**c, its bottom lr (times the same with
    --shrink-min). With s = period // 2, c = floor(n / 2s), x = |n / s - 2c - 1|:
    lr = bottom + (top - bottom) * max(0, 1 - x)."""
    schedule, base = cfg.lr_scheduler, cfg.optimization.lr
    stepsize = schedule.lr_period_updates // 2

    def lr(n, epoch):
        cycle = math.floor(n / (2 * stepsize))
        shrink = schedule.lr_shrink**cycle
        top, bottom = schedule.max_lr * shrink, base * shrink if schedule.shrink_min else base
        x = abs(n / stepsize - 2 * (cycle + 1) + 1)
        return bottom + (top - bottom) * max(0, 1 - x)

    return lr


def step(cfg):
    """fairseq's step_lr_scheduler.py: warmup from --warmup-init-lr (-1: --min-lr) over
    --warmup-updates (W), then lr * --lr-decay**floor((n - W) / --lr-decay-period), never
    below --min-lr."""
    schedule, peak = cfg.lr_scheduler, cfg.optimization.lr
    warmup, floor = schedule.warmup_updates, schedule.min_lr
    init = schedule.warmup_init_lr if schedule.warmup_init_lr >= 0 else floor
    rate = (peak - init) / warmup if warmup > 0 else 1.0

    def lr(n, epoch):
        if n < warmup:
            return init + n * rate
        return max(peak * schedule.lr_decay ** ((n - warmup) // schedule.lr_decay_period), floor)

    return lr


def manual(cfg):
    """fairseq's manual_lr_scheduler.py: --update2lr's lr of the largest key <= n if it has
    one; else --epoch2lr's of the largest key <= the epoch begun last (fairseq sets it at
    each epoch's start, step_begin_epoch); else the first lr: --epoch2lr's or --update2lr's
    of key 1, or --lr (fairseq's optimizer keeps it where no key applies)."""
    schedule = cfg.lr_scheduler
    epoch2lr = parse_manual_lr(schedule.epoch2lr, "--epoch2lr")
    update2lr = parse_manual_lr(schedule.update2lr, "--update2lr")
    first = epoch2lr[1] if 1 in epoch2lr else update2lr[1] if 1 in update2lr else cfg.optimization.lr

    def lr(n, epoch):
        keys = [k for k in update2lr if k <= n]
        if keys:
            return update2lr[max(keys)]
        keys = [k for k in epoch2lr if epoch is not None and k <= epoch]
        return epoch2lr[max(keys)] if keys else first

    return lr


SCHEDULES = {"wsd": wsd, "tri_stage": tri_stage, "triangular": triangular, "step": step, "manual": manual}
