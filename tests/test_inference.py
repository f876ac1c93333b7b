"""What a trained checkpoint is for: eval-lm gives training's valid perplexity, export
gives one file whose logits equal the sharded model's, generate samples reproducibly."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY, compose, run_train

TRAIN = [a for a in TINY if a != "--no-save"] + [
    "--tokens-per-sample",
    "64",
    "--batch-size",
    "8",
    "--share-decoder-input-output-embed",
    "--decoder-learned-pos",
    "--max-update",
    "20",
    "--log-format",
    "json",
]


def _run(cmd, *args, check=True, stdin=None):
    r = subprocess.run(
        [str(Path(sys.executable).with_name(cmd))] + [str(a) for a in args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=600,
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _in_process(capsys, cmd, *args):
    """The console script's entry point called in this process (no torch start-up): its
    return code (the script's exit status) and what it printed."""
    import cli

    capsys.readouterr()
    code = cli.COMMANDS[cmd]([str(a) for a in args])
    out, err = capsys.readouterr()
    return code or 0, out, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained on 2 FSDP ranks on the embedded corpus, with its last valid record."""
    save = tmp_path_factory.mktemp("run") / "ckpt"
    records, _ = run_train(
        TRAIN + ["--save-dir", str(save), "--ddp-backend", "fully_sharded", "--distributed-world-size", "2"]
    )
    return save / "checkpoint_last", records["valid"][-1]


def _loss(out):
    line = next(x for x in out.splitlines() if x.startswith("Loss (base 2):"))
    return float(line.split(":")[1].split(",")[0]), float(line.rsplit(":", 1)[1])


def _tokens(out):
    return int(next(x for x in out.splitlines() if x.startswith("Evaluated")).split()[1].replace(",", ""))


def test_eval_lm_equals_training_valid_loss(trained, capsys):
    ckpt, valid = trained
    r = _run("eval-lm", "--path", ckpt, "--gen-subset", "valid", "--batch-size", "8")
    loss, ppl = _loss(r.stdout)
    assert loss == pytest.approx(valid["valid_loss"], abs=6e-4)
    assert ppl == pytest.approx(2**loss, rel=1e-3)
    # Two ranks, and a context window: the same tokens are scored, each with more history.
    r2 = _run("eval-lm", "--path", ckpt, "--gen-subset", "valid", "--batch-size", "8", "--distributed-world-size", "2")
    assert _loss(r2.stdout)[0] == pytest.approx(loss, abs=1e-4) and _tokens(r2.stdout) == _tokens(r.stdout)
    code, out3, _ = _in_process(capsys, "eval-lm", "--path", ckpt, "--gen-subset", "valid", "--context-window", "32")
    assert code == 0 and _tokens(out3) == _tokens(r.stdout)
    assert _loss(out3)[0] != loss


def test_eval_lm_fairseq_flags_act(trained, capsys):
    """--softmax-batch leaves the loss as it is; --model-overrides (the LayerDrop README's
    decoder_layers_to_keep) evaluates the pruned model; --num-workers 0 and
    --no-progress-bar are fairseq's test-suite flags; a bad override is one line.
    (In this process: the console script itself is run by the test above.)"""
    ckpt, _ = trained
    base = ("eval-lm", "--path", ckpt, "--gen-subset", "valid", "--batch-size", "8", "--no-progress-bar")
    code, out, _ = _in_process(capsys, *base)
    assert code == 0
    loss, _ = _loss(out)
    code, out, _ = _in_process(capsys, *base, "--softmax-batch", "7", "--num-workers", "0")
    assert code == 0 and _loss(out)[0] == pytest.approx(loss, abs=1e-4)
    code, out, _ = _in_process(capsys, *base, "--model-overrides", "{'decoder_layers_to_keep':'0'}")
    assert code == 0 and _loss(out)[0] > loss + 0.01
    code, _, err = _in_process(capsys, *base, "--model-overrides", "{'decoder_layer':2}")
    assert code == 2 and err.strip().count("\n") == 0 and "did you mean decoder_layers" in err


def test_softmax_batch_scores_that_many_tokens_at_a_time():
    import torch

    from models.transformer_lm import build_model

    model = build_model(compose(TINY + ["--batch-size", "2"]).model, vocab_size=50, max_positions=32).eval()
    tokens = torch.randint(4, 50, (2, 11))
    sizes, output_loss = [], model.output_loss
    model.output_loss = lambda x, target: sizes.append(target.numel()) or output_loss(x, target)
    with torch.no_grad():
        full = model(tokens, target=tokens)
        chunked = model(tokens, target=tokens, softmax_batch=5)
    assert sizes == [22, 5, 5, 5, 5, 2]
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)


def _sharded_logits(index, argv, port, out):
    import torch

    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.parallel import ranks as distributed
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(argv)
    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", 2, rank=index, local_rank=index, local_world_size=2)
    env = distributed.init_rank(cfg, rdv, needs_process_group=True)
    try:
        task, trainer, _ = build(cfg, env)
        Checkpointer(cfg, env, trainer.model, trainer.optimizer).restore()
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(torch.arange(3, 40).view(1, -1))
        if index == 0:
            torch.save(logits, out)
    finally:
        distributed.teardown()


def test_export_logits_equal_the_sharded_model(trained, tmp_path):
    import torch

    from helpers import run_ranks
    from trainer.inference.load import load_model
    from trainer.rendezvous import free_port

    ckpt, _ = trained
    argv = TRAIN + ["--save-dir", str(ckpt.parent), "--ddp-backend", "fully_sharded"]
    run_ranks(_sharded_logits, (argv, free_port(), str(tmp_path / "logits.pt")), 2)
    sharded = torch.load(tmp_path / "logits.pt")
    _run("export-model", "--path", ckpt, "--out", tmp_path / "export")
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "config.yaml",
        "metadata.json",
        "model.safetensors",
        "tokenizer.model",
    ]
    # A fresh process, no torch.distributed: our safetensors reader and the model alone.
    code = (
        "import torch, sys; from trainer.inference.load import load_model; m, _, _ = load_model(sys.argv[1]); "
        "torch.save(m(torch.arange(3, 40).view(1, -1)).detach(), sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "export"), str(tmp_path / "single.pt")], check=True)
    assert torch.allclose(torch.load(tmp_path / "single.pt"), sharded, atol=1e-5, rtol=1e-5)
    # Refuses to overwrite an export
    r = _run("export-model", "--path", ckpt, "--out", tmp_path / "export", check=False)
    assert r.returncode != 0 and "already exists" in r.stderr and "Traceback" not in r.stderr
    model, _, _ = load_model(tmp_path / "export")
    assert model.vocab_size == 1024


def test_export_hf_loads_in_transformers_with_the_same_logits(trained, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    import torch

    from trainer.inference.load import load_model

    ckpt, _ = trained
    _run("export-model", "--path", ckpt, "--out", tmp_path / "hf", "--format", "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours, _, _ = load_model(ckpt)
    read_back, _, tokenizer = load_model(tmp_path / "hf")  # every format shardlm writes, it reads
    tokens = torch.arange(3, 40).view(1, -1)
    with torch.no_grad():
        assert torch.allclose(hf(tokens).logits, ours(tokens), atol=1e-4)
        assert torch.allclose(read_back(tokens), hf(tokens).logits, atol=1e-5)
    # eval-lm scores the GPT-2 directory as the checkpoint it came from
    base = ("--gen-subset", "valid", "--batch-size", "8", "--no-progress-bar")
    code, out, err = _in_process(capsys, "eval-lm", "--path", ckpt, *base)
    code_hf, out_hf, err_hf = _in_process(capsys, "eval-lm", "--path", tmp_path / "hf", *base)
    assert code == code_hf == 0, err + err_hf
    assert _loss(out_hf)[0] == pytest.approx(_loss(out)[0], abs=1e-4) and _tokens(out_hf) == _tokens(out)
    # greedy decoding (generate's, serve's engine's) gives the checkpoint's tokens
    from models.generate import sample

    prompt = tokenizer.encode("ravulili zazu")
    assert sample(read_back, prompt, 12, temperature=0) == sample(ours, prompt, 12, temperature=0)


def test_generate_is_seeded_and_the_kv_cache_changes_nothing(trained, capsys, monkeypatch):
    """The console script once (a fresh process, as users run it); the other runs call the same
    entry point in this process (no torch start-up each): each must print what that process did."""
    import io

    ckpt, _ = trained
    args = ["--path", ckpt, "--prompt", "rara", "--prompt", "lesabi", "--max-new-tokens", "24", "--top-k", "20"]
    a = _run("generate", *args, "--seed", "5").stdout

    def generate(*argv, stdin=None):
        if stdin is not None:
            monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        return _in_process(capsys, "generate", *argv)

    assert generate(*args, "--seed", "5") == (0, a, "")
    assert generate(*args, "--seed", "5", "--no-kv-cache") == (0, a, "")
    assert generate(*args, "--seed", "6")[1] != a
    # split over 2 ranks by heads and vocabulary: every rank samples the same tokens, rank 0 prints them
    assert _run("generate", *args, "--seed", "5", "--model-parallel-size", "2").stdout == a
    lines = a.splitlines()
    assert len(lines) == 2 and lines[0].startswith("rara") and len(lines[0]) > len("rara")
    stdin = generate("--path", ckpt, "--max-new-tokens", "24", "--top-k", "20", "--seed", "5", stdin="rara\nlesabi\n")
    assert stdin == (0, a, "")
    code, _, err = generate("--path", ckpt, "--prompt", "rara", "--max-new-tokens", "5000")
    assert code != 0 and "--max-new-tokens" in err and len(err.strip().splitlines()) == 1


def test_bad_paths_get_one_line(tmp_path, capsys):
    r = _run("eval-lm", "--path", tmp_path, check=False)  # the console script: its exit status, no traceback
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "neither a checkpoint" in r.stderr
    # The others' entry points in this process (an exception escaping them fails the test).
    for cmd, args in (
        ("generate", ["--path", tmp_path, "--prompt", "x"]),
        ("export-model", ["--path", tmp_path, "--out", tmp_path / "o"]),
    ):
        code, _, err = _in_process(capsys, cmd, *args)
        assert code != 0 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and "neither a checkpoint" in err
