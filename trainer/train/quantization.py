"""--quantization-config-path: fairseq's iterative product quantization schedule (fairseq
0.12, quantization_utils.Quantizer) and its YAML file (modules/quantization/
quantization_options.py). The math and the PQ modules are models/pq.py.

The file, its defaults and its regexes' rule are trainer/config/quantization.py's.

Stages: training runs for max_epoch or max_update (exactly one of them set, a multiple of
the number of stages), cut into equal parts. The first stage is quantized at the start of
the first epoch, each later one at the start of epoch 1 + s * (max_epoch / stages), or
after update s * (max_update / stages), counted as the run counts its updates (a count
restored from a checkpoint included, as fairseq's).
"""

from trainer.errors import UsageError


class QuantizationSchedule:
    """fairseq's Quantizer without the model: when each stage is quantized. The trainer calls
    begin_epoch at the start of every epoch and step_update after every update; each returns
    the stage to quantize now, or None. After quantizing a stage the trainer rebuilds its
    optimizer and LR scheduler, as fairseq's trainer.reinitialize makes it do."""

    def __init__(self, config, max_epoch, max_update):
        self.n_centroids_config = config["n_centroids"]
        self.block_sizes_config = config["block_sizes"]
        self.layers_to_quantize = config["layers_to_quantize"]
        stages = len(self.layers_to_quantize)
        self.epoch_schedule = self._every("max-epoch", max_epoch, stages)
        self.update_schedule = self._every("max-update", max_update, stages)
        if (self.epoch_schedule is None) == (self.update_schedule is None):
            # fairseq's assertion (an xor) refuses neither as well as both
            raise UsageError("iterative PQ (--quantization-config-path) needs exactly one of --max-epoch, --max-update")
        self.quantization_step = 0  # stages done; 0 makes the first begin_epoch quantize

    @staticmethod
    def _every(flag, limit, stages):
        if limit <= 0:
            return None
        if limit % stages != 0:
            raise UsageError(
                f"for iterative PQ, --{flag} (={limit}) must be evenly divisible by len(layers_to_quantize) (={stages})"
            )
        return limit // stages

    def _next_stage(self):
        if self.quantization_step >= len(self.layers_to_quantize):
            return None  # every stage done (a finished or resumed run): nothing more
        self.quantization_step += 1
        return self.quantization_step - 1

    def begin_epoch(self, epoch):
        """At the start of `epoch` (from 1): the stage to quantize, or None. By updates too,
        the first stage comes at the first epoch's start."""
        every = self.epoch_schedule
        # a resumed epoch starts again: its stage, quantized before the save, is not done twice
        by_epoch = every is not None and epoch > 0 and (epoch - 1) % every == 0
        by_epoch = by_epoch and self.quantization_step == (epoch - 1) // every
        return self._next_stage() if by_epoch or self.quantization_step == 0 else None

    def step_update(self, num_updates):
        """After the update that makes the count `num_updates`: the stage to quantize, or None."""
        if self.update_schedule is not None and num_updates > 0 and num_updates % self.update_schedule == 0:
            return self._next_stage()
        return None

    def state_dict(self):
        return {
            "n_centroids_config": self.n_centroids_config,
            "block_sizes_config": self.block_sizes_config,
            "layers_to_quantize": self.layers_to_quantize,
            "epoch_schedule": self.epoch_schedule,
            "update_schedule": self.update_schedule,
            "quantization_step": self.quantization_step,
        }

    def load_state_dict(self, state):
        self.n_centroids_config = state["n_centroids_config"]
        self.block_sizes_config = state["block_sizes_config"]
        self.layers_to_quantize = state["layers_to_quantize"]
        self.epoch_schedule, self.update_schedule = state["epoch_schedule"], state["update_schedule"]
        self.quantization_step = state["quantization_step"]
