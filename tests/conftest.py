"""Every test runs in its own empty directory: `train` writes ./checkpoints by default and
resumes from ./checkpoints/checkpoint_last, so a run left in the repository by hand must
never leak into a test (and no test writes into the repository)."""
import pytest


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
