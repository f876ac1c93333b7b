"""bench/bench_gpu.py, where there is no GPU: `--quick` runs every contender of the one-GPU
benchmark on a tiny Llama and prints the whole table (the H200 run is the real one); without
--quick it refuses in one line; its full shape is the Llama 3.2 1B preset's."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.config import LLAMA_PRESETS, PUBLISHED_VOCABS

BENCH = Path(__file__).resolve().parent.parent / "bench"
ROWS = [
    "plain loop (ref_loop.py)",
    "train",
    "train --compile",
    "train --ddp-backend fully_sharded",
    "train --ddp-backend fully_sharded --compile",
    "train --ddp-backend fully_sharded --cpu-offload",
]
COLUMNS = ["run", "tokens/s", "step ms", "model TFLOP/s", "MFU", "peak memory GB", "plan GB", "plan error"]
GOALS = [
    "train / plain loop tokens/s",
    "train --ddp-backend fully_sharded / train tokens/s",
    "bf16 MFU of train --ddp-backend fully_sharded",
    "plan predicted vs measured peak memory, 5 train runs",
    "train --ddp-backend fully_sharded --cpu-offload step time",
]
NO_GPU = not (Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi"))


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def number(text):
    return float(text.rstrip("%").replace("+", ""))


@pytest.mark.slow  # six short runs: five of `train`, one of the plain loop
def test_quick_prints_every_row_and_column_with_numbers():
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_gpu.py"), "--quick"], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    tables = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert cells(tables[0]) == COLUMNS, r.stdout
    rows = {cells(line)[0]: cells(line)[1:] for line in tables[1 : 1 + len(ROWS)]}  # below the header
    assert list(rows) == ROWS, r.stdout
    for name, values in rows.items():
        tokens, step_ms, tflops, mfu, memory, plan, error = values
        # a tiny model's TFLOP/s and MFU may round to 0 in train's records; a number all the same
        assert min(number(tokens), number(step_ms), number(memory)) > 0 and min(number(tflops), number(mfu)) >= 0, (
            f"{name}: {values}"
        )
        if name == ROWS[0]:  # plan predicts train's memory, not the plain loop's
            assert (plan, error) == ("-", "-"), values
        else:
            assert number(plan) > 0 and abs(number(error)) >= 0, f"{name}: {values}"
    goals = [cells(line)[0] for line in tables if line.startswith("| gpu --quick: ")]
    assert goals == [f"gpu --quick: {g}" for g in GOALS], r.stdout


@pytest.mark.skipif(not NO_GPU, reason="a GPU is here: the benchmark would run for real")
def test_without_a_gpu_it_stops_in_one_line(tmp_path):
    results = tmp_path / "goals.jsonl"
    r = subprocess.run(
        [sys.executable, str(BENCH / "bench_gpu.py"), "--results", str(results)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    why = "needs a CUDA GPU and there is none here (--quick runs a tiny shape on this CPU)"
    assert r.returncode == 0 and r.stdout == "" and r.stderr.splitlines() == [f"bench_gpu: {why}"], r.stderr
    # make bench (run_all.py) goes on, its table saying the benchmark was not run
    assert [json.loads(line) for line in results.read_text().splitlines()] == [
        {"benchmark": "gpu: the one-GPU benchmark", "measured": "not run", "goal": why, "met": "not measured"}
    ]


def test_full_shape_is_the_llama_3_2_1b_preset():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCH))
    preset, s = LLAMA_PRESETS["llama3_2_1b"], bench_gpu.FULL
    assert (s["layers"], s["dim"], s["heads"], s["kv_heads"], s["ffn"]) == (
        preset["decoder_layers"],
        preset["decoder_embed_dim"],
        preset["decoder_attention_heads"],
        preset["decoder_kv_heads"],
        preset["decoder_ffn_embed_dim"],
    )
    assert s["dim"] // s["heads"] == preset["decoder_head_dim"] and preset["share_decoder_input_output_embed"]
    assert s["vocab"] == PUBLISHED_VOCABS["llama3_2_1b"] and s["seq"] == 2048
