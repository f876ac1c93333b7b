"""A fairseq-train checkpoint as a reader (trainer/formats/reader.py): its config as our run
config, its tensors as our parameters (trainer/formats/fairseq/model.py names them), every
one checked before any is read; and, to resume its run, its Adam state and progress
(trainer/formats/fairseq/tensors.py)."""

import copy

from omegaconf import OmegaConf

from models.config import TransformerLMConfig
from models.transformer_lm import build_model
from trainer.formats.fairseq.checkpoint_file import fairseq_settings
from trainer.formats.fairseq.model import PADDING_IDX
from trainer.formats.fairseq.tensors import FairseqTensors, fairseq_adam_state, fairseq_pieces, stacked_rows
from trainer.formats.reader import ForeignRun, ModelReader

TASK_KEYS = ("tokens_per_sample", "sample_break_mode", "add_bos_token")


class FairseqReader(ModelReader):
    kind = "fairseq"

    def __init__(self, path):
        super().__init__(path)
        self.files_dir = self.path.parent  # a fairseq model archive ships its dict.txt beside it
        arch, fixed, training, task, vocab_size = fairseq_settings(self.path)
        model = OmegaConf.merge(OmegaConf.structured(TransformerLMConfig), {**fixed, **training})
        model._name = arch
        self.cfg = OmegaConf.create(
            {
                "model": model,
                "task": {key: task[key] for key in TASK_KEYS if task.get(key) is not None},
                "padding_idx": PADDING_IDX,
            }
        )
        positions = fixed["max_target_positions"]
        meta = build_model(model, vocab_size, positions, device="meta")
        self.tensors = FairseqTensors(self.path, copy.deepcopy(model))
        shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        self.tensors.check(shapes)
        self.specs = {
            name: (shape, self.tensors.tensors[self.tensors.parts(name)[0]].dtype) for name, shape in shapes.items()
        }

    def describe(self):
        return f"fairseq {self.cfg.model._name}"

    def rows(self, name, start, stop, dtype=None):
        return self.tensors.rows(name, start, stop, dtype or self.specs[name][1])

    def resume_state(self):
        adam = fairseq_adam_state(self.tensors)
        pieces, num_updates, epoch = fairseq_pieces(self.tensors)

        def moments(name, first, last):
            parts = self.tensors.parts(name)
            if any(part not in adam for part in parts):  # tied elsewhere: stepped as that one
                return None
            out = {"step": adam[parts[0]]["step"]}
            for key in ("exp_avg", "exp_avg_sq"):
                out[key] = stacked_rows([adam[part][key] for part in parts], first, last)
            return out

        return ForeignRun(moments, pieces, num_updates, epoch)
