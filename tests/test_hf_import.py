"""eval-lm and generate --path HF_DIR: a Hugging Face model directory (LlamaForCausalLM,
Qwen3ForCausalLM, GPT2LMHeadModel) loads with transformers' logits, eval-lm reports the loss transformers
computes on the same blocks, greedy generate gives transformers' tokens, and a bad
directory gets one line naming the file and the tensor."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cli
from data.hf_tokenizer import HFTokenizer
from data.indexed_dataset import IndexedDataset
from data.preprocess import preprocess
from helpers import byte_level_tokenizer, preprocess_options
from models.generate import sample
from trainer.errors import UsageError
from trainer.inference.generate import generate
from trainer.inference.load import load_model

transformers = pytest.importorskip("transformers")

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a lazy dog sleeps all day",
    "",
    "quick foxes and lazy dogs never meet",
    "the end of the story",
]
# llama3 scaling stretches the wavelengths past 16 positions: the 48-token inputs below need it.
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=64,
    rope_parameters=ROPE,
)


def _save(path, model_type, tokenizer, tie, kv_heads, extra_vocab=0):
    """A random model (every weight drawn, norms included) saved with save_pretrained,
    beside its tokenizer; config.json's pad_token_id is its eos, as often published."""
    tokenizer.save_pretrained(path)
    eos = tokenizer.eos_token_id
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    config = cls[0](
        vocab_size=len(tokenizer) + extra_vocab,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=eos,
        **SMALL,
    )
    torch.manual_seed(len(str(path)))
    model = cls[1](config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model.eval()


def _save_gpt2(path, tokenizer):
    """A random GPT2LMHeadModel as transformers writes it (its own gelu_new, tied output)."""
    tokenizer.save_pretrained(path)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Four models, tied and untied output, grouped-query and multi-head attention between
    them: llama (untied, 2 kv heads), llama_tied (tied, 4), qwen3 (untied, 4, an embedding of
    more rows than its tokenizer has ids, as Qwen3's), qwen3_tied (tied, 2); and the data
    dirs preprocess wrote with llama's and qwen3's tokenizers."""
    root = tmp_path_factory.mktemp("hf-import")
    llama_specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"]
    llama_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(TEXT * 5, llama_specials, llama_specials[0]),
        bos_token=llama_specials[0],
        eos_token=llama_specials[1],
    )
    qwen_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(TEXT * 5, ["<|endoftext|>", "<|vision_pad|>"]),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    models = {
        "llama": _save(root / "llama", "llama", llama_tok, False, 2),
        "llama_tied": _save(root / "llama_tied", "llama", llama_tok, True, 4),
        "qwen3": _save(root / "qwen3", "qwen3", qwen_tok, False, 4, extra_vocab=9),
        "qwen3_tied": _save(root / "qwen3_tied", "qwen3", qwen_tok, True, 2),
        "gpt2": _save_gpt2(root / "gpt2", qwen_tok),
    }
    (root / "valid.txt").write_text("\n".join(TEXT * 4) + "\n")
    data = {
        name: preprocess(
            preprocess_options(
                [
                    "--tokenizer",
                    str(root / name),
                    "--validpref",
                    str(root / "valid.txt"),
                    "--destdir",
                    str(root / f"data-{name}"),
                ]
            )
        )
        for name in ("llama", "qwen3")
    }
    return SimpleNamespace(root=root, models=models, data=data)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3", "qwen3_tied", "gpt2"])
def test_logits_equal_transformers(hf, name):
    ours, cfg, tok = load_model(hf.root / name)
    theirs = hf.models[name]
    assert ours.max_positions == 64 and cfg.task.tokens_per_sample == 64
    assert isinstance(tok, HFTokenizer)
    assert cfg.model.share_decoder_input_output_embed == (name.endswith("_tied") or name == "gpt2")
    # 48 positions (past rope's 16 original ones), every id, the pad ids among them.
    tokens = torch.arange(ours.vocab_size).roll(7)[:96].view(2, 48)
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert (ours(tokens) - expected).abs().max().item() < 1e-5
        # The pad id only decides which targets a loss skips: no logit changes.
        padded, _, _ = load_model(hf.root / name, pad=int(tokens[0, 3]))
        assert (padded(tokens) - expected).abs().max().item() < 1e-5


def _eval_env():
    from trainer.config.compose import compose_config
    from trainer.parallel.ranks import init_rank
    from trainer.rendezvous import Rendezvous

    cfg = compose_config([("common.cpu", True)], [], None, None)
    return init_rank(cfg, Rendezvous("", 1, rank=0, local_rank=0, local_world_size=1), needs_process_group=False)


def _reference_loss(model, stream, seq_starts, eos, T):
    """transformers' mean loss (nats) on the blocks eval-lm scores with --tokens-per-sample T
    (mode none, fairseq's): block k predicts stream[kT … kT+T-1] from the token before each,
    </s> before a block that starts a sequence."""
    targets, nll = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(stream), T):
            context = eos if start in seq_starts else stream[start - 1]
            item = torch.from_numpy(np.concatenate([[context], stream[start : start + T]]))[None]
            logits = model(item[:, :-1]).logits
            nll += torch.nn.functional.cross_entropy(logits[0], item[0, 1:], reduction="sum").item()
            targets += item.shape[1] - 1
    assert targets == len(stream)
    return nll / targets


def test_eval_lm_reports_transformers_loss(hf):
    """llama: data whose pad (<|finetune_right_pad_id|>) is not config.json's pad_token_id
    (its eos, a token of the data); qwen3: an embedding of more rows than the data's ids."""
    from trainer.inference.eval_lm import eval_lm
    from trainer.parallel.ranks import teardown

    env = _eval_env()
    try:
        # gpt2 has qwen3's tokenizer, and so its data
        for name, data in (("llama", "llama"), ("qwen3", "qwen3"), ("gpt2", "qwen3")):
            tok = HFTokenizer(hf.root / name)
            indexed = IndexedDataset(hf.data[data] / "valid")
            stream = indexed.tokens.astype(np.int64)
            seq_starts = set((np.cumsum(indexed.sizes) - indexed.sizes).tolist())
            assert tok.pad not in stream and tok.eos in stream
            args = SimpleNamespace(
                path=hf.root / name,
                data=str(hf.data[data]),
                gen_subset="valid",
                tokens_per_sample=24,
                context_window=0,
                sample_break_mode=None,
                batch_size=4,
                max_tokens=None,
                num_workers=0,
                no_progress_bar=True,
                ema=False,
            )
            loss = eval_lm(args, env)
            reference = _reference_loss(hf.models[name], stream, seq_starts, tok.eos, 24)
            assert loss * math.log(2) == pytest.approx(reference, rel=1e-5)
        # Another model's tokenizer is refused (qwen3's embedding would hold llama's ids).
        with pytest.raises(UsageError, match="tokenizer .* is not the model's"):
            eval_lm(SimpleNamespace(**{**vars(args), "data": str(hf.data["llama"])}), env)
    finally:
        teardown()


def test_greedy_generate_is_transformers(hf):
    """The KV-cached greedy decode of a Qwen3 and a GPT-2 model, and `generate --temperature 0`
    of a Llama one (its tokenizer starts the prompt with <|begin_of_text|>)."""
    for name in ("qwen3", "gpt2"):
        ours, _, tok = load_model(hf.root / name)
        ids = tok.encode("the lazy dog")
        expected = (
            hf.models[name]
            .generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30, eos_token_id=tok.eos)[0, len(ids) :]
            .tolist()
        )
        assert sample(ours, ids, 30, temperature=0, eos=tok.eos) == [t for t in expected if t != tok.eos]
    # An empty prompt: Qwen's template adds no <s>, and it has none; its eos starts the text.
    assert (
        generate(
            SimpleNamespace(
                path=hf.root / "qwen3",
                prompt=[""],
                max_new_tokens=3,
                temperature=0.0,
                top_k=0,
                top_p=1.0,
                seed=1,
                no_kv_cache=False,
                ema=False,
            )
        )
        == 0
    )

    tok = HFTokenizer(hf.root / "llama")
    ids = tok.encode("the quick fox")
    assert ids[0] == tok.bos
    new = (
        hf.models["llama"]
        .generate(torch.tensor([ids]), do_sample=False, max_new_tokens=30, eos_token_id=tok.eos)[0, len(ids) :]
        .tolist()
    )
    r = subprocess.run(
        [
            str(Path(sys.executable).with_name("generate")),
            "--path",
            str(hf.root / "llama"),
            "--prompt",
            "the quick fox",
            "--temperature",
            "0",
            "--max-new-tokens",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == tok.decode(ids + [t for t in new if t != tok.eos]) + "\n"


# ------------------------------------------------------------------ bad directories


def _sharded(hf, tmp_path):
    """llama saved again in shards of a few tensors, with model.safetensors.index.json."""
    out = tmp_path / "sharded"
    hf.models["llama"].save_pretrained(out, max_shard_size="100KB")
    for f in (hf.root / "llama").iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def _rewritten(hf, tmp_path, name, change):
    """llama with model.safetensors rewritten by change(tensors)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / name
    shutil.copytree(hf.root / "llama", out)
    tensors = load_file(out / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _config(hf, tmp_path, name, text):
    out = tmp_path / name
    shutil.copytree(hf.root / "llama", out)
    (out / "config.json").write_text(text)
    return out


def _cut(hf, tmp_path, name, size):
    out = tmp_path / name
    shutil.copytree(hf.root / "llama", out)
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(size(f.seek(0, 2)))
    return out


def test_bad_directories_get_one_line(hf, tmp_path, capsys):
    sharded = _sharded(hf, tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.1.mlp.down_proj.weight"]
    held = sorted(name for name, f in index.items() if f == shard)[0]
    (sharded / shard).unlink()
    config = json.loads((hf.root / "llama" / "config.json").read_text())
    raw = (hf.root / "llama" / "model.safetensors").read_bytes()
    header_bytes = 8 + int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:header_bytes])
    last = max((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    cases = [  # (directory, what its one line must say)
        (sharded, [f"missing shard {sharded / shard}", held]),
        (_cut(hf, tmp_path, "cut", lambda n: n - 7), ["model.safetensors is cut short", f"tensor {last} ends"]),
        (
            _cut(hf, tmp_path, "cut_header", lambda n: header_bytes - 40),
            ["model.safetensors is not a readable safetensors file"],
        ),
        (
            _rewritten(
                hf,
                tmp_path,
                "shape",
                lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
            ),
            ["model.safetensors: tensor model.layers.0.self_attn.k_proj.weight is [64, 64]", "[32, 64]"],
        ),
        (
            _rewritten(
                hf, tmp_path, "int", lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
            ),
            ["model.safetensors: tensor model.norm.weight is I32, not a float type"],
        ),
        (
            _rewritten(hf, tmp_path, "missing", lambda t: t.pop("model.layers.1.self_attn.q_proj.weight")),
            ["has no tensor model.layers.1.self_attn.q_proj.weight"],
        ),
        (
            _config(hf, tmp_path, "gpt_neox", json.dumps({**config, "model_type": "gpt_neox"})),
            ["config.json: model_type 'gpt_neox' is not supported"],
        ),
        (_config(hf, tmp_path, "json", json.dumps(config)[:-20]), ["config.json is not valid JSON"]),
    ]
    data = str(hf.data["llama"])
    code = cli.eval_lm_main([data, "--path", str(tmp_path / "nothing"), "--gen-subset", "valid"])
    assert code != 0 and "neither a checkpoint" in capsys.readouterr().err
    for path, says in cases:
        with pytest.raises(UsageError) as e:
            load_model(path)
        assert all(s in str(e.value) for s in says), (path.name, str(e.value))
        assert cli.eval_lm_main([data, "--path", str(path), "--gen-subset", "valid"]) == code
        err = capsys.readouterr().err
        assert err == f"eval-lm: error: {e.value}\n", (path.name, err)
    # export-model reads checkpoints of ours: an HF directory is already in that format.
    assert cli.export_model_main(["--path", str(hf.root / "llama"), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a Hugging Face model directory" in err and not (tmp_path / "out").exists()
