"""preprocess at corpus scale (issue 49 item 3): a directory or glob of jsonl, jsonl.gz,
parquet and text files, streamed, cut into chunks, one shard per chunk (train, train1, …),
a killed run continued by the same command, memory flat in the file's size."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from data.corpus_files import Piece, batches, plan_chunks
from data.corpus_run import DONE, PARTIAL_DIR
from data.errors import DataError
from data.indexed_dataset import IndexedDataset, exists
from data.preprocess import preprocess
from data.sources import resolve_sources
from data.tokenizer import SentencePieceTokenizer
from helpers import preprocess_options

PREPROCESS = Path(sys.executable).parent / "preprocess"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards hex jolly café judges über zebras".split()


def lines(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        " ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=int(rng.integers(0, 14)))) for _ in range(n)
    ]


def run(*argv) -> Path:
    return preprocess(preprocess_options([str(a) for a in argv]))


def dir_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def train_shards(out: Path) -> list[str]:
    """train, train1, … as the trainer finds them (trainer/train/task.py, fairseq's combine)."""
    names = ["train"]
    while exists(out / f"train{len(names)}"):
        names.append(f"train{len(names)}")
    return names


def sequences(out: Path) -> list[list[int]]:
    return [
        IndexedDataset(out / name)[i].tolist()
        for name in train_shards(out)
        for i in range(len(IndexedDataset(out / name)))
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Mixed files in one dir (sorted: a.txt, b.jsonl, c.jsonl.gz, d.parquet, e.txt.gz) and the
    texts they hold in that order; a sentencepiece model trained once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    files = root / "files"
    files.mkdir()
    a, b, c, d, e = (lines(400, seed) for seed in range(5))
    a[3], b[5], c[7] = "   ", "", "line one\nline two"  # whitespace-only, empty, a newline inside
    (files / "a.txt").write_bytes(("\r\n".join(a) + "\r\n").encode())
    with open(files / "b.jsonl", "w", encoding="utf-8") as f:
        for k, text in enumerate(b):
            f.write(json.dumps({"id": k, "text": text if k != 9 else None}) + "\n")
    b[9] = ""  # a null is an empty row
    with gzip.open(files / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in c)
    pq.write_table(pa.table({"text": d, "n": list(range(len(d)))}), files / "d.parquet", row_group_size=50)
    (files / "e.txt.gz").write_bytes(gzip.compress(("\n".join(e) + "\n").encode()))
    (files / ".hidden.txt").write_text("never read\n")
    tok = run("--trainpref", files / "a.txt", "--destdir", root / "tok", "--vocab-size", "90")
    return files, tok / "tokenizer.model", a + b + c + d + e


def expected_ids(model: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = SentencePieceTokenizer(model)
    return [([] if text.isspace() else tokenizer.encode(text)) + [tokenizer.eos] for text in texts]


def test_directory_and_glob_are_the_texts_encoded_one_by_one(corpus, tmp_path):
    files, model, texts = corpus
    common = ["--spm-model", model, "--shard-mb", "0.004", "--validpref", files / "a.txt"]
    by_dir = run("--trainpref", files, "--destdir", tmp_path / "dir", "--workers", "2", *common)
    by_glob = run("--trainpref", f"{files}/*", "--destdir", tmp_path / "glob", *common)
    meta = json.loads((by_dir / "metadata.json").read_text())
    assert len(meta["splits"]["train"]["shards"]) > 8  # small chunks: big files cut, small ones grouped
    assert meta["splits"]["train"]["shards"] == train_shards(by_dir)
    assert ".hidden.txt" not in " ".join(meta["splits"]["train"]["sources"])
    assert sequences(by_dir) == expected_ids(model, texts)
    assert [IndexedDataset(by_dir / "valid")[i].tolist() for i in range(400)] == expected_ids(model, texts[:400])
    assert meta["splits"]["train"]["tokens"] == sum(map(len, expected_ids(model, texts)))
    # The same bytes from a glob with 1 worker as from the directory with 2.
    assert dir_bytes(by_glob) == dir_bytes(by_dir)


def test_the_trainer_reads_the_shards_as_one_split(corpus, tmp_path):
    from helpers import TINY, compose
    from trainer.train.task import LMTask

    files, model, texts = corpus
    out = run("--trainpref", files, "--destdir", tmp_path / "bin", "--spm-model", model, "--shard-mb", "0.01")
    (out / "valid.bin").symlink_to(out / "train.bin")
    (out / "valid.idx").symlink_to(out / "train.idx")
    task = LMTask(
        compose([str(out), *TINY, "--sample-break-mode", "eos", "--batch-size", "4", "--tokens-per-sample", "512"]),
        SimpleNamespace(is_master=True),
    )
    blocks = task.dataset("train")
    assert len(blocks.datasets) == len(train_shards(out)) > 2
    assert blocks.num_tokens == sum(map(len, expected_ids(model, texts)))
    # break mode eos: a block is one row, after the </s> that fairseq's LM blocks start with.
    assert [blocks[i].tolist()[1:] for i in range(len(blocks))] == expected_ids(model, texts)


def big_corpus(root: Path) -> Path:
    root.mkdir()
    text = "\n".join(lines(6000, 7)) + "\n"
    for k in range(12):
        (root / f"part-{k:02d}.txt").write_text(text, encoding="utf-8")
    return root


def test_a_killed_run_continues_to_the_same_bytes(corpus, tmp_path):
    files, model, _ = corpus
    inputs = big_corpus(tmp_path / "big")
    argv = ["--trainpref", inputs, "--spm-model", model, "--shard-mb", "0.05"]
    whole = run(*argv, "--destdir", tmp_path / "whole")
    dest = tmp_path / "killed"
    command = [PREPROCESS, *argv, "--destdir", dest, "--workers", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(list(map(str, command)), env=env, start_new_session=True, stdout=subprocess.PIPE)
    done = dest / PARTIAL_DIR / DONE
    deadline = time.monotonic() + 60
    while not (done.is_file() and done.read_text().count('"key"') >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline, "no shard finished in 60 s"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, mid-run
    proc.wait()
    assert not (dest / "metadata.json").exists(), "the run finished before it was killed: use a bigger corpus"
    finished = [json.loads(line)["name"] for line in done.read_text().splitlines()]
    kept = {name: (dest / PARTIAL_DIR / f"{name}.bin").stat() for name in finished}

    # Other settings into the same destdir: refused in one line, nothing touched.
    with pytest.raises(DataError, match=r"unfinished preprocess run with other settings \(shard_mb differ\)") as e:
        run("--trainpref", inputs, "--spm-model", model, "--shard-mb", "0.1", "--destdir", dest)
    assert "\n" not in str(e.value)
    assert [json.loads(line)["name"] for line in done.read_text().splitlines()] == finished

    out = subprocess.run(list(map(str, command)), env=env, check=True, capture_output=True, text=True).stdout
    assert f"{len(finished)} of" in out and "shards kept from an earlier run" in out
    assert dir_bytes(dest) == dir_bytes(whole)
    assert not (dest / PARTIAL_DIR).exists()
    for name, before in kept.items():
        k = int(name.rsplit("-", 1)[1])
        after = (dest / ("train" if k == 0 else f"train{k}")).with_suffix(".bin").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), name


def test_a_large_file_is_cut_at_line_ends_and_a_gzip_file_is_not(tmp_path):
    text = "".join(f"row {k} " + "x" * (k % 50) + "\n" for k in range(5000))
    (tmp_path / "big.txt").write_text(text)
    (tmp_path / "big.txt.gz").write_bytes(gzip.compress(text.encode()))
    sources = resolve_sources(str(tmp_path / "big.txt"))
    chunks = plan_chunks(sources, 20_000)
    assert len(chunks) > 5 and all(len(chunk) == 1 for chunk in chunks)
    assert [text[c[0].start - 1] for c in chunks[1:]] == ["\n"] * (len(chunks) - 1)
    rows = [row for chunk in chunks for batch in batches(chunk, "text") for row in batch]
    assert rows == text.splitlines()
    assert len(plan_chunks(resolve_sources(str(tmp_path / "big.txt.gz")), 20_000)) == 1


@pytest.mark.parametrize("name", ["big.jsonl", "big.txt", "big.jsonl.gz"])
def test_reading_a_file_holds_one_batch_not_the_file(tmp_path, name):
    """Memory while reading a whole 8 MB file stays a small fraction of it: the reader streams."""
    rows = [json.dumps({"text": "y" * 200}) + "\n" for _ in range(40_000)]
    data = "".join(rows).encode()
    (tmp_path / name).write_bytes(gzip.compress(data, 1) if name.endswith(".gz") else data)
    piece = Piece(str(tmp_path / name), "text" if ".txt" in name else "json", 0, (tmp_path / name).stat().st_size)
    tracemalloc.start()
    try:
        count = sum(len(batch) for batch in batches([piece], "text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 40_000
    assert peak < len(data) / 4, f"peak {peak:,} bytes reading a {len(data):,}-byte file"


def test_a_run_stopped_while_moving_shards_into_place_is_finished_by_the_next(corpus, tmp_path, monkeypatch):
    import data.corpus_run

    files, model, _ = corpus
    argv = ["--trainpref", files, "--spm-model", model, "--shard-mb", "0.01"]
    whole = run(*argv, "--destdir", tmp_path / "whole")
    replace, moved = os.replace, []

    def stop_after_three(source, target):
        if Path(target).parent == tmp_path / "out":
            if len(moved) == 3:
                raise KeyboardInterrupt
            moved.append(target)
        replace(source, target)

    monkeypatch.setattr(data.corpus_run.os, "replace", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        run(*argv, "--destdir", tmp_path / "out")
    monkeypatch.setattr(data.corpus_run.os, "replace", replace)
    assert len(moved) == 3 and not (tmp_path / "out" / "metadata.json").exists()
    run(*argv, "--destdir", tmp_path / "out")
    assert dir_bytes(tmp_path / "out") == dir_bytes(whole)
