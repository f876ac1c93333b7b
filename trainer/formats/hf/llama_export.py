"""Our Llama-family TransformerLM as a Hugging Face LlamaForCausalLM (Qwen3ForCausalLM with
--qk-norm) directory: config.json and the weights, sharded as save_pretrained shards them.

Our fused tensors are split back by rows (trainer/formats/hf/llama.py hf_parts): qkv_proj into
q_proj, k_proj and v_proj, fc1 into gate_proj and up_proj. Each HF tensor is a row range
of one of ours, and the HF tensors of one of ours are written one after the other, so one
of our tensors is read at a time, and held only while its parts are written.
"""

import json

from trainer.errors import UsageError
from trainer.formats.hf.llama import hf_config, hf_parts
from trainer.formats.hf.shards import DEFAULT_MAX_SHARD_SIZE, write_hf_weights

HF_METADATA = {"format": "pt"}  # transformers checks it before loading a safetensors file


def hf_tensor_sources(our_specs, model_cfg):
    """our_specs [(our name, shape)] → [(hf name, hf shape, our name, first row, end row)],
    in our order. A tied output has no tensor of its own, so no lm_head is written for it."""
    sources = []
    for name, shape in our_specs:
        try:
            parts = hf_parts(name, model_cfg)
        except KeyError:
            raise UsageError(
                f"cannot export as a Hugging Face Llama model: it has a tensor {name} "
                "that Llama's layers have no place for"
            ) from None
        shape, start = tuple(shape), 0
        for hf_name, rows in parts:
            rows = shape[0] if rows is None else rows
            sources.append((hf_name, (rows, *shape[1:]), name, start, start + rows))
            start += rows
        if start != shape[0]:  # a config that does not describe the checkpoint's tensors
            raise UsageError(
                f"{name} has {shape[0]} rows, its config.yaml implies {start}; the checkpoint and its config disagree"
            )
    return sources


def write_hf_llama(
    out_dir,
    get_ours,
    our_specs,
    model_cfg,
    vocab_size,
    max_positions,
    dtype,
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
    **token_ids,
):
    """A directory AutoModelForCausalLM loads: config.json + model.safetensors or shards and
    their index. `get_ours(name)` returns one of our parameters, whole, on the CPU;
    token_ids: bos_token_id, eos_token_id, pad_token_id."""
    sources = hf_tensor_sources(our_specs, model_cfg)
    config = hf_config(model_cfg, vocab_size, max_positions, dtype=str(dtype).removeprefix("torch."), **token_ids)
    by_name = {hf_name: (ours, lo, hi) for hf_name, _, ours, lo, hi in sources}
    held = {}  # the one tensor of ours whose parts are being written

    def get_tensor(hf_name):
        ours, lo, hi = by_name[hf_name]
        if ours not in held:
            held.clear()
            held[ours] = get_ours(ours)
        return held[ours][lo:hi].to(dtype).contiguous()

    write_hf_weights(
        out_dir, [(hf_name, shape, dtype) for hf_name, shape, *_ in sources], get_tensor, max_shard_size, HF_METADATA
    )
    held.clear()
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
