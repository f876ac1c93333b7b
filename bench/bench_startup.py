"""Start-up: wall seconds from launching `train` to its first logged update, and how long
`train --help` takes.

`train --arch transformer_lm_gpt2_tiny --batch-size 8 --tokens-per-sample 128` on the
embedded corpus (one untimed run first prepares it into ~/.cache/shardlm, as a user's first
run does, and fills the OS's file cache), `--log-interval 1 --log-format json --no-save`.
The clock starts just before the process is launched and stops when its first
`train_inner` line arrives on the pipe (read line by line; logging flushes every record);
the process is then stopped. So it counts interpreter and torch start-up, config
composition, model build, data loading and the first update. `train --help` is timed to
its exit. The same run on 2 local FSDP ranks (`--distributed-world-size 2 --ddp-backend
fully_sharded`) is timed too, for information: its ranks are forks of a server that
imported torch once (trainer/launch/local_ranks.py).
Runs alternate (help, train, 2 ranks, help, …); medians. Goal: first update ≤ 8 s;
`--help` has no goal (it answers before torch is imported, so it should take well under
torch's import time).

Usage: python bench/bench_startup.py [--reps 5]
"""

import subprocess
import time

from benchlib import BIN, ROOT, goal, median, note, parser, report

ARGS = [
    "--arch",
    "transformer_lm_gpt2_tiny",
    "--batch-size",
    "8",
    "--tokens-per-sample",
    "128",
    "--log-interval",
    "1",
    "--log-format",
    "json",
    "--no-save",
    "--max-update",
    "5",
]
TWO_RANKS = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
GOAL_S = 8.0


def seconds_to_first_update(extra=()):
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(BIN / "train")] + ARGS + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    try:
        lines = []
        for line in proc.stdout:
            if "| train_inner |" in line:
                return time.perf_counter() - start
            lines.append(line)
        raise RuntimeError(f"train exited ({proc.wait()}) before logging an update:\n" + "".join(lines[-5:]))
    finally:
        proc.kill()  # the update has been seen; the rest of the run is not measured
        proc.stdout.close()
        proc.wait()


def seconds_for_help():
    start = time.perf_counter()
    subprocess.run([str(BIN / "train"), "--help"], check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def main():
    a = parser(__doc__, reps=5).parse_args()
    note(f"untimed first run (prepares the embedded corpus if needed): {seconds_to_first_update():.1f} s")
    first, helps, two = [], [], []
    for rep in range(a.reps):
        helps.append(seconds_for_help())
        first.append(seconds_to_first_update())
        two.append(seconds_to_first_update(TWO_RANKS))
        note(f"rep {rep + 1}: --help {helps[-1]:.2f} s, first update {first[-1]:.2f} s, on 2 ranks {two[-1]:.2f} s")
    f, h, t = median(first), median(helps), median(two)
    print(f"\n`train {' '.join(ARGS)}`, {a.reps} alternating repetitions, medians\n")
    print("| measurement | seconds |")
    print("|---|---|")
    print(f"| launch → first train_inner record | {f:.2f} |")
    print(f"| the same on 2 local FSDP ranks | {t:.2f} |")
    print(f"| train --help | {h:.2f} |")
    report(
        [
            goal("start-up: launch → first logged update (tiny model)", f"{f:.2f} s", f"≤ {GOAL_S:.0f} s", f <= GOAL_S),
            goal("start-up: the same on 2 local FSDP ranks", f"{t:.2f} s", "(info)", None),
            goal("start-up: train --help", f"{h:.2f} s", "-", None),
        ],
        a.results,
    )


if __name__ == "__main__":
    main()
