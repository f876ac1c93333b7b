"""The flag search (trainer/plan/search.py) on the published cases: fairseq's README (the
13B on 8 V100s and on one), the FSDP paper (GPT-175B on 128 A100s), other machines' hosts,
the published Llama shapes with their vocabularies; and checkpointing as composition
resolved it, in the search's candidates and in --auto-tune's choice."""

from dataclasses import replace

import pytest
from plan_helpers import SETUP, cfg_of, plan_json

import cli
from trainer.plan.ledger import GB


def test_the_planner_reads_checkpointing_as_composition_resolved_it():
    """One rule (trainer/config/implied.py) makes --offload-activations imply checkpointing:
    in the composed config the planner reads, and in every candidate its search builds."""
    from trainer.plan.search import flag_sets, flags_of, setup_of

    given = setup_of(cfg_of("--offload-activations", "--ddp-backend", "fully_sharded"), "cuda", 8)
    assert given.checkpoint_activations and given.offload_activations
    for label, s in flag_sets(replace(given, offload_activations=False, checkpoint_activations=False)):
        assert s.checkpoint_activations or not s.offload_activations, label
        if s.offload_activations:  # the flag the user adds implies the other
            assert "--checkpoint-activations" not in flags_of(s, SETUP), label
    assert "--checkpoint-activations" in flags_of(replace(SETUP, checkpoint_activations=True), SETUP)
    # --auto-tune writes its choice into the composed config: as resolved, the implied flag set
    from trainer.launch.auto_tune import apply_choice

    cfg = cfg_of("--ddp-backend", "fully_sharded")
    offload = next(s for label, s in flag_sets(setup_of(cfg, "cuda", 8)) if label == "+ offload activations")
    model = apply_choice(cfg, offload).model
    assert model.offload_activations and model.checkpoint_activations


GPT3_13 = [
    "--task",
    "dummy_lm",
    "--dict-size",
    "50272",
    "--arch",
    "transformer_lm_gpt3_13",
    "--tokens-per-sample",
    "2048",
    "--fp16",
    "--ddp-backend",
    "fully_sharded",
]


def test_fairseq_readme_13b_on_8_v100s_fits_at_batch_1_with_checkpointing(capsys):
    """fairseq's FSDP README: transformer_lm_gpt3_13 on 8 x 32 GB V100 without offload fits at batch 1."""
    argv = GPT3_13 + [
        "--distributed-world-size",
        "8",
        "--device-memory-gb",
        "32",
        "--host-memory-gb",
        "512",
        "--batch-size",
        "1",
    ]
    ckpt = plan_json(capsys, *argv, "--checkpoint-activations")
    assert ckpt["fits"] and 24 < ckpt["per_rank_gb"] < 32  # fits, with little to spare
    # 16 bytes per parameter (fp32 shard, gradient, Adam's two moments) over 8 ranks: 24 GiB of 32
    assert ckpt["components"]["parameters"] + ckpt["components"]["optimizer_state"] == pytest.approx(
        12 * 12_853_463_040 / 8 / GB, abs=0.01
    )
    plain = plan_json(capsys, *argv)
    assert not plain["fits"] and plain["recommended"] == "--checkpoint-activations"
    assert not plan_json(capsys, *argv[:-1], "4", "--checkpoint-activations", "--distributed-world-size", "4")["fits"]


def test_fairseq_readme_13b_on_one_v100_needs_cpu_offload_and_256gb_host(capsys):
    argv = GPT3_13 + ["--checkpoint-activations", "--batch-size", "8", "--device-memory-gb", "32"]
    one = plan_json(capsys, *argv, "--host-memory-gb", "256")
    assert not one["fits"] and one["recommended"] == "--cpu-offload"
    offload = plan_json(capsys, *argv, "--host-memory-gb", "256", "--cpu-offload")
    assert offload["fits"] and 180 < offload["host_gb"] <= 256  # "about 256 GB of system RAM"
    assert plan_json(capsys, *argv, "--host-memory-gb", "128")["recommended"] is None  # nothing fits


def test_fsdp_paper_175b_on_128_a100s_full_shard_checkpointing_bf16(capsys):
    """FSDP paper (Zhao et al., 2023): GPT-175B on 128 x 80 GB A100, full sharding, checkpointing, bf16."""
    argv = [
        "--task",
        "dummy_lm",
        "--dict-size",
        "50272",
        "--arch",
        "transformer_lm_gpt3_175",
        "--tokens-per-sample",
        "2048",
        "--batch-size",
        "1",
        "--bf16",
        "--device-memory-gb",
        "80",
        "--host-memory-gb",
        "1024",
    ]
    fsdp = plan_json(capsys, *argv, "--ddp-backend", "fully_sharded", "--distributed-world-size", "128")
    assert not fsdp["fits"] and fsdp["recommended"] == "--checkpoint-activations"
    assert fsdp["candidates"][0]["flags"] == "--no-reshard-after-forward" and not fsdp["candidates"][0]["fits"]
    ddp = plan_json(capsys, *argv, "--distributed-world-size", "128")
    assert ddp["per_rank_gb"] > 2000 and ddp["recommended"] == "--ddp-backend fully_sharded --checkpoint-activations"
    eight = plan_json(capsys, *argv, "--ddp-backend", "fully_sharded", "--distributed-world-size", "8")
    assert eight["recommended"] is None  # 2.8 TB of states: not on one host of 1 TB


def test_planning_other_gpus_does_not_judge_their_host_by_this_ones_ram(capsys, monkeypatch):
    """--device-memory-gb plans a machine `plan` cannot see: without --host-memory-gb its host
    memory is reported, not checked against this machine's RAM (the 13B's offloaded states
    need ~230 GB on the GPUs' host, more than a laptop or CI runner has)."""
    import trainer.host

    argv = GPT3_13 + [
        "--distributed-world-size",
        "8",
        "--device-memory-gb",
        "80",
        "--batch-size",
        "1",
        "--checkpoint-activations",
        "--cpu-offload",
    ]
    answers = []
    for ram_here in (16.0, 4096.0):
        monkeypatch.setattr(trainer.host, "host_memory_gb", lambda ram_here=ram_here: ram_here)
        answers.append(plan_json(capsys, *argv))
    assert answers[0] == answers[1]  # the same answer whatever this host has
    p = answers[0]
    assert p["fits"] and p["host_gb"] > 200 and p["host_memory_gb"] is None and not p["host_memory_checked"]
    assert cli.plan_main(argv) == 0
    assert "host memory per host" in (text := capsys.readouterr().out) and "not checked" in text
    given = plan_json(capsys, *argv, "--host-memory-gb", "128")  # given, it is checked
    assert not given["fits"] and given["host_memory_checked"]


LLAMA_8B_ON_8_H100 = [
    "--device-memory-gb",
    "80",
    "--distributed-world-size",
    "8",
    "--bf16",
    "--ddp-backend",
    "fully_sharded",
    "--tokens-per-sample",
    "8192",
    "--batch-size",
    "1",
]


def test_plan_answers_for_the_published_llama_shapes_with_their_vocabularies(capsys):
    """Without DATA, a Llama-family preset plans with its published vocabulary and says so;
    the parameter counts are the published checkpoints' (Llama 3.1 8B: 8,030,261,248;
    Qwen3-8B: 8.19 B with 151,936 tokens; Llama 3.1 70B: 70.55 B)."""
    p = plan_json(capsys, "--arch", "llama3_1_8b", *LLAMA_8B_ON_8_H100)
    assert (p["params"], p["vocab"]) == (8_030_261_248, 128256) and "published" in p["vocab_source"]
    assert p["fits"] and p["recommended"] is not None
    q = plan_json(capsys, "--arch", "qwen3_8b", *LLAMA_8B_ON_8_H100)
    assert (q["params"], q["vocab"]) == (8_190_735_360, 151936)
    # 70 B on one host of 8 x 80 GB: 16 bytes a parameter over 8 ranks is 141 GB; only --cpu-offload fits
    big = plan_json(capsys, "--arch", "llama3_1_70b", *LLAMA_8B_ON_8_H100)
    assert big["params"] == 70_553_706_496 and not big["fits"] and "--cpu-offload" in big["recommended"]
    assert cli.plan_main(["--arch", "llama3_1_8b", *LLAMA_8B_ON_8_H100]) == 0
    assert "vocabulary 128256: llama3_1_8b's published vocabulary (no DATA given)" in capsys.readouterr().out
    # DATA's (here dummy_lm's) vocabulary wins over the published one
    dummy = plan_json(
        capsys, "--arch", "llama3_1_8b", "--task", "dummy_lm", "--dict-size", "32000", *LLAMA_8B_ON_8_H100
    )
    assert (dummy["vocab"], dummy["vocab_source"]) == (32000, None)
