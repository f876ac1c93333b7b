"""shardlm's own files as a model: a checkpoint directory of train (DCP, read tensor by
tensor: DCP stitches each from the shards of every rank that wrote it, so no process holds
more than one whole parameter beside what it builds) or an export of export-model
(`model.safetensors`, `config.yaml` and the tokenizer). Both carry the run's config.yaml."""

import warnings

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.errors import UsageError
from trainer.formats.reader import ModelReader
from trainer.formats.safetensors_file import read_safetensors, safetensors_specs
from trainer.formats.shardlm import checkpoint_dir
from trainer.formats.shardlm.export_dir import EXPORT_FILE


class ShardlmReader(ModelReader):
    def __init__(self, path, specs):
        super().__init__(path)
        self.specs = specs
        if (
            "embed_tokens.weight" not in self.specs
            and "embed_tokens.centroids" not in self.specs
            and not self.band_tables()
        ):
            raise UsageError(
                f"{self.path} holds no shardlm model (no embed_tokens.weight); pass a checkpoint "
                "written by train or an export-model output"
            )
        self.cfg = load_run_config(self.path / "config.yaml")


class CheckpointReader(ShardlmReader):
    """ema: the checkpoint's moving average of the weights (train --store-ema), under the
    same names, in place of its weights."""

    kind = "checkpoint"

    def __init__(self, path, ema=False):
        self.part = checkpoint_dir.EMA_PREFIX if ema else checkpoint_dir.MODEL_PREFIX
        specs = checkpoint_dir.tensor_specs(path, self.part)
        if ema and not specs:
            raise UsageError(
                f"checkpoint {path} holds no moving average of the weights (it was trained without "
                "--store-ema): drop --ema, or pass a checkpoint of a --store-ema run"
            )
        super().__init__(path, specs)

    def describe(self):
        return f"{self.kind} {self.path}" + (" (its moving average of the weights)" if self.ema else "")

    @property
    def ema(self):
        return self.part == checkpoint_dir.EMA_PREFIX

    def get(self, name):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        shape, dtype = self.specs[name]
        group = self.part.rstrip(".")
        out = {group: {name: torch.empty(shape, dtype=dtype)}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(
                    out,
                    storage_reader=checkpoint_dir.safe_reader(self.path),
                    planner=checkpoint_dir.NoBytesLoadPlanner(),
                    no_dist=True,
                )
            # A shard file that is missing, cut short or not a torch archive.
            except (OSError, RuntimeError, CheckpointException) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise UsageError(
                    f"cannot read {name} from {self.path}: {reason[:200]}; the checkpoint is damaged "
                    "or incomplete: pass another one (e.g. an earlier checkpoint)"
                ) from None
        return out[group][name]


class ExportReader(ShardlmReader):
    kind = "export"

    def __init__(self, path):
        try:
            specs = safetensors_specs(path / EXPORT_FILE)
        except ValueError as e:  # the reader's own "not a valid safetensors file: why"
            raise UsageError(f"{e}; export the checkpoint again") from None
        super().__init__(path, specs)

    def get(self, name):
        try:
            return read_safetensors(self.path / EXPORT_FILE, names=[name])[0][name]
        except ValueError as e:
            raise UsageError(f"{e}; export the checkpoint again") from None


def load_run_config(path):
    """The config.yaml saved beside the weights; it must have the model and task groups."""
    import yaml

    if not path.is_file():
        raise UsageError(f"missing {path}: the model's config is saved there; pass a complete checkpoint or export")
    try:
        cfg = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise UsageError(
            f"{path} is not valid YAML ({str(e).splitlines()[0]}); pass a complete checkpoint or export"
        ) from None
    if not (
        isinstance(cfg, DictConfig)
        and isinstance(cfg.get("model"), DictConfig)
        and isinstance(cfg.get("task"), DictConfig)
    ):
        raise UsageError(
            f"{path} is not a shardlm run config (no model and task sections); pass a checkpoint "
            "written by train or an export-model output"
        )
    return cfg
