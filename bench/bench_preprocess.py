"""`preprocess` at corpus scale: tokens/s per worker against the same tokenizer's
`encode_batch` in one process, and peak memory on a corpus 10× larger than another.

Corpus: generated jsonl (seeded numpy RNG): 20,000 made-up words of 1–4 syllables with
Zipf-like frequencies, documents of 1–20 lines of 4–40 words, one `{"text": …}` object a
line, in 16 MB blocks. The tokenizer is sentencepiece (bpe, --vocab-size 8000) trained
once, untimed, by `preprocess` on a 5 MB sample; every timed command reuses it
(`--spm-model`), as fairseq-preprocess reuses a BPE made beforehand.

Speed, on --mb MB of unique text in 4 files: the ceiling is `SentencePieceTokenizer
.encode_batch` (sentencepiece's batch encode, one thread, 1,000 rows a call, each row's
</s> added) over the texts, already parsed and in memory, in this process; against it
`preprocess --workers 1` and `--workers 2`, whose encode phase (the `train: … tokens/s`
line it prints: reading, parsing, encoding, writing shards, in its workers) and whole
command (launch to exit) are timed. Interleaved repetitions, medians of the ratios.
Goals: --workers 1 ≥ 0.8× the ceiling, --workers 2 ≥ 1.7×.

Memory, with --workers 2 and the default --shard-mb: the peak resident set size of the
command and its workers together (sampled from /proc every 0.1 s) on a corpus of a tenth of
the machine's available memory (--big-gb; 10× its hundredth) and on one 10× smaller; the
big corpus repeats 16 MB blocks in other orders (its text is not all unique; reading and
encoding cost the same). Goal: the big corpus's peak ≤ 1.25× the small one's (flat).

Usage: python bench/bench_preprocess.py [--reps 3] [--mb 32] [--big-gb auto] [--page docs/benchmarks.md]
"""

import datetime
import json
import os
import platform
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from run_all import cpu_model, git_commit

from benchlib import BIN, ROOT, goal, goal_table, median, note, parser, report

sys.path.insert(0, str(ROOT))
from data.tokenizer import SentencePieceTokenizer  # noqa: E402

BLOCK_MB = 16
SECTION = "## bench_preprocess.py"


def make_words(rng, n=20_000):
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["an", "el", "is", "or", "un"]
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(syllables, size=rng.integers(1, 5))))
    return np.array(sorted(words), dtype=object)[rng.permutation(n)]  # frequency rank ≠ spelling


def jsonl_block(rng, words, megabytes) -> bytes:
    """Documents as jsonl lines, about `megabytes` MB."""
    weights = 1.0 / (np.arange(len(words)) + 2.7) ** 1.1
    weights /= weights.sum()
    out, size = [], 0
    while size < megabytes * 1e6:
        ids = rng.choice(len(words), size=100_000, p=weights)
        lengths = rng.integers(4, 41, size=len(ids) // 4)
        ends = np.cumsum(lengths)
        ends = ends[ends <= len(ids)]
        start, lines, left = 0, [], int(rng.integers(1, 21))
        for end in ends:
            lines.append(" ".join(words[ids[start:end]]))
            start, left = end, left - 1
            if left == 0:
                row = (json.dumps({"text": "\n".join(lines)}) + "\n").encode()
                out.append(row)
                size += len(row)
                lines, left = [], int(rng.integers(1, 21))
    return b"".join(out)


def write_corpus(root: Path, blocks: list[bytes], files: int, megabytes: float, rng) -> int:
    """`files` jsonl files of `megabytes` MB in all, from `blocks` in shuffled orders."""
    root.mkdir(parents=True)
    per_file, written = megabytes * 1e6 / files, 0
    for k in range(files):
        with open(root / f"part-{k:04d}.jsonl", "wb") as f:
            size = 0
            while size < per_file:
                for i in rng.permutation(len(blocks)):
                    f.write(blocks[i])
                    size += len(blocks[i])
                    if size >= per_file:
                        break
            written += size
    return written


def texts_of(root: Path) -> list[str]:
    texts = []
    for path in sorted(root.iterdir()):
        with open(path, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def ceiling(model: Path, texts: list[str]) -> tuple[int, float, float]:
    """(tokens, seconds, CPU seconds) of encode_batch over every text, 1,000 a call, here."""
    tokenizer = SentencePieceTokenizer(model)
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for lo in range(0, len(texts), 1000):
        tokens += sum(map(len, tokenizer.encode_batch(texts[lo : lo + 1000], add_eos=True)))
    return tokens, time.perf_counter() - start, time.process_time() - cpu


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        new = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= new
        grew = bool(new)
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_preprocess(inputs: Path, dest: Path, workers: int, model: Path | None, extra=()):
    """(wall seconds, encode-phase tokens/s, tokens, peak RSS bytes of the process tree, CPU
    seconds of the command and its workers, startup included)."""
    cmd = [str(BIN / "preprocess"), "--trainpref", str(inputs), "--destdir", str(dest), "--workers", str(workers)]
    cmd += (["--spm-model", str(model)] if model else []) + list(extra)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start, cpu = time.perf_counter(), children_cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.1):
            peak[0] = max(peak[0], tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"preprocess failed ({proc.returncode}): {' '.join(cmd)}")
    tokens = json.loads((dest / "metadata.json").read_text())["splits"]["train"]["tokens"]
    rate = re.search(r"^train: [\d,]+ documents, [\d,]+ tokens, ([\d,]+) tokens/s", out, re.M)
    return seconds, float(rate.group(1).replace(",", "")), tokens, peak[0], children_cpu() - cpu


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 8.0


def write_section(page: Path, text: str, command: str) -> None:
    """Replace this script's section of the page (or add it at the end)."""
    head = (
        f"{SECTION} (issue 49 item 3: preprocess at corpus scale)\n\n"
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M} (local time)\n"
        f"- host: {socket.gethostname()}, {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}\n"
        f"- commit: {git_commit()}\n"
        f"- command: `{command}`\n\n"
    )
    old = page.read_text() if page.exists() else "# Benchmarks\n"
    start = old.find(f"\n{SECTION}")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + head + text
    else:
        end = old.find("\n## ", start + 1)
        new = old[: start + 1] + head + text + ("\n" + old[end + 1 :] if end >= 0 else "")
    page.write_text(new)


def main():
    p = parser(__doc__, reps=3)
    p.add_argument("--mb", type=float, default=32, help="MB of unique jsonl for the speed runs")
    p.add_argument("--big-gb", type=float, help="the big corpus in GB (default: available memory / 10)")
    p.add_argument("--page", type=Path, help="also write the tables into this page's own section")
    a = p.parse_args()
    available = available_gb()
    big_gb = a.big_gb or available / 10
    lines, loads = [], [load()]

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        tmp = Path(tmp)
        rng = np.random.default_rng(1234)
        words = make_words(rng)
        blocks = [jsonl_block(rng, words, min(BLOCK_MB, a.mb / 4)) for _ in range(max(1, round(a.mb / BLOCK_MB)))]
        speed = tmp / "speed"
        size = write_corpus(speed, blocks, 4, sum(map(len, blocks)) / 1e6, rng)
        sample = tmp / "sample"
        sample.mkdir()
        (sample / "part.jsonl").write_bytes(jsonl_block(np.random.default_rng(99), words, 5))
        tok_seconds = run_preprocess(sample, tmp / "tok", 1, None, ["--vocab-size", "8000"])[0]
        model = tmp / "tok" / "tokenizer.model"
        note(f"{size / 1e6:.0f} MB of jsonl; sentencepiece trained on a 5 MB sample in {tok_seconds:.1f} s")
        texts = texts_of(speed)
        shard = ["--shard-mb", f"{size / 1e6 / 16:.3f}"]  # 16 chunks: both workers busy to the end
        # contender -> per repetition (encode tokens/s, wall s, whole-command tokens/s, CPU s)
        rows = {"ceiling": [], 1: [], 2: []}
        for rep in range(a.reps):
            tokens, seconds, cpu = ceiling(model, texts)
            rows["ceiling"].append((tokens / seconds, seconds, tokens / seconds, cpu))
            for workers in (1, 2) if rep % 2 == 0 else (2, 1):
                dest = tmp / f"out-{rep}-{workers}"
                wall, encode, written, _, cpu = run_preprocess(speed, dest, workers, model, shard)
                assert written == tokens, (written, tokens)
                rows[workers].append((encode, wall, written / wall, cpu))
                shutil_rm(dest)
            last = [rows[k][-1][0] for k in ("ceiling", 1, 2)]
            note(f"rep {rep + 1}: encode tokens/s ceiling {last[0]:,.0f}, workers 1 {last[1]:,.0f}, 2 {last[2]:,.0f}")
        del texts
        shutil_rm(speed)
        ratio = {w: median(r[0] / c[0] for r, c in zip(rows[w], rows["ceiling"], strict=True)) for w in (1, 2)}
        say(f"Speed: {size / 1e6:.0f} MB of jsonl in 4 files, {tokens:,} tokens, {shard[0]} {shard[1]} (16 chunks),")
        say(f"sentencepiece bpe 8000, {a.reps} interleaved repetitions, medians. CPU s: the command and its")
        say("workers together, startup included (the ceiling's: encoding only); tokens per CPU s does not")
        say("depend on what else shares the cores.\n")
        say(
            "| contender | encode tokens/s | × ceiling | per worker × ceiling | whole command s | "
            "whole tokens/s | CPU s | tokens per CPU s |"
        )
        say("|---|---|---|---|---|---|---|---|")
        for name, r in rows.items():
            label = "encode_batch, one process (ceiling)" if name == "ceiling" else f"preprocess --workers {name}"
            x = 1.0 if name == "ceiling" else ratio[name]
            per = x if name == "ceiling" else x / name
            whole = "- (encoding only)" if name == "ceiling" else f"{median(v[1] for v in r):.1f}"
            whole_rate = "-" if name == "ceiling" else f"{median(v[2] for v in r):,.0f}"
            cpu = median(v[3] for v in r)
            say(
                f"| {label} | {median(v[0] for v in r):,.0f} | {x:.2f} | {per:.2f} | {whole} | {whole_rate} | "
                f"{cpu:.1f} | {tokens / cpu:,.0f} |"
            )
        loads.append(load())

        memory = {}
        for name, gb in (("small", big_gb / 10), ("big", big_gb)):
            corpus = tmp / name
            written = write_corpus(corpus, blocks, max(2, round(gb * 1e3 / 128)), gb * 1e3, rng)
            wall, encode, tokens_written, peak, _ = run_preprocess(corpus, tmp / f"out-{name}", 2, model)
            memory[name] = (written, tokens_written, wall, encode, peak)
            note(f"{name}: {written / 1e9:.2f} GB, {tokens_written:,} tokens in {wall:.0f} s, peak {peak / 1e9:.2f} GB")
            shutil_rm(corpus)
            shutil_rm(tmp / f"out-{name}")
        loads.append(load())
        say(
            f"\nMemory: --workers 2, default --shard-mb; the big corpus is a tenth of the {available:.0f} GB "
            "available when the script started\n"
        )
        say("| corpus | GB of jsonl | tokens | seconds | encode tokens/s | peak RSS, command + workers (GB) |")
        say("|---|---|---|---|---|---|")
        for name, (written, tokens, wall, encode, peak) in memory.items():
            say(f"| {name} | {written / 1e9:.2f} | {tokens:,} | {wall:.0f} | {encode:,.0f} | {peak / 1e9:.3f} |")
    say(f"\nLoad average (1 min) at the start, after the speed runs, at the end: {', '.join(loads)}")
    flat = memory["big"][4] / memory["small"][4]
    rows_goal = [
        goal("preprocess --workers 1: encode tokens/s × encode_batch's", f"{ratio[1]:.2f}", "≥ 0.8", ratio[1] >= 0.8),
        goal("preprocess --workers 2: encode tokens/s × encode_batch's", f"{ratio[2]:.2f}", "≥ 1.7", ratio[2] >= 1.7),
        goal(
            f"preprocess peak RSS, {memory['big'][0] / 1e9:.1f} GB corpus × a 10× smaller one's",
            f"{flat:.2f}",
            "≤ 1.25",
            flat <= 1.25,
        ),
    ]
    report(rows_goal, a.results)
    if a.page:
        write_section(
            a.page,
            "\n".join(lines) + "\n\n" + goal_table(rows_goal) + "\n",
            " ".join(["bench/bench_preprocess.py", *sys.argv[1:]]),
        )


def shutil_rm(path: Path) -> None:
    subprocess.run(["rm", "-rf", str(path)], check=True)


if __name__ == "__main__":
    main()
