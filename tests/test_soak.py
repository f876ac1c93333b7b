"""bench/soak.py's machinery on a short run (the 2,000-update soak is `make soak`): two real
2-rank FSDP runs, with and without checkpoints, sampled from /proc while they run."""

import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_short_soak_passes_every_check(tmp_path):
    # 60 updates after warm-up, sampled every 0.05 s: the soak needs 8 samples after warm-up,
    # and on a fast day 40 updates here took under 2 s (6 samples at 0.25 s).
    r = subprocess.run(
        [
            sys.executable,
            str(SOAK),
            "--updates",
            "80",
            "--save-every",
            "10",
            "--keep",
            "2",
            "--interval",
            "0.05",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    rows = table[1:]  # below the header
    assert r.returncode == 0 and len(rows) == 8 and all(row.endswith("| pass |") for row in rows), r.stdout + r.stderr
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("checkpoint_1_"))
    assert kept == ["checkpoint_1_70", "checkpoint_1_80"]
