"""What a rank that computes on the CPU sets up before it builds anything: its share of
the host's cores, and the caching host allocator (trainer/cpu/host_allocator.py)."""

import logging
import os

import torch

from trainer.cpu import host_allocator

log = logging.getLogger("shardlm")


def prepare_cpu_rank(cfg, rdv):
    if cfg.common.host_allocator == "caching":
        try:
            host_allocator.install()
        except host_allocator.Unavailable as e:
            if rdv.rank == 0:
                log.warning("--host-allocator caching is not available (%s): using glibc's", e)
    if rdv.local_world_size > 1:
        # Ranks on one host share its cores; without a split they fight over them.
        torch.set_num_threads(max(cpu_count() // rdv.local_world_size, 1))


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
