"""Adaptive input and adaptive softmax (fairseq's --adaptive-input, --adaptive-softmax-cutoff
with --criterion adaptive_loss, --tie-adaptive-weights, --tie-adaptive-proj): the loss is
exactly -log of the full-vocabulary probabilities, the bands have fairseq's shapes, a run
learns, FSDP and DDP train what one process does with the tied tables, a checkpoint
resumes the same curve, eval-lm reproduces the valid loss, and bad settings get one line."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import DUMMY, TINY, compose, multi_rank_losses, run_train, train_updates, update_losses
from models.transformer_lm import build_model
from trainer.errors import UsageError

ADAPTIVE = ["--criterion", "adaptive_loss", "--adaptive-softmax-cutoff", "64,128,192"]  # dict 256 → 4 bands
TIED = ADAPTIVE + [
    "--adaptive-input",
    "--adaptive-input-cutoff",
    "64,128,192",
    "--tie-adaptive-weights",
    "--tie-adaptive-proj",
]
UPDATES = 5


def _model(argv, vocab=256):
    cfg = compose(DUMMY + ["--batch-size", "4"] + argv)
    return build_model(cfg.model, vocab, 32, seed=cfg.common.seed)


ZERO_WIDE_TAIL = ADAPTIVE + ["--decoder-embed-dim", "32"]  # tails 8, 2 and 0 wide


@pytest.mark.parametrize(
    "flags",
    [
        ADAPTIVE,
        TIED,
        TIED[:-1],
        ["--adaptive-input", "--adaptive-input-cutoff", "64"],
        ADAPTIVE + ["--decoder-output-dim", "128"],
        ZERO_WIDE_TAIL,
    ],
)
def test_loss_is_minus_the_log_probability_of_each_target(flags):
    """The adaptive loss summed over the targets equals -Σ log p(target) read from the
    full-vocabulary log-probabilities (fairseq's get_log_prob), which sum to 1; pads are
    not scored. A tail 0 wide (fairseq trains one) is uniform over its words."""
    model = _model(flags).eval()
    g = torch.Generator().manual_seed(0)
    tokens, target = torch.randint(0, 256, (3, 32), generator=g), torch.randint(0, 256, (3, 32), generator=g)
    target[0, :5] = model.padding_idx
    with torch.no_grad():
        out = model(tokens).double()
        loss = model(tokens, target=target)
    assert out.shape == (3, 32, 256)
    if model.adaptive_softmax is not None:  # log-probabilities already
        assert torch.allclose(out.logsumexp(-1), torch.zeros(3, 32, dtype=torch.float64), atol=1e-5)
    log_probs = out.log_softmax(-1)
    picked = log_probs.gather(-1, target[..., None]).squeeze(-1)
    expected = -picked[target != model.padding_idx].sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    if flags is ZERO_WIDE_TAIL:
        last = log_probs[..., 192:]
        assert torch.allclose(last, last[..., :1].expand_as(last))


def test_adaptive_input_bands_have_fairseqs_shapes_and_values():
    from models.adaptive import AdaptiveInput

    emb = AdaptiveInput(100, 1, 64, 4.0, 48, "20,60")  # cutoffs extended by the vocabulary: 3 bands
    shapes = {n: tuple(p.shape) for n, p in emb.named_parameters()}
    assert shapes == {
        "embeddings.0.0.weight": (20, 64),
        "embeddings.0.1.weight": (48, 64),
        "embeddings.1.0.weight": (40, 16),
        "embeddings.1.1.weight": (48, 16),
        "embeddings.2.0.weight": (40, 4),
        "embeddings.2.1.weight": (48, 4),
    }
    assert len(AdaptiveInput(100, 1, 64, 2.0, 48, "20,100").embeddings) == 2  # a last cutoff = vocab adds none
    tokens = torch.tensor([[0, 19, 20, 59], [60, 99, 1, 42]])
    out = emb(tokens)
    assert out.shape == (2, 4, 48)
    for b, t in ((0, 0), (0, 19), (1, 20), (1, 59), (2, 60), (2, 99)):
        table, proj = emb.weights_for_band(b)
        start = (0, 20, 60)[b]
        row = (tokens == t).nonzero()[0]
        assert torch.allclose(out[row[0], row[1]], proj @ table[t - start], atol=1e-6), t


def test_init_and_weight_decay_treat_the_band_tables_as_embeddings():
    from trainer.train.optim import param_groups

    big = [a.replace("64,128,192", "1024,2048,3072") for a in TIED] + ["--dict-size", "4096"]
    model = _model(big, vocab=4096)
    tables = [model.embed_tokens.embeddings[i][0].weight for i in range(4)]
    assert torch.all(tables[0][model.padding_idx] == 0)  # the pad row, in the first band
    for t in tables:  # fairseq: N(0, width^-0.5)
        assert t.std().item() == pytest.approx(t.shape[1] ** -0.5, rel=0.1)
    no_decay = {id(p) for g in param_groups(model, 0.1) if g["weight_decay"] == 0 for p in g["params"]}
    assert all(id(t) in no_decay for t in tables)
    assert id(model.embed_tokens.embeddings[1][1].weight) not in no_decay  # a projection: decayed


def test_a_tied_model_has_each_table_once():
    """--tie-adaptive-weights reads the softmax's word tables from the input's, and
    --tie-adaptive-proj its tail projections: no parameter of the softmax but the
    clusters' scores; without --tie-adaptive-proj, each tail has its own projection."""
    tied = _model(TIED).state_dict()  # what a checkpoint holds
    assert [n for n in tied if n.startswith("adaptive_softmax")] == ["adaptive_softmax.class_proj.weight"]
    untied_proj = _model(TIED[:-1]).state_dict()
    assert sorted(n for n in untied_proj if n.startswith("adaptive_softmax")) == [
        "adaptive_softmax.class_proj.weight"
    ] + [f"adaptive_softmax.tail.{i}.proj.weight" for i in range(3)]


def test_a_run_with_the_adaptive_softmax_learns():
    """fairseq's test_transformer_lm_with_adaptive_softmax, cutoffs scaled to the vocabulary."""
    losses = update_losses(DUMMY + ["--batch-size", "8", "--adaptive-softmax-dropout", "0.1"] + ADAPTIVE, 8)
    assert losses[-1] < losses[0] - 1.0


@pytest.fixture(scope="module")
def one_process():
    # batch 8 holding what 2 ranks of 4 read (fairseq's order: batches depend on the per-rank batch)
    argv = DUMMY + ["--batch-size", "4", "--clip-norm", "0.5"] + TIED
    return update_losses(argv, UPDATES, with_gnorm=True, merge=2)


@pytest.mark.parametrize("backend", ["pytorch_ddp", "fully_sharded"])
def test_fsdp_and_ddp_train_the_tied_model_as_one_process_does(backend, one_process, tmp_path):
    argv = DUMMY + ["--batch-size", "4", "--clip-norm", "0.5", "--ddp-backend", backend] + TIED
    losses, gnorms = multi_rank_losses(argv, 2, UPDATES, tmp_path)
    ref_losses, ref_gnorms = one_process
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]


def test_an_fsdp_checkpoint_resumes_the_same_curve(tmp_path):
    save = [a for a in DUMMY if a != "--no-save"] + TIED + ["--clip-norm", "0.5"]
    # one process reading the 2 ranks' batches (an epoch's batches depend on the per-rank batch)
    one = ["--batch-size", "4", "--update-freq", "2"]
    whole = train_updates(save + one + ["--max-update", "6", "--no-save"], 1, tmp_path)
    sharded = save + ["--batch-size", "4", "--ddp-backend", "fully_sharded", "--save-dir", str(tmp_path / "ckpt")]
    first = train_updates(sharded + ["--max-update", "3"], 2, tmp_path)
    second = train_updates(sharded + ["--max-update", "6"], 2, tmp_path)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    for n, (loss, gnorm) in {**first, **second}.items():
        assert loss == pytest.approx(whole[n][0], rel=1e-5) and gnorm == pytest.approx(whole[n][1], rel=1e-5), n


def _run(cmd, *args, check=True):
    r = subprocess.run(
        [str(Path(sys.executable).with_name(cmd))] + [str(a) for a in args], capture_output=True, text=True, timeout=600
    )
    assert not check or r.returncode == 0, r.stderr
    return r


def test_eval_lm_export_and_generate_of_an_adaptive_checkpoint(tmp_path):
    """On the embedded corpus (1024 tokens), 2 FSDP ranks: eval-lm gives training's valid
    loss; the safetensors export loads as the same model; sampling with and without the
    KV cache picks the same tokens from the adaptive softmax's log-probabilities."""
    from models.generate import sample
    from trainer.inference.export import export_model
    from trainer.inference.load import load_model

    save = tmp_path / "ckpt"
    cutoffs = [
        "--adaptive-input",
        "--adaptive-input-cutoff",
        "256,512",
        "--adaptive-softmax-cutoff",
        "256,512",
        "--criterion",
        "adaptive_loss",
        "--tie-adaptive-weights",
        "--tie-adaptive-proj",
    ]
    records, _ = run_train(
        [a for a in TINY if a != "--no-save"]
        + cutoffs
        + [
            "--batch-size",
            "8",
            "--max-update",
            "10",
            "--log-format",
            "json",
            "--save-dir",
            save,
            "--ddp-backend",
            "fully_sharded",
            "--distributed-world-size",
            "2",
        ]
    )
    ckpt, valid = save / "checkpoint_last", records["valid"][-1]
    out = _run("eval-lm", "--path", ckpt, "--gen-subset", "valid", "--batch-size", "8").stdout
    loss = float(next(x for x in out.splitlines() if x.startswith("Loss (base 2):")).split(":")[1].split(",")[0])
    assert loss == pytest.approx(valid["valid_loss"], abs=6e-4)
    export_model(ckpt, tmp_path / "export")
    model, _, _ = load_model(ckpt)
    exported, _, _ = load_model(tmp_path / "export")
    assert model.vocab_size == exported.vocab_size == 1024
    tokens = torch.arange(3, 35).view(1, -1)
    with torch.no_grad():
        assert torch.equal(model(tokens), exported(tokens))
    new = sample(model, [2, 5, 9], 12, top_k=20, seed=3)
    assert new == sample(model, [2, 5, 9], 12, top_k=20, seed=3, use_cache=False) and len(new) > 0


def test_the_presets_set_fairseqs_keys():
    dummy = ["--task", "dummy_lm", "--batch-size", "4", "--dict-size", "70000"]
    cfg = compose(dummy + ["--arch", "transformer_lm_wiki103", "--criterion", "adaptive_loss"])
    m = cfg.model
    assert (m.decoder_layers, m.decoder_embed_dim, m.decoder_ffn_embed_dim, m.decoder_attention_heads) == (
        16,
        1024,
        4096,
        8,
    )
    assert (m.adaptive_input, m.tie_adaptive_weights, m.tie_adaptive_proj, m.no_decoder_final_norm) == (
        True,
        True,
        True,
        True,
    )
    assert (m.adaptive_input_cutoff, m.adaptive_softmax_cutoff, m.adaptive_softmax_dropout) == (
        "20000,60000",
        "20000,60000",
        0.2,
    )
    assert (m.dropout, m.attention_dropout, m.activation_dropout) == (0.3, 0.1, 0.1)
    gbw = compose(dummy + ["--arch", "transformer_lm_gbw"]).model
    assert (
        gbw.decoder_layers,
        gbw.decoder_embed_dim,
        gbw.decoder_ffn_embed_dim,
        gbw.decoder_attention_heads,
        gbw.no_decoder_final_norm,
        gbw.adaptive_input,
    ) == (12, 512, 4096, 16, True, False)


@pytest.mark.parametrize(
    "flags",
    [
        ADAPTIVE,
        TIED,
        TIED[:-1],
        ["--adaptive-input", "--adaptive-input-cutoff", "10,20"],
        [
            "--adaptive-input",
            "--adaptive-input-cutoff",
            "64",
            "--decoder-input-dim",
            "32",
            "--decoder-output-dim",
            "48",
        ],
        ADAPTIVE + ["--decoder-input-dim", "32", "--decoder-output-dim", "128"],
        ZERO_WIDE_TAIL,
    ],
)
def test_the_planner_counts_the_models_parameters(flags):
    from models.transformer_lm import num_parameters
    from trainer.plan.search import model_shape

    cfg = compose(DUMMY + ["--batch-size", "4"] + flags)
    model = build_model(cfg.model, 256, 32, device="meta")
    assert model_shape(cfg, 256).params == num_parameters(model)


REFUSED = {
    "wiki103 without its criterion": (["--arch", "transformer_lm_wiki103"], "--criterion adaptive_loss"),
    "cutoffs past a small vocabulary": (
        ["--arch", "transformer_lm_wiki103", "--criterion", "adaptive_loss"],
        "smaller --adaptive-input-cutoff and --adaptive-softmax-cutoff",
    ),
    "cross_entropy with an adaptive softmax": (ADAPTIVE[2:], "add --criterion adaptive_loss"),
    "adaptive_loss without one": (["--criterion", "adaptive_loss"], "set --adaptive-softmax-cutoff"),
    "adaptive input without cutoffs": (["--adaptive-input"], "needs --adaptive-input-cutoff"),
    "tie without adaptive input": (ADAPTIVE + ["--tie-adaptive-weights"], "does nothing without --adaptive-input"),
    "tie proj without tie": (ADAPTIVE + ["--tie-adaptive-proj"], "without --tie-adaptive-weights"),
    "tie with other cutoffs": (
        ADAPTIVE + ["--adaptive-input", "--adaptive-input-cutoff", "64,128", "--tie-adaptive-weights"],
        "--adaptive-input-cutoff 64,128 equal to",
    ),
    "tie with other factors": (TIED + ["--adaptive-input-factor", "2"], "--adaptive-input-factor 2.0 equal to"),
    "tie with another input dim": (
        TIED + ["--decoder-input-dim", "32"],
        "--decoder-input-dim and --decoder-output-dim",
    ),
    "shared embedding with adaptive input": (
        ["--adaptive-input", "--adaptive-input-cutoff", "64", "--share-decoder-input-output-embed"],
        "use --tie-adaptive-weights",
    ),
    "shared embedding with adaptive softmax": (
        ADAPTIVE + ["--share-decoder-input-output-embed"],
        "use --tie-adaptive-weights",
    ),
    "unused cutoff": (["--adaptive-input-cutoff", "64"], "does nothing without --adaptive-input"),
    "unused softmax dropout": (["--adaptive-softmax-dropout", "0.1"], "does nothing without --adaptive-softmax-cutoff"),
    "not a list": (ADAPTIVE[:2] + ["--adaptive-softmax-cutoff", "64;128"], "comma-separated list"),
    "not increasing": (ADAPTIVE[:2] + ["--adaptive-softmax-cutoff", "128,64"], "increasing"),
    "a band 0 wide": (
        ["--adaptive-input", "--adaptive-input-cutoff", "64,128,192", "--adaptive-input-factor", "16"],
        "lower the factor",
    ),
    "pad outside the first band": (["--adaptive-input", "--adaptive-input-cutoff", "1,64"], "padding id 1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_settings_get_one_line_naming_the_fix(name):
    flags, fragment = REFUSED[name]
    with pytest.raises(UsageError) as e:
        compose(DUMMY + ["--batch-size", "4"] + flags)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_cutoffs_past_the_datas_vocabulary_are_refused_before_training():
    """With DATA the vocabulary is known once the data is opened: refused there, in one line."""
    _, r = run_train(
        TINY
        + [
            "--batch-size",
            "8",
            "--max-update",
            "1",
            "--adaptive-softmax-cutoff",
            "512,2000",
            "--criterion",
            "adaptive_loss",
        ],
        check=False,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--adaptive-softmax-cutoff 512,2000 reaches past the vocabulary of 1024 tokens" in r.stderr


def test_hf_export_refuses_adaptive_models():
    from trainer.formats.hf.gpt2 import check_hf_compatible

    with pytest.raises(UsageError, match="adaptive"):
        check_hf_compatible(compose(DUMMY + ["--batch-size", "4"] + ADAPTIVE).model)
