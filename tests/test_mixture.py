"""--data-mixture (data/mixture.py, data/mixture_batches.py): the stream's shares and order,
a source's passes, temperature, an anneal that re-reads nothing, resume on other ranks and
batches, the records and per-source validation of a real run, and the refusals."""

import random
import shutil

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset
from data.mixture import Mixture, mixture_weights, parse_mixture, source_names
from data.mixture_batches import MixtureBatchIterator
from data.token_block import TokenBlockDataset
from helpers import TINY, compose, run_preprocess, train_here, train_updates
from trainer.errors import UsageError

BLOCK = ["--tokens-per-sample", "16", "--required-batch-size-multiple", "1", "--log-format", "json"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """web and code share web's tokenizer; other has its own."""
    root = tmp_path_factory.mktemp("mixture")
    rng = random.Random(0)

    def lines(chars, n):
        return [
            " ".join("".join(rng.choice(chars) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(5, 15)))
            for _ in range(n)
        ]

    for name, chars, n in (("web", "abcdefgh", 600), ("code", "xyz(){}=+", 200)):
        (root / f"{name}.txt").write_text("\n".join(lines(chars, n)) + "\n")
        (root / f"{name}.valid.txt").write_text("\n".join(lines(chars, 30)) + "\n")
    web = run_preprocess(
        "--trainpref", root / "web.txt", "--validpref", root / "web.valid.txt", "--destdir", root / "web",
        "--vocab-size", "60",
    )  # fmt: skip
    code = run_preprocess(
        "--trainpref", root / "code.txt", "--validpref", root / "code.valid.txt", "--destdir", root / "code",
        "--spm-model", web / "tokenizer.model",
    )  # fmt: skip
    other = run_preprocess("--trainpref", root / "code.txt", "--destdir", root / "other", "--vocab-size", "50")
    return web, code, other


def blocks(data_dir):
    return TokenBlockDataset(IndexedDataset(data_dir / "train"), 16, "none")


class Sized:
    """n blocks of one token each, item i = [i, i]: a batch shows which blocks it holds."""

    def __init__(self, n):
        self.sizes = np.full(n, 2)

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, i):
        return np.array([i, i])


def keys_of(itr):
    return [sorted(b) for b in itr.next_epoch_itr()]


def test_every_prefix_holds_each_share_and_the_stream_is_the_same_on_any_ranks():
    mixture = Mixture(["a", "b", "c"], [Sized(500), Sized(90), Sized(7)], [0.6, 0.3, 0.1], seed=2)
    sources = np.searchsorted(mixture.first_key, mixture.keys(0, 597), side="right") - 1
    counts = np.cumsum(np.eye(3, dtype=int)[sources], axis=0)
    expected = np.arange(1, 598)[:, None] * np.array([0.6, 0.3, 0.1])
    assert np.abs(counts - expected).max() <= 1  # every prefix, every source, within a block

    def stream(world, batch):
        ranks = [
            MixtureBatchIterator(
                mixture, batch, num_shards=world, shard_id=r, collater=lambda b: [int(x[0]) for x in b]
            )
            for r in range(world)
        ]
        per_rank = [list(r.next_epoch_itr()) for r in ranks]
        return [k for step in zip(*per_rank) for batch in step for k in batch]

    one, two, four = stream(1, 8), stream(2, 4), stream(4, 2)
    assert len(one) == 597 and len(four) == 592  # 4 ranks leave out the last 5 blocks, a short batch
    assert one[:592] == two[:592] == four
    assert one == [int(k - mixture.first_key[s]) for k, s in zip(mixture.keys(0, 597), sources)]


def test_a_source_that_runs_out_starts_its_next_pass_reshuffled():
    mixture = Mixture(["big", "small"], [Sized(300), Sized(10)], [0.5, 0.5], seed=1)
    keys = mixture.keys(0, 60)
    small = [int(k) - 300 for k in keys if k >= 300]
    passes = [small[i : i + 10] for i in (0, 10, 20)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # each pass every block once
    assert passes[0] != passes[1] != passes[2]  # each in its own order
    assert mixture.passes_at(60) == [0.1, 3.0]
    again = Mixture(["big", "small"], [Sized(300), Sized(10)], [0.5, 0.5], seed=1)
    assert (again.keys(20, 60) == keys[20:]).all()  # a pure function of the slot
    other_seed = Mixture(["big", "small"], [Sized(300), Sized(10)], [0.5, 0.5], seed=2)
    assert (other_seed.keys(0, 60) != keys).any()


def test_temperature_weighs_sources_by_their_tokens():
    assert mixture_weights([1, 1], [900, 100], 1.0) == pytest.approx([0.9, 0.1])
    assert mixture_weights([1, 1], [900, 100], 2.0) == pytest.approx([0.75, 0.25])  # 30 : 10
    assert mixture_weights([2, 1], [900, 100], None) == pytest.approx([2 / 3, 1 / 3])
    assert mixture_weights([1, 1], [900, 100], 1e6) == pytest.approx([0.5, 0.5], abs=1e-5)


def test_an_anneal_goes_on_with_each_sources_pass_and_rereads_no_block():
    mixture = Mixture(["a", "b"], [Sized(100), Sized(100)], [0.9, 0.1], seed=4)
    before = mixture.keys(0, 50).tolist()
    assert mixture.reweight(50, [0.1, 0.9]) and not mixture.reweight(50, [0.1, 0.9])
    after = mixture.keys(50, 150).tolist()
    assert mixture.keys(0, 50).tolist() == before  # the slots before the anneal are as they were
    for lo, hi in ((0, 100), (100, 200)):
        read = [k for k in before + after if lo <= k < hi]
        assert len(read) == len(set(read))  # within the pass, no block twice
    b_after = sum(1 for k in after if k >= 100)
    assert abs(b_after - 90) <= 1
    saved = mixture.state_dict()
    fresh = Mixture(["a", "b"], [Sized(100), Sized(100)], [0.5, 0.5], seed=4)
    fresh.load_state_dict(saved)
    assert fresh.keys(0, 150).tolist() == before + after
    with pytest.raises(ValueError, match="the checkpoint's mixture has the sources a, b .* resume with the same"):
        Mixture(["a", "c"], [Sized(100), Sized(100)], [0.5, 0.5], seed=4).load_state_dict(saved)


def test_a_position_resumes_after_the_same_blocks_with_other_ranks_and_batches(sources):
    web, code, _ = sources
    mixture = Mixture(["web", "code"], [blocks(web), blocks(code)], [0.8, 0.2], seed=1)

    def iterator(world, rank, batch):
        return MixtureBatchIterator(mixture, batch, num_shards=world, shard_id=rank, collater=list)

    def steps(itrs, n=None):
        gens = [itr.next_epoch_itr() for itr in itrs]
        out = []
        for step in zip(*gens):
            out.append(sorted(tuple(item.tolist()) for batch in step for item in batch))
            if n is not None and len(out) == n:
                break
        return out

    whole = steps([iterator(1, 0, 8)])
    two = [iterator(2, r, 4) for r in range(2)]
    first = steps(two, 5)
    state = two[0].state_dict()
    assert state["slot"] == 40 and state == two[1].state_dict()
    four = [iterator(4, r, 2) for r in range(4)]
    for itr in four:
        itr.load_state_dict(state)
    rest = steps(four)
    assert first + rest == whole[: len(first + rest)] and len(whole) - len(first + rest) <= 1


def test_parsing_naming_and_refusals(sources, tmp_path):
    web, code, other = sources
    assert parse_mixture(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert source_names(["x/data-bin", "y/data-bin", "z/web"]) == ["x_data_bin", "y_data_bin", "web"]
    refused = {
        "pairs of weight and data directory": ["--data-mixture", "0.7", str(web), "0.3"],
        "'web' is not a weight": ["--data-mixture", "web", "0.3"],
        "weights are finite and >= 0": ["--data-mixture", "-1", str(web), "1", str(code)],
        "not both": [str(web), "--data-mixture", "1", str(web), "1", str(code)],
        "weighs the sources of --data-mixture": [str(web), "--data-mixture-temperature", "2"],
        "no validation metric here; use loss, ppl, web_loss, web_ppl, code_loss, code_ppl": [
            "--data-mixture", "1", str(web), "1", str(code), "--best-checkpoint-metric", "other_loss",
        ],
    }  # fmt: skip
    for message, argv in refused.items():
        with pytest.raises(UsageError, match=message):
            compose(TINY + argv)
    from trainer.launch.preflight import check_inputs

    cfg = compose(TINY + ["--data-mixture", "1", str(web), "1", str(other), "--batch-size", "4"])
    with pytest.raises(ValueError, match=f"{other} has another vocabulary than {web}"):
        check_inputs(cfg, {})


def tiny_mixture(web, code, weights=(0.8, 0.2)):
    return TINY + BLOCK + ["--data-mixture", str(weights[0]), str(web), str(weights[1]), str(code)]


@pytest.mark.slow
def test_a_run_realizes_the_weights_and_validates_each_source(sources, capfd):
    """300 updates of 0.8 web / 0.2 code: the records' tokens per source are the weights to
    within 2 %, and validation gives each source's loss; checkpoint_best follows code_loss."""
    web, code, _ = sources
    argv = tiny_mixture(web, code) + ["--batch-size", "4", "--max-update", "300", "--log-interval", "50"]
    argv += ["--validate-interval-updates", "100", "--best-checkpoint-metric", "code_loss", "--max-valid-steps", "4"]
    records, _ = train_here(argv, capfd)
    inner = records["train_inner"]
    tokens = {name: sum(r[f"{name}_tokens"] for r in inner) for name in ("web", "code")}
    assert tokens["web"] / (tokens["web"] + tokens["code"]) == pytest.approx(0.8, abs=0.02)
    assert inner[-1]["web_passes"] > inner[0]["web_passes"] > 0
    (epoch,) = records["train"]
    assert {k: epoch[f"train_{k}_tokens"] for k in tokens} == tokens
    valid = records["valid"]
    assert all({"valid_loss", "valid_web_loss", "valid_code_loss"} <= set(r) for r in valid)
    assert valid[-1]["valid_best_loss"] == min(r["valid_code_loss"] for r in valid)
    web_valid, code_valid = valid[-1]["valid_web_loss"], valid[-1]["valid_code_loss"]
    assert min(web_valid, code_valid) < valid[-1]["valid_loss"] < max(web_valid, code_valid)


@pytest.mark.slow
def test_a_mixture_resumes_exactly_on_other_ranks_and_anneals_from_its_stop(sources, tmp_path, capfd):
    """8 blocks per update: 2 FSDP ranks x 4 for 4 updates, then 1 DDP rank x 8 to 8, then 4
    FSDP ranks x 2 to 12, equal to one uninterrupted process; then the 2-rank checkpoint
    resumed with new weights (an anneal)."""
    web, code, _ = sources
    base = [a for a in tiny_mixture(web, code) if a != "--no-save"] + ["--log-interval", "1"]
    whole = train_updates(base + ["--batch-size", "8", "--max-update", "12", "--no-save"], 1, tmp_path)
    fsdp = ["--ddp-backend", "fully_sharded"]
    save = ["--save-dir", str(tmp_path / "ckpt")]
    split = train_updates(base + fsdp + save + ["--batch-size", "4", "--max-update", "4"], 2, tmp_path)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "anneal")
    split |= train_updates(base + save + ["--batch-size", "4", "--update-freq", "2", "--max-update", "8"], 1, tmp_path)
    split |= train_updates(base + fsdp + save + ["--batch-size", "2", "--max-update", "12"], 4, tmp_path)
    assert sorted(split) == sorted(whole) == list(range(1, 13))
    for n in whole:
        assert split[n] == pytest.approx(whole[n], rel=1e-5), f"update {n}"

    annealed = [a for a in tiny_mixture(web, code, (0.25, 0.75)) if a != "--no-save"]
    records, r = train_here(
        annealed + ["--batch-size", "8", "--max-update", "8", "--log-interval", "4", "--save-dir", tmp_path / "anneal"],
        capfd,
    )
    assert "new mixture weights from block 32 of the stream on" in r.stdout
    (last,) = records["train_inner"]  # updates 5-8: 32 blocks, a quarter of them web's
    assert last["web_tokens"] == 8 * 16 and last["code_tokens"] == 24 * 16
    _, r = train_here(TINY + BLOCK + [web, "--batch-size", "8", "--save-dir", tmp_path / "anneal"], capfd, check=False)
    assert r.returncode != 0 and "position is in a --data-mixture, this run reads DATA" in r.stderr
