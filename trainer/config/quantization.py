"""--quantization-config-path's YAML file (fairseq 0.12's modules/quantization/
quantization_options.py) and its regexes' rule for naming layers: what `train`'s iPQ
(trainer/train/ipq.py, trainer/train/quantization.py) and `plan` (trainer/plan/quantized.py)
both read. Torch-free.

The file has three optional entries; a missing one takes fairseq's default:

    n_centroids:            # per layer type: {key: <feature>, value: {<feature value>: n}}
      Linear: {key: in_features, value: {"*": 256}}
    block_sizes:            # key fuzzy_name: the first value that is a substring of the name
      Linear: {key: fuzzy_name, value: {fc: 8, attn: 4, emb: 4}}
    layers_to_quantize:     # one regex per stage, matched at the start of a layer's name
      - decoder\\.layers\\.\\d+\\.fc[12]
"""

import re

import yaml

from trainer.errors import UsageError

# fairseq's defaults, for a file that leaves an entry out (or for no file at all)
DEFAULTS = {
    "n_centroids": {
        "Linear": ("in_features", {"*": 256}),
        "Embedding": ("embedding_dim", {"*": 256}),
    },
    "block_sizes": {
        "Linear": ("fuzzy_name", {"fc": 8, "attn": 4, "emb": 4}),
        "Embedding": ("fuzzy_name", {"emb": 8}),
    },
    "layers_to_quantize": [
        "decoder\\.layers\\.\\d+\\.fc[12]",
        "decoder\\.embed_tokens\\.embeddings\\.[012]\\.[01]",
        "decoder\\.layers\\.\\d+\\.self_attn\\.(k_proj|v_proj|q_proj|out_proj)",
    ],
}


def _key_value(path, entry):
    """fairseq's convert_yaml_to_tuple: {key: k, value: v} → (k, v)."""
    if not isinstance(entry, dict) or "key" not in entry or not isinstance(entry.get("value"), dict):
        raise UsageError(f"quantization config: {path} must be {{key: <feature>, value: {{<value>: <number>}}}}")
    return entry["key"], entry["value"]


def parse_config(data):
    """fairseq's parse_config_yaml on a loaded YAML document: its three entries, defaults
    for those it lacks. Strings are kept as YAML read them: in a plain (unquoted) scalar a
    backslash is itself, so `decoder\\\\.layers` is the regex decoder, backslash, any char."""
    data = data or {}
    if not isinstance(data, dict):
        raise UsageError("quantization config: expected a mapping with n_centroids, block_sizes, layers_to_quantize")
    config = dict(DEFAULTS)
    for entry in ("n_centroids", "block_sizes"):
        if entry in data:
            config[entry] = {kind: _key_value(f"{entry}.{kind}", v) for kind, v in data[entry].items()}
    if "layers_to_quantize" in data:
        stages = data["layers_to_quantize"]
        if not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages):
            raise UsageError("quantization config: layers_to_quantize must be a list of regexes, one per stage")
        config["layers_to_quantize"] = stages
    return config


def load_config(path):
    """The parsed file at `path` (None: fairseq's defaults)."""
    if path is None:
        return parse_config({})
    try:
        with open(path) as f:
            return parse_config(yaml.safe_load(f))
    except OSError as e:
        raise UsageError(f"--quantization-config-path: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"--quantization-config-path: {path} is not YAML: {str(e).splitlines()[0]}") from None


def check_stage_matches(stage, regex, names):
    """A stage whose regex matches no layer is refused: fairseq would log `quantized layers:
    []` and fine-tune an unquantized model (its own example config does this, its regexes'
    backslashes doubled inside plain YAML scalars)."""
    if not names:
        hint = " (a plain YAML scalar keeps `\\\\` as two backslashes: write `\\.`)" if "\\\\" in regex else ""
        raise UsageError(f"quantization config: layers_to_quantize[{stage}] = {regex} matches no layer{hint}")


def stage_matches(regex, names):
    """(the names, fairseq's layer names, that a stage's regex matches as fairseq's get_layers
    does: at the start of the name, an optional "module." before it; the regex read). fairseq's
    own example config writes its regexes in plain YAML scalars with their backslashes
    doubled, which match no layer in fairseq (its run then quantizes nothing): such a regex is
    read with single backslashes (the caller says so where the regex read is not the one given)."""

    def matching(pattern):
        compiled = re.compile("(module\\.)?(" + pattern + ")")
        return [name for name in names if compiled.match(name)]

    found = matching(regex)
    if not found and "\\\\" in regex:
        single = regex.replace("\\\\", "\\")
        found = matching(single)
        if found:
            return found, single
    return found, regex
