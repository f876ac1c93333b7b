"""The one face every format shows the commands: a model's config and its tensors in
shardlm's terms, whatever files hold them.

trainer/formats/registry.py opens a path as the reader of the format it is. A reader has:
- `kind`: the format's name, for messages ("checkpoint", "export", "hf", "fairseq");
- `path`: what was opened; `files_dir`: where its tokenizer and side files are;
- `describe()`: what the model is, for the log;
- `cfg`: the run config the model was made with: `model` (models/config.py's fields),
  `task` (the task settings the files carry; the task schema gives the rest) and
  `padding_idx`;
- `specs`: {our parameter name: (shape, dtype)}, known before any tensor is read;
- `rows(name, start, stop, dtype)`: rows start..stop-1 of one of our parameters, so a rank
  of a sharded model reads only its own; `get(name)`: a whole one;
- `resume_state()`: what continues the run that wrote the files (optimizer moments, update
  count, data position) when a format carries another trainer's run; None otherwise
  (shardlm's own checkpoints resume through trainer/checkpoint/).
A reader holds files open: `close()` it, or use it as a context manager.
"""

from dataclasses import dataclass, field
from pathlib import Path


class ModelReader:
    kind = ""

    def __init__(self, path):
        self.path = Path(path)
        self.files_dir = self.path
        self.cfg = None
        self.specs = {}

    def rows(self, name, start, stop, dtype=None):
        tensor = self.get(name)[start:stop]
        return tensor if dtype is None else tensor.to(dtype)

    def get(self, name):
        shape, dtype = self.specs[name]
        return self.rows(name, 0, shape[0], dtype)

    def resume_state(self):
        return None

    def describe(self):
        """What the model is, for the log ("Hugging Face llama", "fairseq transformer_lm")."""
        return f"{self.kind} {self.path}"

    def band_tables(self):
        """An adaptive input's tables (models/adaptive.py), band by band, each as the name of its
        weight or, quantized by iPQ (models/pq.py), of its module; [] for a plain embedding."""
        tables, band = [], 0
        while True:
            table = f"embed_tokens.embeddings.{band}.0"
            if table + ".weight" in self.specs:
                tables.append(table + ".weight")
            elif table + ".centroids" in self.specs:
                tables.append(table)
            else:
                return tables
            band += 1

    def table_rows(self, name, width):
        """Rows of an embedding table: `name`'s, a weight, or a module iPQ quantized, whose
        blocks of its `width`-wide rows its assignments count."""
        if name in self.specs:
            return self.specs[name][0][0]
        blocks, block_size = self.specs[name + ".assignments"][0][0], self.specs[name + ".centroids"][0][1]
        return blocks * block_size // width

    def vocab_size(self):
        model = self.cfg.model
        width = model.get("decoder_input_dim") or model.decoder_embed_dim
        if "embed_tokens.weight" in self.specs or "embed_tokens.centroids" in self.specs:
            return self.table_rows(
                "embed_tokens.weight" if "embed_tokens.weight" in self.specs else "embed_tokens", width
            )
        # the bands cover the vocabulary, band i dim // factor**i wide (models/config.py adaptive_bands)
        factor = model.get("adaptive_input_factor", 4)
        return sum(self.table_rows(name, int(width // factor**i)) for i, name in enumerate(self.band_tables()))

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class ForeignRun:
    """Another trainer's run, as the state that continues it under shardlm: `moments(name,
    first, last)` gives {step, and each moment's rows first..last-1} of our parameter `name`
    (None for one stepped under another name, e.g. tied); `pieces` the states of the
    trainer's registered pieces (update count, lr schedule, data position, best metric,
    loss scale)."""

    moments: object
    pieces: dict = field(default_factory=dict)
    num_updates: int = 0
    epoch: int = 1
