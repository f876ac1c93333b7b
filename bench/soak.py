"""Soak: a bounded FSDP run with frequent checkpoints must stay flat and train exactly as
the same run without them.

Runs `train` on the embedded corpus with the tiny model (2 layers x 64, 32 tokens, 4
sequences per rank, dropout 0.1 so that the RNG matters) on 2 local FSDP ranks
(`--ddp-backend fully_sharded --distributed-world-size 2`) for --updates updates, saving
every --save-every updates with `--keep-interval-updates --keep` (and
`--no-epoch-checkpoints`, so the update checkpoints are all there is to count), logging
every update as json. While it runs, every --interval seconds, it reads each rank's
resident memory (VmRSS in /proc/<pid>/status) and open file descriptors
(/proc/<pid>/fd), tagged with the last update logged. Then it runs the same command with
`--no-save` and compares the two.

Warm-up is the first 10 % of the updates or the first 2 checkpoints, whichever is longer:
memory grows while the allocator's pools, the data pipeline's buffers and the first
saves' writer threads and buffers come into being, and only the second save runs with
all of them in place. Samples from the end of warm-up until the last update are judged
(the exit, where memory is freed, is not).

Checks (each a row, pass or fail; the script exits 1 if any fails):
- RSS per rank: every judged sample within +-5 % of the median of the first 10 judged
  samples (the level at the end of warm-up);
- open fds per rank: max - min of the judged samples <= 16 (a save holds a file or two
  open for a moment; the data-loader worker (--num-workers 1, fairseq's default) hands
  each prefetched batch over through shared-memory file descriptors), and the fewest open in
  the last quarter not above the fewest in the
  first (a leak raises that floor; a save caught in the act only adds a transient peak);
- retention: exactly --keep update checkpoints at the end (`checkpoint_<epoch>_<updates>`,
  the last --keep multiples of --save-every), `checkpoint_last` (at the final update) and
  `checkpoint_best` present, no `.tmp-` directory left;
- loss curve: every update's logged loss, ppl and gnorm, and every validation's loss,
  identical in the two runs (saving must not perturb the RNG or the data order).

Usage: python bench/soak.py [--updates 2000] [--save-every 100] [--keep 3] [--interval 1]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.checkpoint.files import TMP_PREFIX, UPDATE_CKPT
from trainer.formats.shardlm.checkpoint_dir import is_checkpoint

BIN = Path(sys.executable).parent  # `train` of the same venv
MODEL = [
    "--arch",
    "transformer_lm_gpt2_tiny",
    "--decoder-attention-heads",
    "2",
    "--decoder-ffn-embed-dim",
    "128",
    "--dropout",
    "0.1",
    "--attention-dropout",
    "0",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--ddp-backend",
    "fully_sharded",
    "--distributed-world-size",
    "2",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--max-valid-steps",
    "10",
    "--no-epoch-checkpoints",
]
RSS_BAND = 0.05
FD_SPREAD = 16  # see the checks above: saves and the data-loader worker's batches


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Soak: a bounded 2-rank FSDP run with checkpoints stays flat.")
    p.add_argument("--updates", type=int, default=2000)
    p.add_argument("--save-every", type=int, default=100, help="--save-interval-updates")
    p.add_argument("--keep", type=int, default=3, help="--keep-interval-updates")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples of RSS and fds")
    p.add_argument("--workdir", help="where the runs write (default: a temporary directory, removed after)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a run may take")
    return p.parse_args(argv)


def child_pids(parent):
    """The rank processes of `train`: children of the server it forks them from
    (trainer/launch/local_ranks.py), itself a child of `train`."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            if b"forkserver" in Path(f"/proc/{entry}/cmdline").read_bytes():
                children.setdefault(ppid, []).append(int(entry))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return sorted(pid for server in children.get(parent, []) for pid in children.get(server, []))  # rank 0 first


def rss_and_fds(pid):
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb, len(os.listdir(f"/proc/{pid}/fd"))


def records(log_text, tag):
    return [json.loads(line[line.index("{") :]) for line in log_text.splitlines() if f"| {tag} |" in line]


def run(argv, workdir, name, interval, timeout):
    """`train ARGV` in workdir; returns (log text, samples[(update, rank, rss_kb, fds)], seconds)."""
    log_path = workdir / f"{name}.log"
    samples, update, pending = [], 0, ""
    start = time.perf_counter()
    with open(log_path, "w") as log_file, open(workdir / f"{name}.err", "w") as err:
        proc = subprocess.Popen([str(BIN / "train")] + argv, stdout=log_file, stderr=err, cwd=workdir)
        with open(log_path) as reader:
            while proc.poll() is None:
                if time.perf_counter() - start > timeout:
                    proc.kill()
                    proc.wait()
                    raise SystemExit(f"soak: {name} run took over {timeout:.0f} s; killed")
                pending += reader.read()
                *lines, pending = pending.split("\n")
                for line in lines:
                    if "| train_inner |" in line:
                        update = json.loads(line[line.index("{") :])["num_updates"]
                for rank, pid in enumerate(child_pids(proc.pid)):
                    try:
                        samples.append((update, rank, *rss_and_fds(pid)))
                    except (OSError, StopIteration):
                        pass  # the rank is exiting
                time.sleep(interval)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"soak: {name} run failed ({proc.returncode}): {(workdir / f'{name}.err').read_text().strip()[-2000:]}"
        )
    return log_path.read_text(), samples, seconds


def memory_rows(samples, warmup, updates):
    rows = []
    for rank in sorted({s[1] for s in samples}):
        judged = [s for s in samples if s[1] == rank and warmup <= s[0] < updates]
        if len(judged) < 8:
            rows.append((f"rank {rank}: samples after warm-up", f"{len(judged)}", ">= 8", False))
            continue
        rss = [s[2] / 1024 for s in judged]
        ref = statistics.median(rss[:10])
        lo, hi = min(rss) / ref - 1, max(rss) / ref - 1
        rows.append(
            (
                f"rank {rank}: RSS after warm-up ({len(judged)} samples)",
                f"{min(rss):.1f}-{max(rss):.1f} MB, {lo:+.1%} / {hi:+.1%} of {ref:.1f} MB",
                f"within +-{RSS_BAND:.0%}",
                -RSS_BAND <= lo and hi <= RSS_BAND,
            )
        )
        fds = [s[3] for s in judged]
        q = max(len(fds) // 4, 1)
        first, last = min(fds[:q]), min(fds[-q:])
        rows.append(
            (
                f"rank {rank}: open fds after warm-up",
                f"{min(fds)}-{max(fds)}, fewest in the first quarter {first}, in the last {last}",
                f"max-min <= {FD_SPREAD}, floor does not rise",
                max(fds) - min(fds) <= FD_SPREAD and last <= first,
            )
        )
    return rows


def retention_rows(save_dir, updates, save_every, keep):
    names = sorted(p.name for p in save_dir.iterdir())
    kept = sorted(int(UPDATE_CKPT.match(n).group(2)) for n in names if UPDATE_CKPT.match(n))
    expected = [u for u in range(save_every, updates + 1, save_every)][-keep:]
    leftovers = [n for n in names if n.startswith(TMP_PREFIX)]
    last = save_dir / "checkpoint_last"
    last_updates = json.loads((last / "trainer_state.json").read_text())["num_updates"] if is_checkpoint(last) else None
    return [
        ("update checkpoints kept", f"{len(kept)}: at updates {kept}", f"exactly {keep}: {expected}", kept == expected),
        (
            "checkpoint_last, checkpoint_best",
            f"last at update {last_updates}, best "
            f"{'present' if is_checkpoint(save_dir / 'checkpoint_best') else 'missing'}, "
            f"{len(leftovers)} .tmp- left",
            f"last at {updates}, best present, none left",
            last_updates == updates and is_checkpoint(save_dir / "checkpoint_best") and not leftovers,
        ),
    ]


def curve_rows(saving_log, plain_log, updates):
    rows = []
    for tag, keys in (("train_inner", ("loss", "ppl", "gnorm")), ("valid", ("valid_loss",))):
        a = {r["num_updates" if tag == "train_inner" else "valid_num_updates"]: r for r in records(saving_log, tag)}
        b = {r["num_updates" if tag == "train_inner" else "valid_num_updates"]: r for r in records(plain_log, tag)}
        same = sum(1 for n in a if n in b and all(a[n][k] == b[n][k] for k in keys))
        diff = max((abs(a[n][keys[0]] - b[n][keys[0]]) for n in a if n in b), default=float("nan"))
        complete = set(a) == set(b) and (tag != "train_inner" or len(a) == updates)
        rows.append(
            (
                f"{tag} records equal without checkpoints ({', '.join(keys)})",
                f"{same} of {len(a)} (vs {len(b)}), largest {keys[0]} difference {diff:g}",
                "all identical",
                complete and same == len(a) > 0,
            )
        )
    return rows


def main(argv=None):
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shardlm-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    warmup = max(args.updates // 10, 2 * args.save_every)
    common = MODEL + ["--max-update", str(args.updates), "--save-interval-updates", str(args.save_every)]
    saving = common + ["--save-dir", "ck", "--keep-interval-updates", str(args.keep)]
    try:
        saving_log, samples, t_saving = run(saving, workdir, "saving", args.interval, args.timeout)
        plain_log, _, t_plain = run(common + ["--no-save"], workdir, "no-save", args.interval, args.timeout)
        rows = (
            memory_rows(samples, warmup, args.updates)
            + retention_rows(workdir / "ck", args.updates, args.save_every, args.keep)
            + curve_rows(saving_log, plain_log, args.updates)
        )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"soak: {args.updates} updates on 2 FSDP ranks, a checkpoint every {args.save_every} (keep "
        f"{args.keep}): {t_saving:.0f} s; without checkpoints {t_plain:.0f} s; warm-up {warmup} updates; "
        f"a sample every {args.interval:g} s\n"
    )
    print("| check | measured | limit | result |\n|---|---|---|---|")
    for check, measured, limit, ok in rows:
        print(f"| {check} | {measured} | {limit} | {'pass' if ok else 'FAIL'} |")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
