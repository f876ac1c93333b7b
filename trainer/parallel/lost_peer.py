"""What a failed collective means: another rank died or hangs, said as one line that
names it, instead of gloo's or NCCL's message deep in a traceback."""

import re

from trainer.errors import RankStopped, resume_hint
from trainer.parallel.ranks import collective_timeout

# What gloo says when the other end of a collective died (the kernel closed its sockets)
# or stopped answering for longer than the collective timeout, and what NCCL says when its
# peer exited or its connection broke (ncclRemoteError; "Connection closed by remote peer"
# under an older ncclInternalError). A bare ncclSystemError is not among them: it is also
# this host's own fault (a full /dev/shm), said in its own message.
CLOSED = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Connection closed by remote peer",
    "Broken pipe",
    "Connection refused",
    "ncclRemoteError",
    "remote process exited",
)
TIMED_OUT = ("Timed out", "timed out", "timeout", "Timeout")  # NCCL: "Watchdog caught collective operation timeout"
# NCCL's watchdog aborted this rank's communicators (TORCH_NCCL_ASYNC_ERROR_HANDLING=2,
# trainer/parallel/ranks.py) and the next collective raised this, its reason lost.
ABORTED = ("NCCL communicator was aborted",)


def peer_lost(error, cfg, env):
    """A RankStopped naming the lost rank when `error` is a collective failing because
    another rank died or hangs; None for any other error."""
    collective_error = (
        isinstance(error, (RuntimeError, OSError)) or type(error).__name__ == "CheckpointException"
    )  # DCP wraps a failed save or load in it
    if env.world_size < 2 or not collective_error:
        return None
    text, hint = str(error), resume_hint(cfg, "train")
    peer = f"rank {1 - env.rank}" if env.world_size == 2 else "a peer rank"
    address = re.search(r"\[([^\]]+)\]:(\d+)", text) or re.search(r"([\w.:-]+)<(\d+)>", text)  # gloo's, NCCL's
    at = f" at {address.group(1)}" if address and env.world_size > 2 else ""
    if any(m in text for m in CLOSED):
        return RankStopped(f"lost {peer}{at}: its connection closed (the process died or was killed); {hint}")
    if any(m in text for m in TIMED_OUT):
        seconds = collective_timeout(cfg).total_seconds()
        return RankStopped(
            f"{peer}{at} did not answer for {seconds:g} s (--heartbeat-timeout): it died or hangs; {hint}"
        )
    if any(m in text for m in ABORTED):
        return RankStopped(
            f"lost {peer}: NCCL aborted the collectives on this rank (a rank died or hangs, or the network "
            f"failed; NCCL's lines above say which); {hint}"
        )
    return None
