"""A Hugging Face model directory as a reader (trainer/formats/reader.py): config.json as
our run config, its safetensors as our parameters, every tensor checked (present, of the
shape config.json implies, a float type) before any is read, so a bad directory costs one
line. Each family (FAMILIES in trainer/formats/hf/config.py) names and lays out its tensors."""

import copy

from omegaconf import OmegaConf

from models.config import TransformerLMConfig
from models.transformer_lm import build_model
from trainer.formats.hf.config import family_of, read_hf_config
from trainer.formats.hf.weights import HFWeights
from trainer.formats.reader import ModelReader

# fairseq's --tokens-per-sample: eval-lm's default block, not the model's positions (Llama
# 3.1's 131072): one block would hold a whole split, its attention quadratic in it.
# --tokens-per-sample takes it up to max_position_embeddings.
DEFAULT_BLOCK = 1024


class HFReader(ModelReader):
    kind = "hf"

    def __init__(self, path):
        super().__init__(path)
        config, fields, vocab_size, max_positions = read_hf_config(self.path)
        self.model_type = config["model_type"]
        model = OmegaConf.merge(
            OmegaConf.structured(TransformerLMConfig), fields, {"max_target_positions": max_positions}
        )
        pad = config.get("pad_token_id")
        self.cfg = OmegaConf.create(
            {
                "model": model,
                "task": {"tokens_per_sample": min(max_positions, DEFAULT_BLOCK)},
                "padding_idx": pad if isinstance(pad, int) and 0 <= pad < vocab_size else None,
            }
        )
        # Read by its own shapes whatever --model-overrides changes later (a copy: OmegaConf
        # may change the node in place).
        self.model_cfg = copy.deepcopy(self.cfg.model)
        shapes = {
            name: tuple(p.shape)
            for name, p in build_model(self.model_cfg, vocab_size, max_positions, device="meta").named_parameters()
        }
        self.weights = HFWeights(self.path, family_of(self.model_type))
        self.weights.check(shapes, self.model_cfg)
        self.specs = {name: (shape, self.weights.dtype_of(name, self.model_cfg)) for name, shape in shapes.items()}

    def describe(self):
        return f"Hugging Face {self.model_type}"

    def rows(self, name, start, stop, dtype=None):
        return self.weights.rows(name, self.model_cfg, start, stop, dtype or self.specs[name][1])

    def close(self):
        self.weights.__exit__(None, None, None)
