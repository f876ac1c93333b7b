"""`preprocess` throughput: tokens written per wall second of the whole command, on a
generated ~100 MB text corpus with 2 workers.

The corpus is made deterministically in a temp dir (seeded numpy RNG): 20,000 made-up
words of 1–4 syllables drawn with Zipf-like frequencies, lines of 4–40 words, documents of
1–20 lines separated by blank lines (fairseq's text format); a train file of --mb MB and
a valid file of 1/100 of that. Like fairseq-preprocess, which binarizes with a BPE and a
dictionary made beforehand, the timed command reuses a tokenizer: sentencepiece (default
--vocab-size 8000) is trained once, untimed but reported, by `preprocess` on a 5 MB
sample; each repetition then runs `preprocess --spm-model … --trainpref --validpref
--destdir <fresh dir> --workers 2`, timed from launch to exit; tokens written are the
split token counts in the metadata.json it wrote (each line's </s> included). Also
reported: the encode phase alone, from the `<split>: … tokens, … tokens/s` lines
preprocess prints. Medians over repetitions. Goal: whole command ≥ 1 M tokens/s.

Usage: python bench/bench_preprocess.py [--reps 3] [--mb 100] [--workers 2]
"""

import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchlib import BIN, goal, median, note, parser, report

GOAL_TPS = 1e6


def make_words(rng, n=20_000):
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["an", "el", "is", "or", "un"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables, size=rng.integers(1, 5))))
    return np.array(sorted(words), dtype=object)[rng.permutation(n)]  # frequency rank ≠ spelling


def write_corpus(path, megabytes, rng, words):
    """Lines of Zipf-distributed words, blank lines between documents, until `megabytes` MB."""
    weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.1
    weights /= weights.sum()
    target, written = int(megabytes * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            ids = rng.choice(len(words), size=200_000, p=weights)
            lengths = rng.integers(4, 41, size=len(ids) // 4)
            ends = np.cumsum(lengths)
            ends = ends[ends <= len(ids)]
            doc_lines = rng.integers(1, 21, size=len(ends))
            lines, start, left = [], 0, doc_lines[0]
            for k, end in enumerate(ends):
                lines.append(" ".join(words[ids[start:end]]))
                start, left = end, left - 1
                if left == 0:
                    lines.append("")  # end of document
                    left = doc_lines[k]
            text = "\n".join(lines) + "\n"
            if written + len(text) > target:  # ASCII: characters are bytes
                text = text[: text.index("\n", target - written) + 1]
            f.write(text)
            written += len(text)
    return written


def run_preprocess(corpus, dest, workers, spm_model=None):
    """(wall seconds, tokens written, encode seconds) of one preprocess command."""
    cmd = [
        str(BIN / "preprocess"),
        "--trainpref",
        str(corpus / "train.txt"),
        "--validpref",
        str(corpus / "valid.txt"),
        "--destdir",
        str(dest),
        "--workers",
        str(workers),
    ]
    cmd += ["--spm-model", str(spm_model)] if spm_model else []
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    seconds = time.perf_counter() - start
    meta = json.loads((dest / "metadata.json").read_text())
    tokens = sum(split["tokens"] for split in meta["splits"].values())
    phases = re.findall(r"^\w+: [\d,]+ documents, ([\d,]+) tokens, ([\d,]+) tokens/s", out, re.M)
    encode = sum(int(t.replace(",", "")) / float(r.replace(",", "")) for t, r in phases)
    return seconds, tokens, encode


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--mb", type=float, default=100, help="size of the generated train file in MB")
    p.add_argument("--workers", type=int, default=2, help="preprocess --workers")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        rng = np.random.default_rng(1234)
        words = make_words(rng)
        size = write_corpus(corpus / "train.txt", a.mb, rng, words)
        size += write_corpus(corpus / "valid.txt", a.mb / 100, rng, words)
        note(f"generated {size / 1e6:.1f} MB of text in {corpus}")
        sample = Path(tmp) / "sample"
        sample.mkdir()
        write_corpus(sample / "train.txt", min(5, a.mb), np.random.default_rng(99), words)
        write_corpus(sample / "valid.txt", 0.01, np.random.default_rng(98), words)
        tok_seconds = run_preprocess(sample, Path(tmp) / "tokenizer", a.workers)[0]
        spm_model = Path(tmp) / "tokenizer" / "tokenizer.model"
        note(f"sentencepiece trained on a {min(5, a.mb):.0f} MB sample (+ encoding it) in {tok_seconds:.1f} s")
        runs = []
        for rep in range(a.reps):
            runs.append(run_preprocess(corpus, Path(tmp) / f"data-bin-{rep}", a.workers, spm_model))
            seconds, tokens, encode = runs[-1]
            note(
                f"rep {rep + 1}: {tokens:,} tokens in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s), "
                f"encode {encode:.1f} s ({tokens / encode:,.0f} tokens/s)"
            )
    tokens = runs[0][1]
    whole, encode = median(t / s for s, t, _ in runs), median(t / e for _, t, e in runs)
    print(
        f"\n{size / 1e6:.0f} MB of generated text, {tokens:,} tokens, --workers {a.workers}, "
        f"{a.reps} repetitions, medians\n"
    )
    print(f"tokenizer trained beforehand on a 5 MB sample, once: {tok_seconds:.1f} s\n")
    print("| phase | seconds | tokens/s |")
    print("|---|---|---|")
    print(f"| whole preprocess command | {median(s for s, _, _ in runs):.1f} | {whole:,.0f} |")
    print(f"| encode phase (both splits) | {median(e for _, _, e in runs):.1f} | {encode:,.0f} |")
    report(
        [
            goal(
                f"preprocess: tokens/s, whole command ({size / 1e6:.0f} MB, {a.workers} workers)",
                f"{whole / 1e6:.2f} M",
                f"≥ {GOAL_TPS / 1e6:.0f} M",
                whole >= GOAL_TPS,
            ),
            goal("preprocess: tokens/s, encode phase alone", f"{encode / 1e6:.2f} M", "-", None),
        ],
        a.results,
    )


if __name__ == "__main__":
    main()
