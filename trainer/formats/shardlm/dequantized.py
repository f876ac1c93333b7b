"""A model iPQ quantized (models/pq.py: centroids, assignments and counts in place of a
layer's weight) shown as the model it stands for: each quantized layer's weight rebuilt
from its centroids, a qkv_proj quantized by parts stacked back into one weight, as our
unquantized model names them. What `export-model` writes by default, and what a Hugging
Face export takes."""

import torch

from models.pq import quantized_specs, weight_of
from trainer.formats.reader import ModelReader

_PQ_TENSORS = (".centroids", ".assignments", ".counts")


class DequantizedReader(ModelReader):
    """`src` (a reader of a quantized model) with every quantized layer's weight rebuilt;
    `model`: the unquantized model of src's config, on the meta device (its shapes, and
    the parts a stacked weight holds)."""

    def __init__(self, src, model):
        super().__init__(src.path)
        self.src, self.model = src, model
        self.kind, self.files_dir, self.cfg = src.kind, src.files_dir, src.cfg
        quantized = quantized_specs({name: shape for name, (shape, _) in src.specs.items()})
        self.owners = {name.split(".parts.")[0] for name in quantized}  # the modules rebuilt
        self.specs = {
            name: spec for name, spec in src.specs.items() if not name.endswith(_PQ_TENSORS) and ".parts." not in name
        }
        for owner in self.owners:
            weight = model.get_parameter(owner + ".weight")
            dtype = next(src.specs[f"{q}.centroids"][1] for q in quantized if q.split(".parts.")[0] == owner)
            self.specs[owner + ".weight"] = (tuple(weight.shape), dtype)

    def get(self, name):
        owner = name[: -len(".weight")] if name.endswith(".weight") else None
        if owner not in self.owners:
            return self.src.get(name)
        if owner + ".centroids" in self.src.specs:
            return self._rebuilt(owner, self.specs[name][0][0])
        pieces = []
        for part, rows in self.model.stacked_rows(owner).items():
            prefix = f"{owner}.parts.{part}"
            quantized = prefix + ".centroids" in self.src.specs
            pieces.append(self._rebuilt(prefix, rows) if quantized else self.src.get(prefix + ".weight"))
        return torch.cat(pieces)

    def _rebuilt(self, module, rows):
        centroids, assignments = self.src.get(module + ".centroids"), self.src.get(module + ".assignments")
        return weight_of(centroids, assignments, rows)

    def vocab_size(self):
        return self.src.vocab_size()

    def close(self):
        self.src.close()
