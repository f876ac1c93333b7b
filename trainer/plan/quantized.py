"""--quantization-config-path: the layers iPQ has quantized by the run's last stage, where
the most are (trainer/train/ipq.py quantizes stage after stage and the run ends in the last),
from the config's shapes alone. Torch-free: the layers are named as trainer/train/ipq.py's
fairseq_layers names a built model's (fairseq's names; qkv_proj as q_proj, k_proj and
v_proj), and each stage's regex and the block sizes and centroid counts are read by the
same rules (trainer/config/quantization.py, models/pq_config.py). tests/test_plan_ipq.py
checks the names and shapes against a built model's."""

from dataclasses import dataclass, replace

from models.config import adaptive_bands
from models.pq_config import layer_param
from trainer.config.quantization import check_stage_matches, load_config, stage_matches
from trainer.errors import UsageError
from trainer.plan.shapes import ModelShape, PQLayer


@dataclass
class Features:
    """What a fairseq config may key a layer's parameters on (its type's attributes)."""

    in_features: int = 0
    out_features: int = 0
    num_embeddings: int = 0
    embedding_dim: int = 0


def candidate_layers(model_cfg, m: ModelShape):
    """[(fairseq's name, type, rows, cols, decoder layer or -1)] of the model's linear layers
    and tables, in the model's order (models/transformer_lm.py, models/adaptive.py)."""
    dim = m.dim
    width_in, width_out = model_cfg.decoder_input_dim or dim, model_cfg.decoder_output_dim or dim
    root = []
    if model_cfg.adaptive_input:  # each band: its table, and its projection to d
        bands = adaptive_bands(model_cfg.adaptive_input_cutoff, m.vocab, width_in, model_cfg.adaptive_input_factor)
        for b, (start, end, width) in enumerate(bands):
            root.append((f"decoder.embed_tokens.embeddings.{b}.0", "Embedding", end - start, width, -1))
            root.append((f"decoder.embed_tokens.embeddings.{b}.1", "Linear", dim, width, -1))
    else:
        root.append(("decoder.embed_tokens", "Embedding", m.vocab, width_in, -1))
        if m.pq_noise:  # fairseq's d×d quant_noise layer
            root.append(("decoder.quant_noise", "Linear", dim, dim, -1))
        if width_in != dim:
            root.append(("decoder.project_in_dim", "Linear", dim, width_in, -1))
    if m.learned_positions:
        root.append(("decoder.embed_positions", "Embedding", m.learned_positions, dim, -1))
    layers = []
    kv = m.kv * m.hd
    for i in range(m.layers):
        attention = f"decoder.layers.{i}.self_attn."
        layers += [
            (attention + "q_proj", "Linear", m.inner, dim, i),
            (attention + "k_proj", "Linear", kv, dim, i),
            (attention + "v_proj", "Linear", kv, dim, i),
            (attention + "out_proj", "Linear", dim, m.inner, i),
        ]
        if m.is_sparse(i):  # its experts are no linear layers: the router is
            layers.append((f"decoder.layers.{i}.moe.router", "Linear", m.experts, dim, i))
        else:
            layers.append((f"decoder.layers.{i}.fc1", "Linear", m.fc1_width, dim, i))
            layers.append((f"decoder.layers.{i}.fc2", "Linear", dim, m.ffn, i))
    tail = []
    if width_out != dim and not model_cfg.tie_adaptive_weights:
        tail.append(("decoder.project_out_dim", "Linear", width_out, dim, -1))
    if model_cfg.adaptive_softmax_cutoff is not None:
        tail += adaptive_softmax_layers(model_cfg, m.vocab, width_out)
    elif not m.tied:
        tail.append(("decoder.output_projection", "Linear", m.vocab, width_out, -1))
    return root + layers + tail


def adaptive_softmax_layers(model_cfg, vocab, out):
    """The adaptive softmax's (models/adaptive.py): the head (the first band's words and a
    score per tail cluster; tied to the adaptive input, the cluster scores alone), then each
    tail's projection (unless tied) and words (unless tied)."""
    bands = adaptive_bands(model_cfg.adaptive_softmax_cutoff, vocab, out, model_cfg.adaptive_softmax_factor)
    tails, tied = len(bands) - 1, model_cfg.tie_adaptive_weights
    name = "decoder.adaptive_softmax."
    layers = [
        (name + "class_proj", "Linear", tails, out, -1)
        if tied
        else (name + "head", "Linear", bands[0][1] + tails, out, -1)
    ]
    for t, (start, end, width) in enumerate(bands[1:]):
        if not (tied and model_cfg.tie_adaptive_proj):
            layers.append((f"{name}tail.{t}.proj", "Linear", width, out, -1))
        if not tied:
            layers.append((f"{name}tail.{t}.words", "Linear", end - start, width, -1))
    return layers


def pq_layer(entry, config):
    """The PQLayer a stage makes of a candidate layer: its block size and centroid count."""
    name, kind, rows, cols, layer = entry
    if kind == "Linear":
        features = Features(in_features=cols, out_features=rows)
    else:
        features = Features(num_embeddings=rows, embedding_dim=cols)
    try:
        block = layer_param(kind, features, name, config["block_sizes"])
        centroids = layer_param(kind, features, name, config["n_centroids"])
    except KeyError as e:
        raise UsageError(f"quantization config: {e.args[0]}") from None
    if cols % block:
        raise UsageError(f"quantization config: block size {block} does not divide {name}'s {cols} input features")
    return PQLayer(name, layer, rows, cols, block, centroids)


def quantized_layers(model_cfg, m: ModelShape, config):
    """The PQLayers of every stage: each stage's regex names layers not quantized yet."""
    left, out = candidate_layers(model_cfg, m), []
    for stage, regex in enumerate(config["layers_to_quantize"]):
        names, _ = stage_matches(regex, [entry[0] for entry in left])
        check_stage_matches(stage, regex, names)
        out += [pq_layer(entry, config) for entry in left if entry[0] in names]
        left = [entry for entry in left if entry[0] not in names]
    return tuple(out)


def with_quantization(cfg, m: ModelShape):
    """m as the run's last stage holds it, under --quantization-config-path; else m."""
    path = cfg.common.quantization_config_path
    return replace(m, pq=quantized_layers(cfg.model, m, load_config(path))) if path else m


def summary(m: ModelShape, shard):
    """The report's line: what iPQ's last stage holds per rank."""
    centroids = sum(p.params for p in m.pq) * 4 / shard
    return (
        f"iPQ: {len(m.pq)} layers quantized at the last stage: centroids {centroids / 2**20:.3f} MB "
        f"(fp32, this rank's shards), assignments and counts {m.pq_buffer_bytes / 2**20:.3f} MB per rank "
        "(whole on every rank); their weights rebuilt in every forward"
    )
