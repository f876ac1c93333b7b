"""Checkpoints written by fairseq-train 0.12.2 (tests/fixtures/fairseq/, see its README):
read safely, scored as fairseq-eval-lm scored them, sampled as fairseq's generator samples,
exported, planned, fine-tuned, and resumed so that the next updates are fairseq's own.

The reference for the model's numbers is an independent port of fairseq's decoder, written
here from fairseq's TransformerDecoderBase, TransformerDecoderLayerBase, MultiheadAttention,
make_positions and SinusoidalPositionalEmbedding, reading fairseq's own tensor names."""

import argparse
import json
import math
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cli
from helpers import train_here, train_updates

FIXTURES = Path(__file__).parent / "fixtures" / "fairseq"
DATA = FIXTURES / "data-bin"
PAD, EOS = 1, 2
# fairseq's command line of the `resume` run, as in resume/cmd.txt (its DATA first).
RESUME_FLAGS = (
    "--task language_modeling --tokens-per-sample 64 --batch-size 8 --optimizer adam "
    "--adam-betas (0.9,0.98) --lr 0.001 --lr-scheduler inverse_sqrt --warmup-updates 10 --cpu "
    "--no-epoch-checkpoints --seed 3 --dropout 0 --arch transformer_lm --decoder-layers 2 "
    "--decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 2 "
    "--share-decoder-input-output-embed --max-update 30 --save-interval-updates 20 --keep-interval-updates 5"
).split()


def _checkpoint(name):
    return next((FIXTURES / name).glob("*.pt"))


def _state(name):
    return torch.load(_checkpoint(name), weights_only=True)


def _in_process(capsys, cmd, *args):
    capsys.readouterr()
    code = cli.COMMANDS[cmd]([str(a) for a in args])
    out, err = capsys.readouterr()
    return code or 0, out, err


# ------------------------------------------------------------------ fairseq's decoder, ported
def _layer_norm(x, sd, name):
    return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], 1e-5)


def _linear(x, sd, name):
    return F.linear(x, sd[name + ".weight"], sd.get(name + ".bias"))


def fairseq_logits(sd, m, tokens):
    """fairseq's TransformerLanguageModel forward (no incremental state): B×T ids → logits."""
    dim, heads = m["decoder_embed_dim"], m["decoder_attention_heads"]
    mask = tokens.ne(PAD).int()
    positions = (torch.cumsum(mask, dim=1) * mask).long() + PAD  # utils.make_positions
    x = sd["decoder.embed_tokens.weight"][tokens]
    if not m["no_scale_embedding"]:
        x = x * math.sqrt(dim)
    if "decoder.project_in_dim.weight" in sd:
        x = F.linear(x, sd["decoder.project_in_dim.weight"])
    if m["decoder_learned_pos"]:
        x = x + sd["decoder.embed_positions.weight"][positions]
    else:  # SinusoidalPositionalEmbedding.get_embedding, its padding row zero
        half = dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        angles = torch.arange(int(positions.max()) + 1, dtype=torch.float)[:, None] * freq[None, :]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        table[PAD] = 0
        x = x + table[positions]
    B, T, _ = x.shape
    future = torch.triu(torch.full((T, T), float("-inf")), 1)
    pre = m["decoder_normalize_before"]
    act = {"relu": F.relu, "gelu": F.gelu}[m["activation_fn"]]
    for i in range(m["decoder_layers"]):
        p = f"decoder.layers.{i}."
        residual, h = x, _layer_norm(x, sd, p + "self_attn_layer_norm") if pre else x
        q = _linear(h, sd, p + "self_attn.q_proj") * (dim // heads) ** -0.5
        k, v = _linear(h, sd, p + "self_attn.k_proj"), _linear(h, sd, p + "self_attn.v_proj")
        q, k, v = (t.view(B, T, heads, dim // heads).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax((q @ k.transpose(-1, -2) + future).float(), dim=-1)
        h = _linear((weights @ v).transpose(1, 2).reshape(B, T, dim), sd, p + "self_attn.out_proj")
        x = residual + h
        x = x if pre else _layer_norm(x, sd, p + "self_attn_layer_norm")
        residual, h = x, _layer_norm(x, sd, p + "final_layer_norm") if pre else x
        x = residual + _linear(act(_linear(h, sd, p + "fc1")), sd, p + "fc2")
        x = x if pre else _layer_norm(x, sd, p + "final_layer_norm")
    if "decoder.layer_norm.weight" in sd:
        x = _layer_norm(x, sd, "decoder.layer_norm")
    if "decoder.project_out_dim.weight" in sd:
        x = F.linear(x, sd["decoder.project_out_dim.weight"])
    return F.linear(x, sd["decoder.output_projection.weight"])


def fairseq_greedy(sd, m, prefix, max_len):
    """fairseq's SequenceGenerator with --beam 1 as LanguageModelingTask.inference_step runs
    it: decoding starts from </s>, the prompt is prefix_tokens, <pad> is never chosen, </s>
    ends the hypothesis. Returns the tokens after the prompt, without the </s>."""
    tokens = [EOS]
    for step in range(max_len):
        lprobs = torch.log_softmax(fairseq_logits(sd, m, torch.tensor([tokens]))[0, -1].float(), dim=-1)
        lprobs[PAD] = float("-inf")
        token = prefix[step] if step < len(prefix) else int(lprobs.argmax())
        if token == EOS:
            break
        tokens.append(token)
    return tokens[1 + len(prefix) :]


@pytest.mark.parametrize("name", ["lm", "gpt"])
def test_our_model_of_a_fairseq_checkpoint_gives_fairseqs_logits(name):
    from trainer.inference.load import load_model

    state = _state(name)
    model, cfg, _ = load_model(_checkpoint(name))
    tokens = torch.tensor([[EOS, 17, 5, 300, 4, 919, 12, 8, 100, 3] * 6])  # 60 of its 64 positions
    with torch.no_grad():
        ours, theirs = model(tokens), fairseq_logits(state["model"], state["cfg"]["model"], tokens)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (ours - theirs).abs().max()


def _normformer_flags(tmp_path):
    """lm's checkpoint as fairseq 0.12.2 writes a `transformer_lm --scale-attn --scale-fc
    --scale-heads` run: the flags in its config, no NormFormer tensors (its layers never see
    the flags), so fairseq-eval-lm scores it as lm's eval.log does."""
    state = _state("lm")
    state["cfg"]["model"].update(scale_attn=True, scale_fc=True, scale_heads=True)
    torch.save(state, tmp_path / "checkpoint_last.pt")
    return tmp_path / "checkpoint_last.pt"


@pytest.mark.parametrize("name", ["lm", "gpt", "lm-normformer-flags"])
def test_eval_lm_gives_fairseq_eval_lms_loss(name, capsys, caplog, tmp_path):
    """fairseq-eval-lm --tokens-per-sample 64 --batch-size 8 on the same split (its eval.log)."""
    fixture, *flags = name.split("-", 1)
    logged = (FIXTURES / fixture / "eval.log").read_text()
    theirs = float(re.search(r"Loss \(base 2\): ([\d.]+)", logged)[1])
    count = int(re.search(r"Evaluated ([\d,]+) tokens", logged)[1].replace(",", ""))
    path = _normformer_flags(tmp_path) if flags else _checkpoint(fixture)
    code, out, err = _in_process(capsys, "eval-lm", DATA, "--path", path, "--tokens-per-sample", 64, "--batch-size", 8)
    assert code == 0, err
    assert f"Evaluated {count:,} tokens" in out
    assert f"Loss (base 2): {theirs:.4f}," in out, out
    warned = [r.getMessage() for r in caplog.records if "NormFormer" in r.getMessage()]
    assert len(warned) == (1 if flags else 0) and all("\n" not in w for w in warned), warned
    if flags:
        assert "--scale-attn --scale-fc --scale-heads (NormFormer)" in warned[0] and "did not apply" in warned[0]


def test_greedy_generate_gives_fairseqs_tokens(tmp_path, capsys):
    """A model of 30 updates ends every sentence at once (</s> is the likeliest token after
    any prompt), so the checkpoint is also run with its </s> output row zeroed: then both
    decoders go on for all 16 tokens and every greedy choice is compared."""
    from data.tokenizer import load_tokenizer

    state, tok = _state("gpt"), load_tokenizer(DATA)
    no_eos = tmp_path / "checkpoint_last.pt"
    state["model"]["decoder.output_projection.weight"][EOS] = 0.0
    torch.save(state, no_eos)
    prompts = ["tapune enrupu vorune", "kavo", "shika voshial orne taka"]
    for path in (_checkpoint("gpt"), no_eos):
        sd, m = torch.load(path, weights_only=True)["model"], state["cfg"]["model"]
        argv = [DATA, "--path", path, "--temperature", "0", "--max-new-tokens", 16]
        for prompt in prompts:
            new = fairseq_greedy(sd, m, tok.encode(prompt), len(tok.encode(prompt)) + 16)
            assert len(new) == (16 if path == no_eos else 0)
            code, out, err = _in_process(capsys, "generate", *argv, "--prompt", prompt)
            assert code == 0, err
            assert out.strip() == tok.decode(tok.encode(prompt) + new), (prompt, out)


# ------------------------------------------------------------------ reading safely
def test_a_crafted_file_is_refused_unread(tmp_path, capsys):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))

    bad = tmp_path / "checkpoint_last.pt"
    torch.save({"model": {}, "cfg": Payload()}, bad)
    code, _, err = _in_process(capsys, "eval-lm", DATA, "--path", bad)
    assert code != 0 and not marker.exists()
    assert err.count("\n") == 1 and "refused unread" in err and "a reference to exec" in err, err


def test_a_fairseq_010_checkpoint_with_args_loads(tmp_path, capsys, monkeypatch):
    """Before 0.10 fairseq saved its options as an argparse.Namespace (`args`), with only the
    keys each arch set; the rest take base_lm_architecture's defaults (pre-norm forced).
    Before 0.9 its extra_state held its meters as objects of fairseq's classes."""
    state = _state("gpt")
    model_cfg = state["cfg"]["model"]
    keys = ("decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads")
    args = argparse.Namespace(arch="transformer_lm_gpt", tokens_per_sample=64, **{k: model_cfg[k] for k in keys})
    meters = types.ModuleType("fairseq.meters")  # where pickle finds the class it names
    meters.AverageMeter = type("AverageMeter", (), {"__module__": "fairseq.meters"})
    monkeypatch.setitem(sys.modules, "fairseq", types.ModuleType("fairseq"))
    monkeypatch.setitem(sys.modules, "fairseq.meters", meters)
    meter = meters.AverageMeter()
    meter.avg, meter.count = 9.3, 30
    old = tmp_path / "model.pt"
    extra = {"train_meters": {"train_loss": meter}, "train_iterator": {"epoch": 1, "iterations_in_epoch": 30}}
    torch.save({"args": args, "model": state["model"], "extra_state": extra}, old, _use_new_zipfile_serialization=False)
    new = _in_process(capsys, "eval-lm", DATA, "--path", _checkpoint("gpt"), "--batch-size", 8)
    legacy = _in_process(capsys, "eval-lm", DATA, "--path", old, "--batch-size", 8)
    assert legacy[0] == 0, legacy[2]
    assert legacy[1].splitlines()[-1] == new[1].splitlines()[-1]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"character_embeddings": True}, "character-CNN input embeddings (--character-embeddings) is not supported"),
        ({"_name": "lstm_lm"}, "arch 'lstm_lm' is not a fairseq transformer language model"),
        ({"activation_fn": "gelu_2"}, "activation_fn 'gelu_2' is not supported"),
    ],
)
def test_a_fairseq_feature_we_lack_is_refused_in_one_line(change, message, tmp_path, capsys):
    state = _state("gpt")
    state["cfg"]["model"].update(change)
    path = tmp_path / "checkpoint_last.pt"
    torch.save(state, path)
    code, _, err = _in_process(capsys, "eval-lm", DATA, "--path", path)
    assert code != 0 and err.count("\n") == 1 and message in err, err


# ------------------------------------------------------------------ export, plan
def test_export_to_hugging_face_or_a_one_line_reason(tmp_path, capsys):
    import transformers

    code, _, err = _in_process(
        capsys, "export-model", "--path", _checkpoint("gpt"), "--out", tmp_path / "hf", "--format", "hf"
    )
    assert code == 0, err
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    state = _state("gpt")
    tokens = torch.tensor([[EOS, 17, 5, 300, 4, 919, 12, 8]])
    with torch.no_grad():
        theirs = fairseq_logits(state["model"], state["cfg"]["model"], tokens)
        assert torch.allclose(hf(tokens).logits, theirs, atol=1e-5)
    # post-norm: no transformers class is one
    code, _, err = _in_process(
        capsys, "export-model", "--path", _checkpoint("lm"), "--out", tmp_path / "lm", "--format", "hf"
    )
    assert code != 0 and err.count("\n") == 1 and "post-norm layers" in err, err
    assert not (tmp_path / "lm").exists()
    # our own format keeps the model's numbers
    code, _, err = _in_process(capsys, "export-model", "--path", _checkpoint("lm"), "--out", tmp_path / "ours")
    assert code == 0, err
    direct = _in_process(capsys, "eval-lm", DATA, "--path", _checkpoint("lm"), "--batch-size", 8)[1]
    exported = _in_process(capsys, "eval-lm", DATA, "--path", tmp_path / "ours", "--batch-size", 8)[1]
    assert direct.splitlines()[-1] == exported.splitlines()[-1]


def test_plan_counts_fairseqs_parameters(capsys):
    code, out, err = _in_process(
        capsys, "plan", "--path", _checkpoint("lm"), "--tokens-per-sample", 64, "--batch-size", 8, "--cpu"
    )
    assert code == 0, err
    assert "603,520 parameters" in out  # fairseq-train's "num. model params: 603,520"


# ------------------------------------------------------------------ train
def _logged_updates():
    updates = {}
    for line in (FIXTURES / "resume" / "train.log").read_text().splitlines():
        if "| train_inner |" in line:
            record = json.loads(line[line.index("{") :])
            updates[int(record["num_updates"])] = float(record["loss"])
    return updates


def test_restore_file_continues_fairseqs_run(tmp_path):
    """Resumed at update 20, updates 21-30 are fairseq's own (its log rounds to 3 decimals)."""
    fairseq = _logged_updates()
    argv = [DATA, *RESUME_FLAGS, "--restore-file", _checkpoint("resume"), "--save-dir", tmp_path / "ck"]
    ours = train_updates([str(a) for a in argv], 1, tmp_path)
    assert sorted(ours) == list(range(21, 31))
    for n, (loss, _) in ours.items():
        base2 = loss / math.log(2)
        assert abs(base2 - fairseq[n]) <= 1e-4 * fairseq[n], (n, base2, fairseq[n])


def test_fairseqs_checkpoint_last_in_save_dir_resumes_by_default(tmp_path, capfd):
    """A fairseq user's --save-dir: its checkpoint_last.pt resumes without --restore-file."""
    save = tmp_path / "checkpoints"
    save.mkdir()
    shutil.copy(_checkpoint("resume"), save / "checkpoint_last.pt")
    argv = [DATA, *RESUME_FLAGS, "--max-update", 21, "--save-dir", save, "--log-format", "json", "--log-interval", 1]
    records, r = train_here(argv, capfd)
    assert "loaded fairseq checkpoint" in r.stderr + r.stdout
    assert [rec["num_updates"] for rec in records["train_inner"]] == [21]
    assert records["train_inner"][0]["loss"] == _logged_updates()[21]
    assert (save / "checkpoint_last").is_dir() and (save / "checkpoint_last.pt").is_file()


def test_two_fsdp_ranks_resume_fairseqs_run_as_one_process(tmp_path):
    """The same global batch: 2 ranks of 8 sequences, or one process with --update-freq 2."""
    argv = [DATA, *RESUME_FLAGS, "--restore-file", _checkpoint("resume"), "--max-update", "24"]
    one = train_updates([str(a) for a in [*argv, "--update-freq", "2", "--save-dir", tmp_path / "one"]], 1, tmp_path)
    two = [*argv, "--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--save-dir", tmp_path / "two"]
    two = train_updates([str(a) for a in two], 2, tmp_path)
    assert sorted(one) == sorted(two) == [21, 22, 23, 24]
    for n in one:
        (loss_1, gnorm_1), (loss_2, gnorm_2) = one[n], two[n]
        # gradients summed in another order (two micro-batches; a reduce-scatter of two ranks)
        assert loss_1 == pytest.approx(loss_2, rel=1e-5) and gnorm_1 == pytest.approx(gnorm_2, rel=1e-4), n


def test_finetune_from_a_fairseq_checkpoint_and_a_wrong_dictionary(tmp_path, capfd):
    argv = [DATA, "--tokens-per-sample", 64, "--batch-size", 8, "--optimizer", "adam", "--lr", "0.0005"]
    argv += ["--finetune-from-model", _checkpoint("gpt"), "--max-update", 10, "--no-save", "--log-format", "json"]
    records, r = train_here([*argv, "--validate-interval-updates", 10, "--log-interval", 1, "--dropout", 0], capfd)
    assert "fine-tuning from" in r.stderr + r.stdout
    # it starts from the trained model (a fresh one's loss is above 10), then improves on
    # fairseq-eval-lm's loss of it on the same split (valid is a copy of test)
    assert records["train_inner"][0]["loss"] < 9.5
    assert records["valid"][-1]["valid_loss"] < 9.2852 - 0.01, records["valid"]
    # a data-bin whose dict.txt is another one: refused before any rank starts
    other = tmp_path / "data-bin"
    shutil.copytree(DATA, other)
    lines = (other / "dict.txt").read_text().splitlines()
    (other / "dict.txt").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    shutil.copy(DATA / "dict.txt", _copy_checkpoint("gpt", tmp_path).parent / "dict.txt")
    argv[0], argv[argv.index("--finetune-from-model") + 1] = other, tmp_path / "gpt" / "checkpoint_last.pt"
    _, r = train_here(argv, capfd, check=False)
    assert r.returncode != 0 and "dict.txt differs from" in r.stderr, r.stderr


def _copy_checkpoint(name, tmp_path):
    (tmp_path / name).mkdir()
    return Path(shutil.copy(_checkpoint(name), tmp_path / name / _checkpoint(name).name))
