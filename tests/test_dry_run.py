"""`train --dry-run` and the fake GPUs under it (trainer/dryrun/): the seed's command lines
and the tensor-parallel layouts (--model-parallel-size with FSDP and HSDP), at world sizes 8
and 16 (2 nodes x 8), run their rank 0 and last rank through init_rank,
build and train_step on fake CUDA devices with every collective and CUDA call checked; what a
GPU would refuse fails here, and what cannot run is refused in one line."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_sft_dpo import chat, dpo_argv, sft_argv  # noqa: F401 (chat: the module's fixture)

from helpers import DUMMY, compose
from trainer.dryrun.command import collective_mismatch, command_job, job_of, rank_reports, tp_groups_across_nodes

BASE = DUMMY + ["--batch-size", "2", "--dry-run"]
IPQ_CONFIG = Path(__file__).parent / "fixtures" / "ipq" / "small_config.yaml"
FSDP = ["--ddp-backend", "fully_sharded"]
TINY_LLAMA = ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-attention-heads", "4"]
TINY_LLAMA += ["--decoder-kv-heads", "2", "--decoder-ffn-embed-dim", "128"]
# grouped-query attention with whole key/value heads on each of 4 tensor-parallel ranks
TP_LLAMA = ["--decoder-layers", "2", "--decoder-embed-dim", "64", "--decoder-attention-heads", "8"]
TP_LLAMA += ["--decoder-kv-heads", "4", "--decoder-ffn-embed-dim", "128"]
# --model-parallel-size rows (tensor parallelism composed with FSDP / HSDP), at 16 ranks on 2
# nodes: each row's tensor-parallel size
TP = {
    # FSDP 4 x TP 4, fp32; llama3_2_1b ties its output projection to the embedding
    "tp4_fully_sharded": (FSDP + ["--arch", "llama3_2_1b", "--model-parallel-size", "4"] + TP_LLAMA, 4),
    # HSDP 2 x 2 x TP 4 (a 3-D mesh); llama3_1_8b's own output projection: VocabRows; 2 key/value
    # heads, each gathered from the 2 ranks that hold half its rows
    "tp4_hybrid_shard": (
        ["--ddp-backend", "hybrid_shard", "--shard-group-size", "8", "--arch", "llama3_1_8b", "--bf16"]
        + ["--model-parallel-size", "4"]
        + TP_LLAMA
        + ["--decoder-kv-heads", "2"],
        4,
    ),
    # fairseq's FSDP line: optimizer states and the step on the host, GradScaler over DTensors
    "tp2_fp16_cpu_offload": (
        FSDP
        + ["--arch", "llama3_2_1b", "--fp16", "--cpu-offload", "--checkpoint-activations"]
        + ["--model-parallel-size", "2"]
        + TP_LLAMA,
        2,
    ),
    # dropout on sequence shards: DTensor's random op, whose kernel is CUDA's only; qk-norm per
    # head; a layer's input (a DTensor) offloaded to pinned host memory, which only a GPU does
    "tp2_bf16_dropout_offload_activations": (
        FSDP
        + ["--arch", "qwen3_0_6b", "--decoder-head-dim", "16", "--bf16", "--model-parallel-size", "2"]
        + ["--dropout", "0.1", "--attention-dropout", "0.1", "--offload-activations"]
        + TP_LLAMA,
        2,
    ),
    # Muon's owners take whole matrices from the 16 ranks that split them (rows, columns, runs);
    # an odd vocabulary (321 rows: 161 and 160 a TP rank) over 8 FSDP ranks is sharded by
    # columns (FSDP2's uneven row cut and DTensor's offsets disagree on the last ranks' rows)
    "tp2_muon_odd_vocabulary": (
        FSDP
        + ["--arch", "llama3_2_1b", "--model-parallel-size", "2", "--optimizer", "muon", "--dict-size", "321"]
        + TP_LLAMA,
        2,
    ),
    # context parallelism: each rank a quarter of every sequence, keys and values gathered
    "cp4_tp2_bf16": (
        FSDP
        + ["--arch", "llama3_2_1b", "--bf16", "--context-parallel-size", "4", "--model-parallel-size", "2"]
        + TP_LLAMA,
        2,
    ),
}
# name: (flags, world size); each row one update of a tiny model on rank 0 and the last rank
GRID = {
    "fully_sharded": (FSDP, 8),
    "hybrid_shard": (["--ddp-backend", "hybrid_shard"], 16),
    "pytorch_ddp": (["--ddp-backend", "pytorch_ddp"], 8),
    "fp16": (FSDP + ["--fp16"], 8),
    "bf16": (FSDP + ["--bf16"], 8),
    "memory_efficient_fp16": (FSDP + ["--memory-efficient-fp16"], 8),
    "fp16_cpu_offload_adam": (FSDP + ["--fp16", "--cpu-offload"], 16),
    "cpu_offload_cpu_adam": (FSDP + ["--cpu-offload", "--optimizer", "cpu_adam"], 8),
    # two FSDP flags a row: each changes what another row's does not
    "checkpoint_activations_update_freq_4": (FSDP + ["--checkpoint-activations", "--update-freq", "4"], 8),
    "offload_activations_no_reshard_after_forward": (
        FSDP + ["--offload-activations", "--no-reshard-after-forward"],
        8,
    ),
    "adafactor": (FSDP + ["--optimizer", "adafactor", "--lr", "0.001"], 8),
    "lamb": (FSDP + ["--optimizer", "lamb"], 8),
    # 16 ranks share fewer matrices than ranks: the last owns none (Muon's exchange)
    "muon": (FSDP + ["--optimizer", "muon", "--lr", "0.01"], 16),
    "llama": (FSDP + ["--arch", "llama3_2_1b"] + TINY_LLAMA, 8),
    "qwen3": (FSDP + ["--arch", "qwen3_0_6b", "--decoder-head-dim", "16"] + TINY_LLAMA, 8),
    # a mixture of experts in bf16: its experts split over 4 ranks (all-to-all, the split sizes
    # read on the host), one grouped matmul per expert group (CUDA's torch._grouped_mm); the
    # rest split by TP 2, whose ranks route their own positions (the routers on every rank's mesh)
    "moe_tp2_ep4_bf16": (
        FSDP
        + ["--arch", "qwen3_moe_30b_a3b", "--decoder-head-dim", "16", "--bf16", "--moe-expert-count", "8"]
        + ["--moe-top-k", "2", "--moe-ffn-embed-dim", "32", "--expert-parallel-size", "4", "--model-parallel-size", "2"]
        + TINY_LLAMA,
        16,
    ),
    # fairseq's FSDP line on a mixture with auxiliary-loss-free balancing: its biases on the
    # GPU while the parameters live on the host; one matmul per expert (fp16 is not grouped),
    # an expert rank that fake reads leave without tokens still reduce-scattering its experts
    "moe_ep4_fp16_cpu_offload": (
        FSDP
        + ["--arch", "qwen3_moe_30b_a3b", "--decoder-head-dim", "16", "--fp16", "--cpu-offload"]
        + ["--moe-expert-count", "8", "--moe-top-k", "2", "--moe-ffn-embed-dim", "32", "--expert-parallel-size", "4"]
        + ["--moe-router-bias-update-rate", "0.01"]
        + TINY_LLAMA,
        16,
    ),
    # fairseq's iPQ: its first stage (the feed-forwards) gathered, rank 0's centroids sent to
    # every rank, the model sharded again, a new fp16 optimizer, and an update after it
    "ipq_fp16": (FSDP + ["--fp16", "--quantization-config-path", str(IPQ_CONFIG), "--max-update", "3"], 8),
    **{name: (flags, 16) for name, (flags, _) in TP.items()},
}


def jobs_of(argv, world):
    cfg = compose(argv + ["--distributed-world-size", str(world)])
    return [job_of(cfg, rank) for rank in sorted({0, world - 1})]


@pytest.fixture(scope="module")
def grid(chat):  # noqa: F811
    """{row: [rank 0's report, the last rank's]}, every row's jobs in one run."""
    root, _ = chat
    rows = {name: jobs_of(BASE + flags, world) for name, (flags, world) in GRID.items()}
    rows["sft"] = jobs_of(sft_argv(root, "llama", *FSDP, "--dry-run", batch_size=1), 8)
    rows["dpo"] = jobs_of(dpo_argv(root, "qwen3", *FSDP, "--bf16", "--dry-run", batch_size=1), 8)
    # a mixture's batches come from its own iterator (data/mixture_batches.py), made fake as DATA's
    sources = ["--data-mixture", "0.5", str(root / "llama-sft"), "0.5", str(root / "qwen3-sft")]
    rows["sft_mixture"] = jobs_of(sft_argv(root, "llama", *FSDP, "--dry-run", *sources, batch_size=1)[1:], 8)
    model, data = str(root / "llama"), str(root / "llama-sft")
    eval_lm = [data, "--path", model, "--gen-subset", "train", "--batch-size", "2"]
    rows["eval-lm"] = [command_job("eval-lm", eval_lm, 8, rank) for rank in (0, 7)]
    generate = ["--path", model, "--prompt", "the fox", "--max-new-tokens", "3"]
    rows["generate"] = [command_job("generate", generate, 1, 0)]
    rows["serve"] = [command_job("serve", ["--path", model, "--max-positions", "64"], 1, 0)]
    reports = iter(rank_reports([job for jobs in rows.values() for job in jobs]))
    return {name: [next(reports) for _ in jobs] for name, jobs in rows.items()}


@pytest.mark.parametrize("row", [*GRID, "sft", "dpo", "sft_mixture"])
def test_the_seed_command_lines_run_on_fake_gpus(grid, row):
    reports = grid[row]
    for r in reports:
        assert "failure" not in r and "usage_error" not in r, r.get("traceback") or r.get("usage_error")
        # each rank on its own GPU of its node, its NCCL group with a gloo side for host tensors
        assert r["device"] == f"cuda:{r['local_rank']}" and r["node_gpus"] == list(range(len(r["node_gpus"])))
        assert r["groups"][0] == ["default", "cuda:nccl,cpu:gloo", None]
        assert r["update_collectives"] > 0 and r["peak_bytes"] > 0
        assert r["batches_pinned"] and r["pageable_copies"] <= r["pinned_copies"]
        assert "set_device" in r["cuda_calls"]
    # the same collectives, in the same order, of the same dtypes, on the same device types
    assert collective_mismatch(reports) is None


@pytest.mark.parametrize("row", TP)
def test_tensor_parallel_layouts_keep_their_groups_on_a_node_and_read_nothing_more(grid, row):
    """Under --model-parallel-size N a rank's tensor-parallel group (the mesh's "tp" dimension)
    is N consecutive ranks of its own node, and its batches are shared with the ranks of the
    same place in the other groups (new_subgroups_by_enumeration); the vocabulary-parallel
    loss all-reduces its max and sum on the GPU; an update reads no more values on the host
    (each waits for the GPU) than the same update without tensor parallelism."""
    n, gpus = TP[row][1], 8
    for r in grid[row]:
        rank = r["rank"]
        groups = {how: ranks for how, _, ranks in r["groups"]}
        first = rank - rank % n
        assert groups["mesh_tp"] == list(range(first, first + n))
        assert {g // gpus for g in groups["mesh_tp"]} == {rank // gpus}
        batches = [g for how, _, g in r["groups"] if how == "new_group" and g and len(g) == 16 // n]
        assert batches == [list(range(rank % n, 16, n))]
        # the max and sums of each update's vocabulary shards, on the tensor-parallel group only
        loss = [c[3] for c in r["collectives"] if c[:3] == ["c10d::allreduce_", "cuda", "float32"]]
        assert len(loss) >= 4 and set(loss) == {"mesh_tp"}
        same = "muon" if "muon" in row else "llama"  # Muon's step reads its found_inf on the host
        assert r["host_reads"] == grid[same][0]["host_reads"], (r["host_reads"], grid[same][0]["host_reads"])


def test_the_dry_run_counts_tensor_parallel_groups_that_cross_nodes():
    assert tp_groups_across_nodes(16, 4, 8) == 0 and tp_groups_across_nodes(16, 8, 8) == 0
    assert tp_groups_across_nodes(16, 16, 8) == 1  # one group over both nodes
    assert tp_groups_across_nodes(24, 6, 8) == 2  # ranks 6-11 and 12-17
    assert tp_groups_across_nodes(8, 2, 1) == 4  # one GPU per node: every group


OFFLOADED_DTENSOR = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint
from trainer.parallel.parallelize import save_on_host

empty = torch.empty
torch.empty = lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs)  # no GPU here to pin for
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
x0, w0 = torch.randn(2, 8, 4), torch.randn(4, 4)


def update(offload):
    x = distribute_tensor(x0, mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(w0, mesh, [Replicate()]).requires_grad_()
    with save_on_host() if offload else torch.enable_grad():
        y = checkpoint(lambda x, w: torch.tanh(x @ w).pow(2).sum(), x, w, use_reentrant=False) + (x * x).sum()
    y.backward()
    return [t.full_tensor() for t in (y, x.grad, w.grad)]


print(all(torch.equal(a, b) for a, b in zip(update(False), update(True))))
"""


def test_offloaded_activations_of_a_dtensor_come_back_as_they_were():
    """--offload-activations under tensor parallelism (found by the dry run: torch's
    save_on_cpu refuses a DTensor, and only a GPU rank offloads): a layer's input, a sequence
    shard, goes to host memory and comes back with the same values and the same gradients."""
    done = subprocess.run([sys.executable, "-c", OFFLOADED_DTENSOR], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


@pytest.mark.parametrize("command", ["eval-lm", "generate", "serve"])
def test_the_inference_commands_run_their_forward_on_fake_gpus(grid, command):
    for r in grid[command]:
        assert "failure" not in r and "usage_error" not in r, r.get("traceback") or r.get("usage_error")
        assert r["device"] == f"cuda:{r['local_rank']}"
    assert {
        "eval-lm": "Loss (base 2)",
        "generate": "",
        "serve": "prompt tokens, generated 2 (length)",
    }[command] in grid[command][0]["printed"]


def run_fake(body):
    """`body` in a fresh process over 8 fake GPUs (loaded before torch); its stdout."""
    script = "from trainer.dryrun.fake_cuda import load_fake_cuda\nload_fake_cuda(8)\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_nccl_only_group_refuses_the_cpu_found_inf_of_fp16_with_cpu_offload():
    """Defect 1 of issue 47: GradScaler's unscale all-reduces a host found_inf under
    --cpu-offload; the group made as plain "nccl" has no CPU side and fails, as on 2+ GPUs."""
    cfg = compose(BASE + FSDP + ["--fp16", "--cpu-offload", "--distributed-world-size", "8"])
    out = run_fake(
        f"""
        import json
        import trainer.parallel.ranks as ranks
        from trainer.dryrun.dry_rank import run_job
        job = json.loads({json.dumps(json.dumps(job_of(cfg, 3)))})
        print(json.dumps(run_job(job)))
        ranks.process_group_backend = lambda device: "nccl" if device.type == "cuda" else "gloo"
        print(json.dumps(run_job(job)))
        """
    )
    fixed, nccl_only = (json.loads(line) for line in out.splitlines()[-2:])
    assert "failure" not in fixed, fixed.get("traceback")
    assert "all_reduce of a cpu tensor on a group with backends for ['cuda'] only" in nccl_only["failure"]


def test_the_fake_gpus_refuse_what_a_gpu_refuses():
    out = run_fake(
        """
        import torch, torch.distributed as dist
        from trainer.dryrun.device_checks import FakeDevices
        from trainer.dryrun.fake_cuda import CudaMisuse, CudaStandIn
        from trainer.dryrun.fake_groups import FakeGroups

        cuda = CudaStandIn(8)
        cuda.patch()
        FakeGroups(cuda).patch()

        def refused(fn):
            try:
                fn()
            except CudaMisuse as e:
                return str(e)
            return "ran"

        print(refused(lambda: dist.init_process_group("nccl", rank=3, world_size=8)))
        print(refused(lambda: cuda.set_device(8)))
        cuda.set_device(3)
        dist.init_process_group("cuda:nccl,cpu:gloo", rank=3, world_size=8)
        with FakeDevices() as fake:
            fake.rank_device = torch.device("cuda", 3)
            mine, other, host = torch.ones(4, device="cuda:3"), torch.ones(4, device="cuda:0"), torch.ones(4)
            print(refused(lambda: dist.all_to_all_single(mine, host)))
            print(refused(lambda: dist.all_reduce(other)))
            print(refused(lambda: host.to("cuda:0", non_blocking=True)))
            event = torch.cuda.Event()
            print(refused(lambda: event.record(torch.cuda.Stream(device=0))))
            dist.all_reduce(mine)
            host.to("cuda:3", non_blocking=True)
            torch.empty(4, pin_memory=True).to("cuda:3", non_blocking=True)
            print(fake.collectives, fake.copies)
        """
    )
    lines = out.splitlines()
    assert "before torch.cuda.set_device" in lines[0]
    assert "invalid device ordinal 8" in lines[1]
    assert "tensors on ['cpu', 'cuda:3']: one collective, one device" in lines[2]
    assert "of a tensor on cuda:0 from the rank of cuda:3" in lines[3]
    assert "a copy to cuda:0 from the rank of cuda:3" in lines[4]
    assert "recorded on a stream of cuda:0 while the current device is cuda:3" in lines[5]
    assert lines[6] == "[('c10d::allreduce_', 'cuda', 'float32', 'default_pg')] [(False, 'cuda:3'), (True, 'cuda:3')]"


def run_dry(*argv):
    return subprocess.run(
        [sys.executable, "-c", "import sys, cli; sys.exit(cli.train_main(sys.argv[1:]))", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_dry_run_prints_each_rank_and_a_last_line():
    done = run_dry(*BASE, *FSDP, "--bf16", "--checkpoint-activations", "--compile", "--distributed-world-size", "16")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "--compile: not checked; the layers ran uncompiled" in lines[-2]
    assert lines[1].startswith("rank 0 (node 0, local rank 0 of 8, cuda:0)")
    assert lines[2].startswith("rank 15 (node 1, local rank 7 of 8, cuda:7)")
    assert lines[-1].startswith("dry run: ok, 16 rank(s) on 2 node(s) x 8 GPUs") and "plan predicts" in lines[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cpu"], "--dry-run checks a GPU job on fake GPUs; drop --cpu"),
        (["--dry-run-gpus-per-node", "0"], "--dry-run-gpus-per-node must be at least 1"),
        (["--cpu-offload"], "--cpu-offload"),  # FSDP's flag under pytorch_ddp: refused as without --dry-run
    ],
)
def test_a_command_line_that_cannot_run_is_refused_in_one_line(flags, message):
    done = run_dry(*BASE, "--distributed-world-size", "8", *flags)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout
