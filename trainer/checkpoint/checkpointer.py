"""Save and restore everything a run needs to continue exactly where it stopped.

Tensors (model parameters and optimizer state) go through torch.distributed.checkpoint:
every rank writes its own shards in parallel and nobody gathers the model, and a
checkpoint loads into any number of ranks and any backend, because DCP records each
tensor's global shape and every rank reads just the slices it holds. Only tensors are
saved there (the optimizer's hyper-parameters come from the config), so loading never
unpickles anything; the rest is JSON: `trainer_state.json` and one `rng/rank{r}.json` per
rank. trainer_state.json holds the state of each piece of training registered with the
checkpointer (the trainer's update count and lr schedule, the loop's data position, meters
and best loss, the loss scaler, the checkpointer's own best metric), each under its name,
as the piece's `state_dict()` gives it: the checkpointer knows none of their fields.
fairseq's semantics: `trainer/checkpoint/files.py` names, publishes and prunes; the
tensors' checks and load: `tensors.py`; the random streams: `rng.py`.
"""

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from data.atomic_file import write_atomically
from data.tokenizer import TOKENIZER_FILES
from trainer.checkpoint import files
from trainer.checkpoint.foreign_weights import load_moments, load_rows
from trainer.checkpoint.rng import rng_state, set_rng_state
from trainer.checkpoint.tensors import (
    check_optimizer_name,
    check_optimizer_state,
    check_shapes,
    load_tensors,
    renumber_layers,
    saved_layer_ids,
    tensor_state,
)
from trainer.config.model_source import hf_finetune_dir
from trainer.errors import RankStopped, UsageError
from trainer.formats.hf.generation_config import generation_config, write_generation_config
from trainer.formats.registry import open_model
from trainer.formats.shardlm import checkpoint_dir
from trainer.parallel.ranks import all_reduce_sum
from trainer.parallel.tensor_parallel import row_orders

log = logging.getLogger("shardlm")
# 1: shardlm up to ebbae74, every piece's fields side by side; 2: one entry per named piece.
FORMAT_VERSION = 2


def write_json(path, obj):
    write_atomically(path, json.dumps(obj))


def read_trainer_state(path):
    """trainer_state.json of checkpoint `path`, with its pieces' states under "state"
    whatever the format it was written in."""
    state = json.loads((Path(path) / checkpoint_dir.STATE_FILE).read_text())
    reader = STATE_READERS.get(state.get("format"))
    if reader is None:
        raise UsageError(
            f"checkpoint {path} has format {state.get('format')}, this shardlm reads "
            f"{', '.join(map(str, STATE_READERS))}; use the shardlm version that wrote it"
        )
    return reader(state)


def _pieces_of_format_1(saved):
    """Format 1 kept the fields of every piece side by side: each goes to its piece."""
    return {
        **saved,
        "epoch": saved["iterator"]["epoch"],
        "state": {
            "trainer": {
                "num_updates": saved["num_updates"],
                "lr_updates_offset": saved.get("lr_updates_offset", 0),
                "lr_scheduler": saved.get("lr_scheduler"),
                "lr": saved.get("lr"),
            },
            "loop": {
                "iterator": saved["iterator"],
                "meters": saved["meters"],
                "best_valid_loss": saved.get("best_valid_loss"),
            },
            "checkpointer": {"best": saved.get("best")},
            "loss_scaler": saved.get("scaler"),
        },
    }


STATE_READERS = {1: _pieces_of_format_1, 2: lambda saved: saved}


class Checkpointer:
    """When to save, under which names, and how a run restores itself (fairseq's
    checkpoint_utils.save_checkpoint / load_checkpoint). The model's and optimizer's
    tensors go through DCP; every other piece of training state is registered (register)
    and saved and restored through its state_dict / load_state_dict."""

    def __init__(self, cfg, env, model, optimizer, data_dir=None, ema=None):
        """data_dir: the data directory whose tokenizer and metadata each checkpoint copies;
        ema: --store-ema's average (trainer/train/ema.py), saved and restored with the model."""
        self.cfg, self.checkpoint_cfg, self.env = cfg, cfg.checkpoint, env
        self.model, self.optimizer, self.data_dir, self.ema = model, optimizer, data_dir, ema
        self.row_orders = row_orders(getattr(model, "module", model))  # {} without tensor parallelism
        self.save_dir = Path(self.checkpoint_cfg.save_dir)
        self.pieces = {"checkpointer": self}  # name -> an object with state_dict / load_state_dict
        self.optimizer_pieces = set()  # saved and restored only with the optimizer's state
        self.best = None  # best value of --best-checkpoint-metric so far
        self.pending = None  # an asynchronous save in flight: (future, tmp, names, num_updates)
        self.group = None
        if self.checkpoint_cfg.save_async and dist.is_initialized() and not self.checkpoint_cfg.no_save:
            # The background write runs its own collectives: a separate group keeps them
            # from interleaving with training's.
            self.group = dist.new_group(backend="gloo")

    def follow(self, trainer):
        """The trainer's model, optimizer and loss scaler after iPQ replaced them
        (trainer/train/ipq.py): what the next save writes."""
        self.model, self.optimizer = trainer.model, trainer.optimizer
        if "loss_scaler" in self.pieces:
            self.pieces["loss_scaler"] = trainer.scaler

    def register(self, name, piece, with_optimizer=False):
        """Save and restore `piece` (state_dict / load_state_dict, JSON-able) under `name`;
        with_optimizer: only along with the optimizer's state (--no-save-optimizer-state,
        --reset-optimizer leave it out)."""
        self.pieces[name] = piece
        if with_optimizer:
            self.optimizer_pieces.add(name)

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        self.best = state.get("best")

    # ---------------------------------------------------------------- save
    def names(self, epoch, end_of_epoch, valid_metric, n):
        """Which checkpoints a save after update n writes, fairseq's conditions; the first is
        written, the others are hard links to it."""
        checkpoint_cfg = self.checkpoint_cfg
        names = []
        if end_of_epoch and not checkpoint_cfg.no_epoch_checkpoints and epoch % checkpoint_cfg.save_interval == 0:
            names.append(f"checkpoint{epoch}")
        if (
            not end_of_epoch
            and checkpoint_cfg.save_interval_updates > 0
            and n % checkpoint_cfg.save_interval_updates == 0
        ):
            names.append(f"checkpoint_{epoch}_{n}")
        if valid_metric is not None:
            better = max if checkpoint_cfg.maximize_best_checkpoint_metric else min
            prev = self.best
            self.best = valid_metric if prev is None else better(valid_metric, prev)
            if prev is None or self.best == valid_metric:
                names.append("checkpoint_best")
                if checkpoint_cfg.keep_best_checkpoints > 0:
                    names.append(f"checkpoint.best_{checkpoint_cfg.best_checkpoint_metric}_{valid_metric:.3f}")
        if not checkpoint_cfg.no_last_checkpoints:
            names.append("checkpoint_last")
        return names

    def save(self, epoch, end_of_epoch, valid_metric, num_updates):
        """Save every registered piece after update `num_updates` of `epoch`, under the
        names fairseq would give it (names)."""
        names = self.names(epoch, end_of_epoch, valid_metric, num_updates)
        if self.checkpoint_cfg.no_save or not names:
            return
        self.finish_pending()
        import torch.distributed.checkpoint as dcp

        tmp = files.temporary_dir(self.save_dir, names[0])
        failed = None
        if self.env.is_master:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a run that died while saving
            failed = files.write_failure(lambda: (tmp / "rng").mkdir(parents=True), self.save_dir)
        self.agree_saved(failed, tmp, names[0])
        with_optim = not self.checkpoint_cfg.no_save_optimizer_state
        state = tensor_state(self.model, self.optimizer, with_optim, self.ema)
        rng_file = tmp / "rng" / f"rank{self.env.rank}.json"
        failed = files.write_failure(lambda: write_json(rng_file, rng_state(self.env.device)), self.save_dir)
        if self.env.is_master and failed is None:

            def small_files():
                self.write_small_files(tmp, epoch, num_updates, with_optim)

            failed = files.write_failure(small_files, self.save_dir)
        self.agree_saved(failed, tmp, names[0])
        writer = dcp.FileSystemWriter(os.fspath(tmp))
        # Tensor parallelism's rows are written in the model's own order (tp_rows.py).
        planner = None
        if self.row_orders:
            from trainer.checkpoint.tp_rows import RowOrderSavePlanner  # DCP: imported where it is used

            planner = RowOrderSavePlanner(self.row_orders)
        if self.checkpoint_cfg.save_async:
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group, planner=planner)
            self.pending = (future, tmp, names, num_updates)
            return
        failed = files.write_failure(lambda: dcp.save(state, storage_writer=writer, planner=planner), self.save_dir)
        self.agree_saved(failed, tmp, names[0], agreed=True)
        # DCP's coordinator (rank 0) writes .metadata only after every rank has written
        # its shards, so rank 0 may publish as soon as save returns.
        self.publish(tmp, names, num_updates)

    def agree_saved(self, failed, tmp, name, agreed=False):
        """Stop every rank together when a write failed on any (a full disk, a read-only
        one): the half-written directory goes, the previous checkpoints stay as they were.
        `agreed`: DCP has already told every rank about any rank's failure."""
        if not agreed:
            (count,) = all_reduce_sum([0.0 if failed is None else 1.0], self.env)
            if count == 0:
                return
        elif failed is None:
            return
        if self.env.is_master:
            shutil.rmtree(tmp, ignore_errors=True)
        if failed is None or not self.env.is_master:
            raise RankStopped(f"another rank could not write {name}; see rank 0's error")
        last = checkpoint_dir.resolve(self.save_dir / "checkpoint_last")
        kept = f"{last.name} still holds update {read_trainer_state(last)['num_updates']}" if last else "nothing saved"
        raise UsageError(
            f"could not save {name} in {self.save_dir}: {failed}; {kept}; free space or point --save-dir elsewhere"
        )

    def write_small_files(self, tmp, epoch, num_updates, with_optim):
        pieces = {
            name: piece.state_dict()
            for name, piece in self.pieces.items()
            if with_optim or name not in self.optimizer_pieces
        }
        write_json(
            tmp / checkpoint_dir.STATE_FILE,
            {
                "format": FORMAT_VERSION,
                "num_updates": num_updates,
                "epoch": epoch,
                "has_optimizer": with_optim,
                "optimizer": self.cfg.optimizer._name if with_optim else None,
                "ddp_backend": self.cfg.distributed_training.ddp_backend,
                "torch": torch.__version__,
                "state": pieces,
            },
        )
        (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg))
        for name in (*TOKENIZER_FILES, "metadata.json"):
            if self.data_dir is not None and (Path(self.data_dir) / name).is_file():
                shutil.copyfile(Path(self.data_dir) / name, tmp / name)
        # A model fine-tuned from an HF directory keeps its eos ids (a chat model's end of
        # turn among them): generate and export-model need them when the directory is gone.
        source = hf_finetune_dir(self.cfg)
        config = generation_config(source) if source is not None else None
        if config is not None:
            write_generation_config(config, tmp)

    def publish(self, tmp, names, num_updates):
        if self.env.is_master:
            files.publish(tmp, self.save_dir / names[0])
            for name in names[1:]:
                files.link_copy(self.save_dir / names[0], self.save_dir / name)
            removed = files.prune(self.save_dir, self.checkpoint_cfg)
            log.info(
                f"Saved checkpoint {self.save_dir / names[0]} ({num_updates} updates"
                + (f", also as {', '.join(names[1:])}" if names[1:] else "")
                + (f"; removed {', '.join(removed)}" if removed else "")
                + ")"
            )

    def poll(self):
        """Publish an asynchronous save once its write has finished (rank 0 only needs to)."""
        if self.pending is not None and self.pending[0].done():
            self.finish_pending()

    def finish_pending(self):
        if self.pending is None:
            return
        future, tmp, names, num_updates = self.pending
        self.pending = None
        # rank 0's completes after every rank has written (DCP's finish step)
        self.agree_saved(files.write_failure(future.result, self.save_dir), tmp, names[0], agreed=True)
        self.publish(tmp, names, num_updates)

    # ------------------------------------------------------------- restore
    def restore_path(self):
        """What to resume from: --restore-file (default checkpoint_last in --save-dir), else
        --finetune-from-model, else nothing (trainer/checkpoint/files.py decides). Returns
        (path, finetune)."""
        path, finetune, looked_for = files.restore_choice(self.checkpoint_cfg)
        if path is None:
            log.info(f"No existing checkpoint found {looked_for}")  # fairseq's words: scripts look for them
        return path, finetune

    def restore(self):
        """Load the checkpoint to resume from, if any, into the model, the optimizer and
        every registered piece; returns its path or None."""
        path, finetune = self.restore_path()
        if path is None:
            if self.ema is not None and self.cfg.ema.ema_seed_model:
                self.seed_ema(self.cfg.ema.ema_seed_model)
            return None
        if checkpoint_dir.resolve(path) is None:
            return self.restore_foreign(path, finetune)
        saved = read_trainer_state(path)
        with_optim = not (finetune or self.checkpoint_cfg.reset_optimizer) and saved.get("has_optimizer")
        if with_optim:
            check_optimizer_name(path, saved.get("optimizer"), self.cfg.optimizer._name)
        self.load_model_and_optimizer(path, with_optim)
        if finetune:
            log.info(
                f"fine-tuning from {path}: weights only; optimizer, lr schedule, data position and meters start fresh"
            )
            return path
        for name, piece in self.pieces.items():
            piece_state = saved["state"].get(name)
            if piece_state is not None and (with_optim or name not in self.optimizer_pieces):
                piece.load_state_dict(piece_state)
        rng = path / "rng" / f"rank{self.env.rank}.json"
        if rng.is_file():
            set_rng_state(json.loads(rng.read_text()), self.env.device, self.env.local_rank)
        log.info(
            f"loaded checkpoint {path} (epoch {saved['epoch']} @ {saved['num_updates']} updates"
            + ("" if with_optim else ", optimizer reset")
            + ")"
        )
        return path

    def seed_ema(self, seed):
        """--ema-seed-model on a fresh start: the average saved in that checkpoint (fairseq
        loads it when the EMA is built, and a checkpoint resumed from replaces it)."""
        path = checkpoint_dir.resolve(seed)
        if path is None or not checkpoint_dir.tensor_specs(path, checkpoint_dir.EMA_PREFIX):
            raise UsageError(
                f"--ema-seed-model {seed} is not a checkpoint holding a moving average of the weights "
                "(one saved by train --store-ema); pass one, or drop --ema-seed-model to start from the weights"
            )
        state = {"ema": self.ema.state_dict()}
        check_shapes(path, state["ema"], self.cfg, prefix=checkpoint_dir.EMA_PREFIX)
        load_tensors(path, state, self.row_orders)
        log.info(f"the moving average of the weights starts from {path}'s (--ema-seed-model)")

    def restore_foreign(self, path, finetune):
        """Another trainer's model (trainer/formats/: a Hugging Face dir, a fairseq-train .pt):
        its weights, each rank its own rows; to resume a fairseq run, also its Adam state,
        update count, lr schedule, data position and best metric."""
        with open_model(path) as reader:
            n = load_rows(self.model, reader)
            if self.ema is not None:  # another trainer's average is not read: it starts from the weights
                self.ema.reset_from_weights()
            if finetune:
                log.info(
                    f"fine-tuning from {path} ({reader.describe()}, {n:,} parameters): optimizer, "
                    "lr schedule, data position and meters start fresh"
                )
                return path
            run = reader.resume_state()
            if run is None:
                raise UsageError(f"{path} holds a model but no run to resume; pass it with --finetune-from-model")
            with_optim = not self.checkpoint_cfg.reset_optimizer
            if with_optim:
                load_moments(self.model, self.optimizer, run)
        for name, piece in self.pieces.items():
            if name in run.pieces and (with_optim or name not in self.optimizer_pieces):
                piece.load_state_dict({**piece.state_dict(), **run.pieces[name]})
        log.info(
            f"loaded {reader.kind} checkpoint {path} (epoch {run.epoch} @ {run.num_updates} updates"
            + ("" if with_optim else ", optimizer reset")
            + ")"
        )
        return path

    def load_model_and_optimizer(self, path, with_optim):
        """The tensors of checkpoint `path` into the model (and the optimizer's state, and
        --store-ema's average: the checkpoint's, else the weights loaded, as fairseq's
        "EMA is re-initialized from checkpoint"; a run without --store-ema leaves it)."""
        ema_saved = self.ema is not None and bool(checkpoint_dir.tensor_specs(path, checkpoint_dir.EMA_PREFIX))
        state = tensor_state(self.model, self.optimizer, with_optim, self.ema if ema_saved else None)
        # Under the checkpoint's names: a pruned model (--decoder-layers-to-keep) loads the
        # layers it keeps from a checkpoint of all of them.
        ids = saved_layer_ids(self.cfg.model, checkpoint_dir.tensor_specs(path))
        state = {part: renumber_layers(tensors, ids) for part, tensors in state.items()}
        check_shapes(path, state["model"], self.cfg, kept_layers=ids)
        never_stepped = check_optimizer_state(path, state["optim"]) if with_optim else set()
        for fqn in never_stepped:
            del state["optim"][fqn]
        load_tensors(path, state, self.row_orders)
        back = None if ids is None else {saved_id: i for i, saved_id in enumerate(ids)}
        state = {part: renumber_layers(tensors, back) for part, tensors in state.items()}
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self.model, state["model"])
        if self.ema is not None and not ema_saved:
            self.ema.reset_from_weights()
            log.info(f"{path} holds no moving average of the weights: --store-ema starts it from its weights")
        if with_optim:
            groups = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
            # Not strict about the never-stepped: the load replaces the whole optimizer state,
            # so they are left stateless, as when saved, and their first step creates it.
            set_optimizer_state_dict(
                self.model,
                self.optimizer,
                {"state": state["optim"], "param_groups": groups},
                options=StateDictOptions(strict=not never_stepped),
            )
