"""fairseq's get_param (modules/quantization/pq/utils.py) without torch: a layer's block
size or centroid count from the quantization config. models/pq.py applies it to modules,
`plan` (trainer/plan/quantized.py) to the shapes it counts, so both read the config alike."""


def layer_param(kind, layer, name, config):
    """A layer's block size or centroid count from `config` ({type: (key, {value: param})}).
    kind: the config's name for the layer's type ("Linear", "Embedding"); layer: anything
    with the layer's features as attributes (in_features, embedding_dim, …). key
    "fuzzy_name": the first value (in the config's order) that is a substring of the layer's
    name; any other key: str(layer.<key>). "*" is the fallback; no match and no "*" raises
    KeyError, as in fairseq."""
    if kind not in config:
        raise KeyError(f"Layer type {kind} not in config for layer {name}")
    feature, params = config[kind]
    if feature != "fuzzy_name":
        value = str(getattr(layer, feature))
        if value not in params:
            if "*" not in params:
                raise KeyError(f"{feature}={value} not in config for layer {name}")
            value = "*"
    else:
        values = [key for key in params if key in name]
        if not values:
            if "*" not in params:
                raise KeyError(f"name={name} not in config for layer {name}")
            values = ["*"]
        value = values[0]
    return params[value]
