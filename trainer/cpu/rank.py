"""What a rank that computes on the CPU sets up before it builds anything: the caching host
allocator (trainer/cpu/host_allocator.py). Its share of the host's cores, which a GPU rank
under --cpu-offload needs too, is trainer/parallel/ranks.py's."""

import logging

from trainer.cpu import host_allocator

log = logging.getLogger("shardlm")


def prepare_cpu_rank(cfg, rdv):
    if cfg.common.host_allocator == "caching":
        try:
            host_allocator.install()
        except host_allocator.Unavailable as e:
            if rdv.rank == 0:
                log.warning("--host-allocator caching is not available (%s): using glibc's", e)
