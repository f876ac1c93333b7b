"""Log records in fairseq's formats (json, simple, tqdm, none), plus TensorBoard and
Weights & Biases.

Tags: `train_inner` every --log-interval updates, `train` per epoch (keys prefixed
`train_`), `valid` (prefixed `valid_`). A json record is one line whose JSON object runs
from the first `{` to the end of the line. TensorBoard gets one directory per tag, W&B
keys `tag/key` (fairseq's), both at step num_updates; only rank 0 writes either.
"""

import json
import logging
import os
import socket
import sys
import urllib.request
from urllib.parse import urlsplit

from omegaconf import OmegaConf

log = logging.getLogger("shardlm")
LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"


def setup_logging(log_file=None, is_master=True):
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
    if log_file and is_master:
        fh = logging.FileHandler(log_file)
        fh.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        root.addHandler(fh)
    # Only rank 0 writes records; the other ranks keep warnings and errors.
    root.setLevel(logging.INFO if is_master else logging.WARNING)


def resolve_format(common):
    fmt = common.log_format or ("simple" if common.no_progress_bar else "tqdm")
    if fmt == "tqdm" and not sys.stderr.isatty():
        fmt = "simple"  # fairseq's fallback: a bar is noise in a log file
    return fmt


class Progress:
    def __init__(self, cfg, is_master=True):
        self.fmt = resolve_format(cfg.common) if is_master else "none"
        self.writers = {}
        self.tb_dir = cfg.common.tensorboard_logdir if is_master else None
        self.bar = None
        self.wandb = start_wandb(cfg) if is_master and cfg.common.wandb_project else None

    def epoch_bar(self, iterable, epoch, total):
        """Wrap an epoch's batches: a tqdm bar in tqdm format, pass-through otherwise."""
        self.epoch, self.total = epoch, total
        if self.fmt != "tqdm":
            return iterable
        from tqdm import tqdm

        self.bar = tqdm(iterable, total=total, desc=f"epoch {epoch:03d}", leave=False, file=sys.stderr)
        return self.bar

    def log(self, tag, stats, step, num_updates, epoch, position=None):
        """Write one record: stats without prefix; the tag decides the prefix."""
        prefix = "" if tag == "train_inner" else tag + "_"
        record = {prefix + k: v for k, v in stats.items()}
        self._tensorboard(tag, stats, num_updates)
        if self.wandb is not None:
            self.wandb.log(
                {f"{tag}/{k}": v for k, v in stats.items() if isinstance(v, (int, float)) and k != "num_updates"},
                step=num_updates,
            )
        if self.fmt == "none":
            return
        logger = logging.getLogger(tag)
        if self.fmt == "json":
            head = {"epoch": epoch}
            if tag == "train_inner" and position is not None:
                head["update"] = round(epoch - 1 + position, 3)
            logger.info(json.dumps({**head, **record}))
            return
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        if tag == "train_inner":
            where = f"epoch {epoch:03d}: {step:6d} / {self.total} " if position is not None else ""
            if self.bar is not None:
                self.bar.set_postfix_str(body, refresh=False)
            logger.info(f"{where}{body}")
        else:
            logger.info(f"epoch {epoch:03d} | " + " | ".join(f"{k} {_fmt(v)}" for k, v in record.items()))

    def _tensorboard(self, tag, stats, num_updates):
        if not self.tb_dir:
            return
        if tag not in self.writers:
            from torch.utils.tensorboard import SummaryWriter  # a slow import: only when asked for

            self.writers[tag] = SummaryWriter(os.path.join(self.tb_dir, tag))
        for k, v in stats.items():
            if isinstance(v, (int, float)) and k != "num_updates":
                self.writers[tag].add_scalar(k, v, num_updates)
        self.writers[tag].flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        for w in self.writers.values():
            w.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def start_wandb(cfg):
    """fairseq's W&B run: --wandb-project, named $WANDB_NAME or after --save-dir, with the
    config. Unless $WANDB_MODE says otherwise, a run that cannot reach W&B (no network, a
    compute node, no `wandb login`) logs offline rather than failing the job at its start:
    `wandb sync` uploads it later."""
    import wandb  # a slow import: only rank 0 of a run that asked for it pays it

    save_dir = os.path.basename(os.path.normpath(cfg.checkpoint.save_dir))
    kwargs = dict(
        project=cfg.common.wandb_project,
        name=os.environ.get("WANDB_NAME", save_dir),
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    if os.environ.get("WANDB_MODE"):
        return wandb.init(**kwargs)
    api = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if not _reachable(api):
        log.warning(f"W&B: {api} cannot be reached: logging offline (`wandb sync` uploads it later)")
        return wandb.init(mode="offline", **kwargs)
    try:
        return wandb.init(**kwargs)
    except wandb.errors.Error as e:  # no API key, refused key, a timeout
        why = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
        log.warning(f"W&B: {why}: logging offline (`wandb sync` uploads it later)")
        return wandb.init(mode="offline", **kwargs)


def _reachable(url, timeout=5.0):
    """A TCP connection opens to the host of `url`, or to the proxy that would carry it."""
    u = urlsplit(url)
    proxy = urllib.request.getproxies().get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(u.hostname or ""):
        u = urlsplit(proxy if "://" in proxy else "http://" + proxy)
    if not u.hostname:
        return False
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:  # no such host, refused, timed out
        return False


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) and not v.is_integer() and abs(v) < 1e-2 else str(v)
