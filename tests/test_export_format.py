"""Export formats: our safetensors reader/writer, and the HF GPT-2 mapping giving the same logits."""

import json
import struct

import pytest
import torch

from models.config import TransformerLMConfig
from models.transformer_lm import build_model
from trainer.errors import UsageError
from trainer.formats.hf.gpt2 import check_hf_compatible, hf_config, hf_tensor_specs, write_hf_gpt2
from trainer.formats.safetensors_file import read_safetensors, safetensors_header, write_safetensors
from trainer.inference.load import load_model


def _sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # odd bytes: later tensors unaligned
        "f16": torch.randn(2, 3, generator=g).half(),
        "f64": torch.randn(4, generator=g).double(),
        "i64": torch.arange(-3, 3),
        "i32": torch.tensor([[1, -2], [3, 4]], dtype=torch.int32),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
    }


def _write(path, tensors, metadata=None):
    specs = [(name, t.shape, t.dtype) for name, t in tensors.items()]
    calls = []

    def get(name):
        calls.append(name)
        return tensors[name]

    write_safetensors(path, specs, get, metadata)
    return calls


def test_round_trip_streams_in_order(tmp_path):
    tensors, path = _sample_tensors(), tmp_path / "m.safetensors"
    calls = _write(path, tensors, {"format": "pt", "step": "12"})
    assert calls == list(tensors)  # once each, in spec order
    loaded, metadata = read_safetensors(path)
    assert metadata == {"format": "pt", "step": "12"}
    assert list(loaded) == list(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    some, _ = read_safetensors(path, names=["bf16", "scalar"])
    assert list(some) == ["bf16", "scalar"] and torch.equal(some["bf16"], tensors["bf16"])
    assert not (tmp_path / "m.safetensors.tmp").exists()


def test_header_is_padded_and_offsets_are_contiguous(tmp_path):
    tensors, path = _sample_tensors(), tmp_path / "m.safetensors"
    _write(path, tensors)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8 : 8 + n].decode().startswith("{")
    header = json.loads(raw[8 : 8 + n])
    assert header == safetensors_header(path) and "__metadata__" not in header
    assert header["bf16"] == {"dtype": "BF16", "shape": [7], "data_offsets": [60, 74]}
    assert header["scalar"]["shape"] == [] and header["empty"]["shape"] == [0, 4]
    ends = [header[name]["data_offsets"] for name in tensors]
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] == len(raw) - 8 - n


def test_spec_mismatch_fails_and_leaves_no_file(tmp_path):
    path = tmp_path / "m.safetensors"
    with pytest.raises(ValueError, match=r"tensor 'w' is \(2, 3\) torch.float32, but its spec says \(3, 2\)"):
        write_safetensors(path, [("w", (3, 2), torch.float32)], lambda name: torch.zeros(2, 3))
    with pytest.raises(ValueError, match="torch.bfloat16"):
        write_safetensors(path, [("w", (2,), torch.bfloat16)], lambda name: torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_malformed_files_raise_one_line_value_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    _write(path, _sample_tensors())
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["f32"]["dtype"] = "F99"
    bad_dtype = json.dumps(header).encode()
    cases = {
        "truncated": (raw[:-3], "truncated"),
        "short": (raw[:5], "shorter than"),
        "huge header": (struct.pack("<Q", 10**12) + raw[8:], "exceeds the file"),
        "not json": (raw[:8] + b"x" * n + raw[8 + n :], "not JSON"),
        "bad dtype": (struct.pack("<Q", len(bad_dtype)) + bad_dtype + raw[8 + n :], "no known dtype"),
    }
    for case, (content, message) in cases.items():
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message) as e:
            read_safetensors(path)
        assert "\n" not in str(e.value), case


def test_reference_library_reads_our_file(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors, path = _sample_tensors(), tmp_path / "m.safetensors"
    _write(path, tensors, {"format": "pt"})
    loaded = safetensors_torch.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[name], t) for name, t in tensors.items())


# --- HuggingFace GPT-2 ---------------------------------------------------------------

VOCAB, POSITIONS = 96, 32
TINY = dict(decoder_layers=2, decoder_embed_dim=64, decoder_ffn_embed_dim=128, decoder_attention_heads=2, dropout=0.0)
VARIANTS = {
    "learned_tied_gelu": dict(
        decoder_learned_pos=True, share_decoder_input_output_embed=True, activation_fn="gelu", no_scale_embedding=True
    ),
    "sinusoidal_scaled_relu_untied": dict(activation_fn="relu"),
    "scaled_tied_no_positions": dict(share_decoder_input_output_embed=True, no_token_positional_embeddings=True),
}


def _export(tmp_path, cfg):
    model = build_model(cfg, VOCAB, POSITIONS, seed=3).eval()
    with torch.no_grad():  # init zeroes biases and sets norms to 1; perturb so a mix-up shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    params = dict(model.named_parameters())
    write_hf_gpt2(tmp_path, lambda name: params[name].detach(), cfg, VOCAB, POSITIONS, eos_token_id=2)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_export_layout(tmp_path, variant):
    cfg = TransformerLMConfig(**TINY, **VARIANTS[variant])
    _export(tmp_path, cfg)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == hf_config(cfg, VOCAB, POSITIONS, eos_token_id=2, dtype=torch.float32)
    header = safetensors_header(tmp_path / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    specs = hf_tensor_specs(cfg, VOCAB, POSITIONS, torch.float32)
    assert [(n, tuple(h["shape"])) for n, h in header.items()] == [(n, s) for n, s, _ in specs]
    assert header["transformer.h.1.attn.c_attn.weight"]["shape"] == [64, 192]
    assert ("lm_head.weight" in header) == (not config["tie_word_embeddings"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_gpt2_gives_our_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    cfg = TransformerLMConfig(**TINY, **VARIANTS[variant])
    model = _export(tmp_path, cfg)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(0))
    read_back, _, _ = load_model(tmp_path)  # every format shardlm writes, it reads
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
        assert (ours - theirs).abs().max().item() < 1e-4
        assert (read_back(tokens) - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(decoder_normalize_before=False), "post-norm"),
        (dict(no_decoder_final_norm=True), "ln_f"),
        (dict(layernorm_embedding=True), "layernorm_embedding"),
    ],
)
def test_incompatible_models_are_refused(option, message):
    with pytest.raises(UsageError, match=message):
        check_hf_compatible(TransformerLMConfig(**TINY, **option))
