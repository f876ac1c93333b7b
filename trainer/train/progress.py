"""Log records in fairseq's formats (json, simple, tqdm, none), plus TensorBoard.

Tags: `train_inner` every --log-interval updates, `train` per epoch (keys prefixed
`train_`), `valid` (prefixed `valid_`). A json record is one line whose JSON object runs
from the first `{` to the end of the line.
"""
import json
import logging
import os
import sys

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


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) and not v.is_integer() and abs(v) < 1e-2 else str(v)
