"""fairseq's learning-rate schedules: the lr of each update (LRSchedule)."""

import math


class LRSchedule:
    """lr as a function of num_updates: fairseq's fixed, inverse_sqrt, polynomial_decay and
    cosine (each with linear warmup) are stateless, so resuming needs only num_updates;
    reduce_lr_on_plateau also keeps its current lr, best metric and bad epochs, saved with
    checkpoints (`state_dict`) and stepped on each epoch's validation metric (`step_epoch`)."""

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

    def lr(self, num_updates):
        if self.name == "cosine":
            return self.cosine(num_updates)
        if self.name == "reduce_lr_on_plateau":
            if self.warmup > 0 and num_updates <= self.warmup:
                return self.warmup_init + num_updates * self.warmup_step
            return self.current
        # fairseq's step_update(num_updates) of each: the lr of update num_updates + 1 (its
        # trainer calls step_update(0) before the first update, step_update(n) after the n-th),
        # each warmup counted as its scheduler counts it.
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
        if self.name != "reduce_lr_on_plateau":
            return None
        return {
            "name": self.name,
            "lr": self.current,
            "bad_epochs": self.bad_epochs,
            "best": self.best if math.isfinite(self.best) else None,
        }

    def load_state_dict(self, state):
        """A saved plateau's state; anything else (another schedule's, none) leaves this one fresh."""
        if self.name != "reduce_lr_on_plateau" or not state or state.get("name") != self.name:
            return
        self.current, self.bad_epochs = state["lr"], state["bad_epochs"]
        if state["best"] is not None:
            self.best = state["best"]
