"""`plan`'s policy: the machine to plan for, from plan's own options (PlanConfig in
trainer/config/commands.py) and this host, then the report of the plan."""

import json

from trainer.config.checks import check_config
from trainer.config.schema import model_positions, uses_fsdp
from trainer.errors import UsageError
from trainer.host import host_memory_gb, runs_on_gpu
from trainer.plan import report, serve
from trainer.plan.search import apply_hf_config, model_shape, published_vocab, vocab_size


def plan_report(cfg, opts):
    """The plan of the composed train config `cfg` on the machine `opts` describes, as
    text or (--format json) one JSON object."""
    # The vocabulary, when it is not DATA's: the HF model's, or a Llama-family preset's published one.
    vocab = apply_hf_config(cfg, opts.path) if opts.path else published_vocab(cfg)
    dist_cfg = cfg.distributed_training
    if dist_cfg.auto_tune or dist_cfg.memory_budget_gb is not None:
        # Checked before check_config, whose message for a lone budget would send the user to `plan`.
        raise UsageError(
            "plan always picks the flags that fit; --auto-tune and --memory-budget-gb are "
            "train's, so drop them here and give --device-memory-gb / --host-memory-gb"
        )
    check_planned_config(cfg)
    device, device_gb, host_gb, ranks_per_host = planned_machine(cfg, opts)
    if opts.serve:
        return serve_report(cfg, opts, vocab, device, device_gb)
    plan = report.make_plan(cfg, device, device_gb, host_gb, ranks_per_host, vocab, opts.path)
    return report.as_json(plan) if opts.format == "json" else report.as_text(cfg, plan)


def check_planned_config(cfg):
    """train's checks of the config, and what the planner's model of context parallelism
    assumes: FSDP's states sharded over the data × context ranks."""
    cp = cfg.common.context_parallel_size
    if cp > 1 and not uses_fsdp(cfg):
        raise UsageError(
            f"plan --context-parallel-size {cp}: plan models it with --ddp-backend fully_sharded or hybrid_shard"
        )
    check_config(cfg)


def planned_machine(cfg, opts):
    """(device, one device's memory, one host's memory or None, ranks per host): GPUs when
    --device-memory-gb is given without --cpu, else this host's CPU."""
    world = cfg.distributed_training.distributed_world_size
    device = "cuda" if opts.device_memory_gb and not cfg.common.cpu else "cpu"
    if device == "cpu" and runs_on_gpu(cfg):
        raise UsageError("this host has a GPU: give its memory with --device-memory-gb, or --cpu to plan for the CPU")
    if opts.ranks_per_host and opts.ranks_per_host > world:
        raise UsageError(
            f"--ranks-per-host {opts.ranks_per_host} exceeds the job's {world} rank(s); "
            "lower it or raise --distributed-world-size"
        )
    ranks_per_host = opts.ranks_per_host or (world if device == "cpu" else min(world, 8))
    # --device-memory-gb plans a machine this command cannot see: its host memory is not
    # this machine's RAM, so without --host-memory-gb it goes unchecked (host_gb None).
    host_gb = opts.host_memory_gb or (None if opts.device_memory_gb else host_memory_gb())
    if host_gb is None and not opts.device_memory_gb:
        raise UsageError("cannot read this host's memory: give --host-memory-gb")
    # A CPU rank's memory is its share of the host's, unless --device-memory-gb says otherwise.
    device_gb = opts.device_memory_gb if device == "cuda" else (opts.device_memory_gb or host_gb / ranks_per_host)
    return device, device_gb, host_gb, ranks_per_host


def serve_report(cfg, opts, vocab, device, device_gb):
    """--serve: `serve` of this model over --distributed-world-size ranks, --max-batch rows."""
    size = vocab[0] if vocab else vocab_size(cfg)
    world = cfg.distributed_training.distributed_world_size
    half = cfg.common.fp16 or cfg.common.bf16  # serve's --fp16 / --bf16, spelled as train's
    elem = 2 if half else serve.SERVE_DTYPE_BYTES
    positions = min(opts.max_positions or model_positions(cfg), model_positions(cfg))
    setup = serve.ServeSetup(device, world, opts.max_batch, positions, elem)
    plan = serve.serve_plan(model_shape(cfg, size), setup, device_gb)
    return json.dumps(plan) if opts.format == "json" else serve.as_text(plan)
