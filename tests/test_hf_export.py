"""export-model --format hf for the Llama family: a trained checkpoint becomes a directory
transformers loads as LlamaForCausalLM / Qwen3ForCausalLM with our logits, sharded as
save_pretrained shards, with a tokenizer that encodes as preprocess did."""

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf

import cli
from data.embedded_corpus import prepare_embedded_corpus
from data.indexed_dataset import IndexedDataset
from helpers import compose, train_updates
from models.transformer_lm import build_model
from trainer.formats.hf.llama import write_hf_llama
from trainer.formats.safetensors_file import safetensors_header, write_safetensors
from trainer.inference.load import load_model

transformers = pytest.importorskip("transformers")

SMALL = [
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "128",
    "--decoder-attention-heads",
    "4",
    "--decoder-kv-heads",
    "2",
    "--decoder-head-dim",
    "16",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--max-update",
    "3",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--disable-validation",
    "--log-format",
    "none",
]
TOKENS = torch.arange(3, 35).view(1, -1)  # the models' 32 positions


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Llama 3.2-shaped (tied output) on one rank; Qwen3-shaped (q/k norms, untied) on two
    FSDP ranks, so its tensors are stitched from both ranks' shards."""
    root = tmp_path_factory.mktemp("hf-export")
    train_updates(["--arch", "llama3_2_1b", *SMALL, "--save-dir", str(root / "llama")], 1, root)
    train_updates(
        ["--arch", "qwen3_8b", *SMALL, "--save-dir", str(root / "qwen3"), "--ddp-backend", "fully_sharded"], 2, root
    )
    return {name: root / name / "checkpoint_last" for name in ("llama", "qwen3")}


def _export(capsys, *argv):
    code = cli.export_model_main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def _load_hf(out, cls):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == cls
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    return model.eval()


def _max_diff(ckpt, hf):
    ours, _, _ = load_model(ckpt)
    with torch.no_grad():
        return (hf(TOKENS).logits - ours(TOKENS)).abs().max().item()


def test_llama_export_gives_our_logits(checkpoints, tmp_path, capsys):
    out = tmp_path / "hf"
    assert _export(capsys, "--path", checkpoints["llama"], "--out", out, "--format", "hf") == (0, "")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["pad_token_id"], config["eos_token_id"]) == (0, 1, 2)
    assert config["torch_dtype"] == "float32" and config["tie_word_embeddings"]
    header = safetensors_header(out / "model.safetensors")
    assert "lm_head.weight" not in header  # tied: transformers ties it to the embeddings
    assert header["model.layers.1.self_attn.k_proj.weight"]["shape"] == [32, 64]  # 2 kv heads of 16
    assert header["model.layers.1.mlp.up_proj.weight"]["shape"] == [128, 64]
    assert _max_diff(checkpoints["llama"], _load_hf(out, "LlamaForCausalLM")) < 1e-5

    # --dtype bf16: every tensor and the config say so, and transformers loads it as such.
    assert (
        _export(
            capsys, "--path", checkpoints["llama"], "--out", tmp_path / "bf16", "--format", "hf", "--dtype", "bf16"
        )[0]
        == 0
    )
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    header = safetensors_header(tmp_path / "bf16" / "model.safetensors")
    assert {h["dtype"] for name, h in header.items() if name != "__metadata__"} == {"BF16"}
    assert _load_hf(tmp_path / "bf16", "LlamaForCausalLM").dtype == torch.bfloat16


def test_qwen3_export_in_shards(checkpoints, tmp_path, capsys):
    out = tmp_path / "hf"
    assert _export(
        capsys, "--path", checkpoints["qwen3"], "--out", out, "--format", "hf", "--max-shard-size", "100KB"
    ) == (0, "")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    sizes, names = 0, {}
    for name in files:
        header = safetensors_header(out / name)
        header.pop("__metadata__")
        data = max(h["data_offsets"][1] for h in header.values())
        assert data <= 100_000 or len(header) == 1  # a tensor over the limit sits alone
        sizes += data
        names.update({tensor: name for tensor in header})
    assert index["weight_map"] == names and index["metadata"]["total_size"] == sizes
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_norm.weight" in names
    assert _max_diff(checkpoints["qwen3"], _load_hf(out, "Qwen3ForCausalLM")) < 1e-5


def test_tokenizer_encodes_as_preprocess(checkpoints, tmp_path, capsys):
    """AutoTokenizer on the corpus's lines gives the ids preprocess wrote for them."""
    out = tmp_path / "hf"
    assert _export(capsys, "--path", checkpoints["qwen3"], "--out", out, "--format", "hf")[0] == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    data = prepare_embedded_corpus()
    lines = (data / "text" / "valid.txt").read_text().splitlines()[:200]
    written = IndexedDataset(data / "valid")
    assert [tokenizer(line)["input_ids"] for line in lines] == [written[i].tolist() for i in range(len(lines))]


def test_each_of_our_tensors_is_read_once(tmp_path):
    """qkv_proj and fc1 are read once for their three and two parts: one of our tensors
    in memory at a time, each read from the checkpoint once."""
    cfg = compose(["--arch", "qwen3_8b", *SMALL]).model
    model = build_model(cfg, 96, 32, seed=1)
    params, reads = dict(model.named_parameters()), []

    def get_ours(name):
        reads.append(name)
        return params[name].detach()

    write_hf_llama(tmp_path, get_ours, [(n, p.shape) for n, p in params.items()], cfg, 96, 32, torch.float32)
    assert reads == list(params)


def _hf_tokenizer(root):
    """tokenizer.json + tokenizer_config.json as `preprocess --tokenizer` keeps them, with
    special ids other than fairseq's (no bos, eos 5, pad 6)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "rara", "lesabi", "bo", "ka", "<|end|>", "<|pad|>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|end|>",
                "pad_token": "<|pad|>",
                "unk_token": "<unk>",
            }
        )
    )


def _gpt2_export(root):
    """A GPT-style model as our own export format (model.safetensors + config.yaml), a
    --path export-model reads as it reads a checkpoint."""
    cfg = compose(
        [
            "--arch",
            "transformer_lm_gpt2_tiny",
            "--decoder-attention-heads",
            "2",
            "--decoder-ffn-embed-dim",
            "128",
            "--tokens-per-sample",
            "32",
        ]
    )
    params = dict(build_model(cfg.model, 64, 32, seed=1).named_parameters())
    root.mkdir()
    write_safetensors(
        root / "model.safetensors",
        [(n, p.shape, p.dtype) for n, p in params.items()],
        lambda n: params[n].detach(),
        {"format": "pt"},
    )
    (root / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    _hf_tokenizer(root)
    return root


def test_gpt_style_goes_to_gpt2_with_its_hf_tokenizer(tmp_path, capsys):
    src = _gpt2_export(tmp_path / "gpt")
    out = tmp_path / "hf"
    assert _export(capsys, "--path", src, "--out", out, "--format", "hf") == (0, "")
    _load_hf(out, "GPT2LMHeadModel")
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 5, 6)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the model's own files, as they were
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert transformers.AutoTokenizer.from_pretrained(out)("rara bo zz")["input_ids"] == [1, 3, 0]


def test_refusals_are_one_line_and_write_nothing(checkpoints, tmp_path, capsys):
    # RMSNorm without rotary embeddings: neither Llama nor GPT-2.
    src = tmp_path / "norope"
    shutil.copytree(checkpoints["llama"], src)
    cfg = OmegaConf.load(src / "config.yaml")
    cfg.model.rope = False
    (src / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    code, err = _export(capsys, "--path", src, "--out", tmp_path / "out", "--format", "hf")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "no rotary embeddings" in err and "rmsnorm norms; GPT-2's are LayerNorm" in err
    assert not (tmp_path / "out").exists()

    # An HF model already there (its config.json, or a sharded model's index): untouched.
    for marker in ("config.json", "model.safetensors.index.json"):
        taken = tmp_path / f"taken-{marker}"
        taken.mkdir()
        (taken / marker).write_text("{}")
        code, err = _export(capsys, "--path", checkpoints["llama"], "--out", taken, "--format", "hf")
        assert code == 2 and f"{marker} already exists" in err
        assert [p.name for p in taken.iterdir()] == [marker] and (taken / marker).read_text() == "{}"
    # Any other file the export would write is not overwritten either.
    taken = tmp_path / "taken-tokenizer"
    taken.mkdir()
    (taken / "tokenizer.json").write_text("mine")
    code, err = _export(capsys, "--path", checkpoints["llama"], "--out", taken, "--format", "hf")
    assert code == 2 and "already holds tokenizer.json" in err
    assert [p.name for p in taken.iterdir()] == ["tokenizer.json"]

    for argv, message in (
        (["--max-shard-size", "5 parsecs", "--format", "hf"], "give a positive size"),
        (["--max-shard-size", "1GB"], "splits a --format hf export"),
    ):
        code, err = _export(capsys, "--path", checkpoints["llama"], "--out", tmp_path / "out2", *argv)
        assert code == 2 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out2").exists()
