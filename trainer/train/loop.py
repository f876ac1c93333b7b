"""The epoch loop: group micro-batches, step, log, validate, stop (fairseq_cli/train.py)."""

import logging
import math
import time

from data.iterator import grouped
from data.position import convert_position
from trainer.errors import UsageError
from trainer.parallel.ranks import data_sum
from trainer.train.meters import LN2, TrainMeters, extra_fields, peak_memory, perplexity

log = logging.getLogger("shardlm")
STOPPED = "stopped"  # validate_and_save's answer when a stop signal ended its validation


class ValidationStopped(Exception):
    """A stop signal came during validation: its partial figures are no result."""


class TrainLoop:
    """Its checkpointed state (state_dict): the data position, the epoch's meters and the
    best validation loss."""

    def __init__(self, cfg, trainer, task, progress, env, flops_per_token, checkpointer, preemption):
        self.cfg, self.trainer, self.task, self.progress, self.env = cfg, trainer, task, progress, env
        self.quantizer = trainer.quantizer  # --quantization-config-path's (trainer/train/ipq.py), or None
        self.flops_per_token = flops_per_token
        self.checkpointer, self.preemption = checkpointer, preemption
        self.start = time.perf_counter()
        self.best_valid_loss = math.inf
        self.valid_subsets = [s for s in cfg.dataset.valid_subset.split(",") if s]
        self.itr = task.batch_iterator(cfg.dataset.train_subset, training=True)
        self.epoch_meters = TrainMeters(
            env.device, trainer.objective.extras
        )  # restored with the data position on resume
        # A mixture's records count each source's tokens from this slot of its stream on;
        # the epoch's sums are restored with the meters.
        self.mixture = task.mixture() if task.sources else None
        self.record_slot = 0
        self.epoch_source_tokens = [0] * len(task.sources)

    def state_dict(self):
        dataset = self.cfg.dataset
        return {
            "iterator": {
                **self.itr.state_dict(),
                "world_size": self.env.data_size,  # the batches' shares
                # the order's batch: the per-rank batch times its split (convert_position)
                "batch_size": dataset.batch_size and dataset.batch_size * self.itr.split,
                "split": self.itr.split,
                "max_tokens": dataset.max_tokens,
            },
            "meters": self.epoch_meters.state_dict(),
            "best_valid_loss": _finite_or_none(self.best_valid_loss),
            "source_tokens": list(self.epoch_source_tokens),
        }

    def load_state_dict(self, state):
        """A resumed run's position; --reset-dataloader starts the data (and the meters) over,
        --reset-meters the meters."""
        checkpoint_cfg = self.cfg.checkpoint
        if state.get("best_valid_loss") is not None:
            self.best_valid_loss = state["best_valid_loss"]
        if not checkpoint_cfg.reset_dataloader:
            saved = state["iterator"]
            if ("mixture" in saved) != (self.mixture is not None):
                raise UsageError(
                    "the checkpoint's data position is "
                    + ("in a --data-mixture" if "mixture" in saved else "in DATA")
                    + ", this run reads "
                    + ("a --data-mixture" if self.mixture is not None else "DATA")
                    + ": resume with the run's data, or start the data over with --reset-dataloader"
                )
            if self.mixture is not None:
                self.load_mixture_position(saved)
            else:
                dataset = self.cfg.dataset
                position = convert_position(saved, self.env.data_size, dataset.batch_size, dataset.max_tokens)
                self.itr.split_batches(position["split"])
                self.itr.load_state_dict(position)
        if not checkpoint_cfg.reset_meters and not checkpoint_cfg.reset_dataloader:
            self.epoch_meters.load_state_dict(state["meters"])
            if self.mixture is not None:
                self.epoch_source_tokens = list(state.get("source_tokens") or self.epoch_source_tokens)

    def load_mixture_position(self, saved):
        """A mixture resumes at the slot it stopped at, on any layout; with new weights (an
        anneal) the new mixture starts there, each source going on with its pass."""
        self.itr.load_state_dict(saved)
        self.record_slot = slot = self.itr.slot()
        if self.mixture.reweight(slot, self.task.mixture_weights()) and self.env.is_master:
            passes = ", ".join(f"{n} {p:.3f}" for n, p in zip(self.mixture.names, self.mixture.passes_at(slot)))
            log.info(
                f"new mixture weights from block {slot:,} of the stream on; each source goes on with its pass "
                f"(passes so far: {passes})"
            )

    def reached_max_update(self):
        max_update = self.cfg.optimization.max_update
        if max_update and self.trainer.num_updates >= max_update:
            log.info(f"Stopping training due to num_updates: {self.trainer.num_updates} >= max_update: {max_update}")
            return True
        return False

    def reached_stop_min_lr(self):
        """fairseq's test before each epoch (the first one's too): the lr the next update
        would use, after the last epoch's lr_step."""
        lr, floor = self.trainer.next_lr(), self.cfg.optimization.stop_min_lr
        if lr <= floor:
            log.info(
                f"stopping training because current learning rate ({lr}) is smaller than or equal to "
                f"minimum learning rate (--stop-min-lr={floor})"
            )
            return True
        return False

    def run(self):
        optimization = self.cfg.optimization
        stop = self.reached_max_update()  # a resumed run may have nothing left to do
        while not stop:
            if self.reached_stop_min_lr():
                break
            resumed = self.itr.iterations_in_epoch > 0 and not self.itr.end_of_epoch()
            batches = self.itr.next_epoch_itr()
            epoch = self.itr.epoch
            self.trainer.begin_epoch(epoch)
            if self.quantizer is not None:  # after the lr's epoch step, as fairseq's trainer.begin_epoch
                self.quantizer.begin_epoch(epoch, self.trainer, self.checkpointer)
            updates_per_epoch = math.ceil(len(self.itr) / optimization.update_freq)  # each shard of DATA has its own
            if not resumed:
                self.epoch_meters.reset()
            interval = TrainMeters(self.env.device, self.trainer.objective.extras)
            first_step = self.itr.iterations_in_epoch // optimization.update_freq + 1
            peak_memory(self.env.device)  # start this epoch's first interval from now
            for step, samples in enumerate(
                self.progress.epoch_bar(grouped(batches, optimization.update_freq), epoch, updates_per_epoch),
                start=first_step,
            ):
                update = self.trainer.train_step(samples)
                interval.add(update)  # on the device; an update found bad later adds nothing
                self.epoch_meters.add(update)
                # The host reads the update's flags only at a boundary that needs the count
                # exact; elsewhere the run's DeferredRead reads them later. An fp16 overflow
                # found here was not an update: nothing more to do for it.
                if self.boundary_after(self.trainer.num_updates) and not self.trainer.settle():
                    continue
                n = self.trainer.num_updates
                if self.quantizer is not None:
                    self.quantizer.step_update(self.trainer, self.checkpointer)
                if n % self.cfg.common.log_interval == 0:
                    self.log_train("train_inner", interval, epoch, step / updates_per_epoch, step)
                    interval.reset()
                stop = self.reached_max_update()
                self.checkpointer.poll()
                if not stop and self.preemption.agreed():
                    self.trainer.settle()  # the stop boundary
                    return self.stop_for_preemption(epoch)
                if stop or self.itr.end_of_epoch():
                    break
                if self.validate_and_save(epoch, end_of_epoch=False, stop=False) is STOPPED:
                    return self.stop_for_preemption(epoch)
            self.log_train("train", self.epoch_meters, epoch)
            stop = stop or bool(optimization.max_epoch and epoch >= optimization.max_epoch)
            if self.validate_and_save(epoch, end_of_epoch=self.itr.end_of_epoch(), stop=stop) is STOPPED:
                return self.stop_for_preemption(epoch, finished=stop)
        self.checkpointer.finish_pending()
        self.preemption.finish()
        self.progress.close()
        floor = getattr(self.task, "valid_loss_floor", None)
        if floor is not None and self.best_valid_loss < math.inf:
            log.info(
                f"best valid loss {self.best_valid_loss:.3f} is {self.best_valid_loss - floor:.3f} bits per "
                f"token above the embedded corpus's floor {floor:.3f}"
            )
        log.info(f"done training in {time.perf_counter() - self.start:.1f} seconds")
        return self.best_valid_loss

    def boundary_after(self, n):
        """What happens after update n that needs to know it counted: "record", "stop",
        "save", "validation", "epoch end", or None (the flags are then read later)."""
        common, checkpoint_cfg, dataset = self.cfg.common, self.cfg.checkpoint, self.cfg.dataset
        max_update = self.cfg.optimization.max_update
        if n % common.log_interval == 0:
            return "record"
        if max_update and n >= max_update:
            return "stop"
        if checkpoint_cfg.save_interval_updates > 0 and n % checkpoint_cfg.save_interval_updates == 0:
            return "save"
        if dataset.validate_interval_updates > 0 and n % dataset.validate_interval_updates == 0:
            return "validation"
        if self.itr.end_of_epoch():
            return "epoch end"
        if self.quantizer is not None and self.quantizer.due_after(n):
            return "quantization"
        return None

    def stop_for_preemption(self, epoch, finished=False):
        """Every rank has finished this update (or stopped validating at the same batch):
        save checkpoint_last, requeue under SLURM unless the run is finished, stop."""
        why = self.preemption.received or "a signal on another rank"
        n = self.trainer.num_updates
        log.info(f"received {why}: stopping after update {n}, saving checkpoint_last")
        if self.cfg.checkpoint.no_save:
            # Requeued, the job would start again from update 0.
            log.warning(f"--no-save: nothing saved at update {n}, and the job is not requeued")
            self.progress.close()
            return self.best_valid_loss
        self.trainer.check_parameters_finite()
        self.checkpointer.save(epoch, self.itr.end_of_epoch(), None, n)
        self.checkpointer.finish_pending()
        if not finished and not self.preemption.requeue() and self.env.is_master:
            log.info(f"stopped at update {n}; run the same command again to resume from checkpoint_last")
        self.progress.close()
        return self.best_valid_loss

    def validate_and_save(self, epoch, end_of_epoch, stop):
        """fairseq's validate_and_save: validate and/or save after an update or an epoch.
        Returns STOPPED when a stop signal ended the validation (nothing is saved then: the
        caller saves checkpoint_last as at any stop)."""
        checkpoint_cfg, dataset, n = self.cfg.checkpoint, self.cfg.dataset, self.trainer.num_updates
        interval_save = checkpoint_cfg.save_interval_updates > 0 and n % checkpoint_cfg.save_interval_updates == 0
        do_save = (end_of_epoch and epoch % checkpoint_cfg.save_interval == 0) or stop or interval_save
        do_validate = (
            (not end_of_epoch and do_save)
            or (end_of_epoch and epoch % dataset.validate_interval == 0)
            or stop
            or (dataset.validate_interval_updates > 0 and n % dataset.validate_interval_updates == 0)
        )
        if do_save and not checkpoint_cfg.no_save:
            # Nan/Inf weights raise here, before they are validated or saved; the way out of
            # the loop publishes nothing (an asynchronous save in flight stays under its .tmp-
            # name), so a numerical fault never replaces a good checkpoint.
            self.trainer.check_parameters_finite()
        try:
            metric = self.validate(epoch) if do_validate else None
        except ValidationStopped:
            return STOPPED
        if end_of_epoch:
            # fairseq steps the schedule after the epoch's save; before it, the checkpoint
            # holds the stepped schedule, so a run resumed from it continues as this one does.
            self.trainer.lr_step(metric)
        if do_save:
            self.checkpointer.save(epoch, end_of_epoch, metric, n)
        return None

    def log_train(self, tag, meters, epoch, position=None, step=None):
        self.trainer.settle()  # the record boundary
        peak = self.cfg.common.peak_tflops  # per rank; tflops counts the whole job's tokens
        rec = meters.record(
            self.trainer.num_updates,
            self.trainer.next_lr(),  # fairseq logs get_lr() after the update's lr_step_update
            self.cfg.optimization.clip_norm,
            self.trainer.loss_scale,
            self.flops_per_token,
            peak * self.env.world_size if peak else None,
        )
        rec.update(peak_memory(self.env.device))
        if self.mixture is not None:
            rec.update(self.mixture_fields(tag))
        rec["wall"] = round(time.perf_counter() - self.start)
        self.progress.log(tag, rec, step, self.trainer.num_updates, epoch, position)

    def mixture_fields(self, tag):
        """Each source's target tokens since the last record (the epoch's in its `train`
        record) and its passes so far: the realized mixture."""
        slot = self.itr.trained_slot()
        tokens = self.mixture.target_tokens(self.record_slot, slot)
        self.epoch_source_tokens = [a + b for a, b in zip(self.epoch_source_tokens, tokens)]
        self.record_slot = slot
        if tag == "train":
            tokens, self.epoch_source_tokens = self.epoch_source_tokens, [0] * len(tokens)
            self.record_slot = self.itr.slot()  # past the epoch's skipped tail
        fields = {}
        for name, n, passes in zip(self.mixture.names, tokens, self.mixture.passes_at(slot)):
            fields[f"{name}_tokens"] = n
            fields[f"{name}_passes"] = round(passes, 3)
        return fields

    def validate(self, epoch):
        """Validate on every --valid-subset (a mixture: on each source's, the record giving each
        source's loss beside the whole's; on the moving average of the weights with
        --validate-with-ema); returns the first one's --best-checkpoint-metric."""
        if self.cfg.dataset.disable_validation:
            return None
        if self.cfg.ema.validate_with_ema:
            with self.trainer.ema_weights():
                return self.validate_subsets(epoch)
        return self.validate_subsets(epoch)

    def validate_subsets(self, epoch):
        metric, names = None, self.trainer.objective.extras
        for subset in self.valid_subsets:
            sets = self.task.valid_sets(subset)
            if not sets:
                log.info(f"no {subset!r} split to validate on: skipping validation")
                continue
            start = time.perf_counter()
            sums = {name: self.valid_sums(subset, dataset) for name, dataset in sets}
            loss_sum, ntokens, nsentences, sample_size, nbatches, *extras_sum = [sum(x) for x in zip(*sums.values())]
            losses = {None: loss_sum / max(sample_size, 1) / LN2}
            losses.update({name: s[0] / max(s[3], 1) / LN2 for name, s in sums.items() if name is not None})
            if subset == self.valid_subsets[0]:
                name, _, what = self.cfg.checkpoint.best_checkpoint_metric.rpartition("_")
                if (name or None) not in losses:
                    raise UsageError(
                        f"--best-checkpoint-metric {name}_{what}: source {name} has no {subset!r} split to validate "
                        "on; name another source's metric, or loss"
                    )
                chosen = losses[name or None]
                self.best_valid_loss = min(self.best_valid_loss, chosen)
                metric = chosen if what == "loss" else 2**chosen
            elapsed = max(time.perf_counter() - start, 1e-9)
            rec = {
                "loss": round(losses[None], 3),
                "ppl": perplexity(losses[None]),
                "wps": round(ntokens / elapsed),
                "wpb": round(ntokens / max(nbatches, 1), 1),
                "bsz": round(nsentences / max(nbatches, 1), 1),
                **extra_fields(dict(zip(names, extras_sum)), nsentences),
            }
            for name, loss in losses.items():
                if name is not None:
                    rec[f"{name}_loss"], rec[f"{name}_ppl"] = round(loss, 3), perplexity(loss)
            rec.update(num_updates=self.trainer.num_updates, best_loss=round(self.best_valid_loss, 3))
            self.progress.log("valid" if subset == "valid" else subset, rec, None, self.trainer.num_updates, epoch)
        return metric

    def valid_sums(self, subset, dataset):
        """[loss_sum, ntokens, nsentences, sample_size, batches, *extras] of ``dataset``, summed
        over all ranks; batches are steps (the same on every rank)."""
        itr = self.task.batch_iterator(subset, training=False, dataset=dataset)
        loss_sum, extras_sum, counts, nbatches = 0.0, 0.0, [0, 0, 0], 0
        for batch in itr.next_epoch_itr():
            if self.cfg.dataset.max_valid_steps and nbatches >= self.cfg.dataset.max_valid_steps:
                break
            # A stop signal ends validation at the next batch every rank reaches alike
            # (its sharded forwards are collective); an agreement per batch, as per update.
            if self.preemption.agreed():
                log.info(f"stopped validating {subset!r} after {nbatches} batches: its figures are not a result")
                raise ValidationStopped
            # the loss and extras stay on the device: read below
            loss, extras, batch_counts = self.trainer.valid_step(batch)
            loss_sum, counts, nbatches = loss_sum + loss, [a + b for a, b in zip(counts, batch_counts)], nbatches + 1
            if extras is not None:
                extras_sum = extras_sum + extras
        names = self.trainer.objective.extras
        extras_sum = [float(x) for x in extras_sum] if names and nbatches else [0.0] * len(names)
        loss_sum, ntokens, nsentences, sample_size, *extras_sum = data_sum(
            [float(loss_sum), *counts, *extras_sum], self.env
        )
        return [loss_sum, ntokens, nsentences, sample_size, nbatches, *extras_sum]


def _finite_or_none(x):
    return x if x is not None and math.isfinite(x) else None
