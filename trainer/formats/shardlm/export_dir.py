"""An export of export-model: `model.safetensors` (every parameter of ours, whole, under our
names), the run's `config.yaml` and the tokenizer. Torch-free: found without reading it."""

EXPORT_FILE = "model.safetensors"


def is_export(path):
    return (path / EXPORT_FILE).is_file() and (path / "config.yaml").is_file()
