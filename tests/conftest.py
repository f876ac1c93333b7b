"""Every test runs in its own empty directory: `train` writes ./checkpoints by default and
resumes from ./checkpoints/checkpoint_last, so a run left in the repository by hand must
never leak into a test (and no test writes into the repository)."""

import pytest


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def pytest_terminal_summary(terminalreporter):
    """Say how many tests ran against the live SLURM cluster (they skip where it cannot start)."""
    counts = {}
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            if "test_slurm.py" in getattr(report, "nodeid", "") and report.when in ("call", "setup"):
                if outcome == "passed" and report.when != "call":
                    continue
                counts[outcome] = counts.get(outcome, 0) + 1
    if counts:
        terminalreporter.write_line(
            "SLURM tests on the live cluster: " + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        )
