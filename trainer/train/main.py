"""`train` after its config is composed: build everything, print it, train."""

import logging
import random
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from data.atomic_file import write_atomically
from models.pq import quantized_specs
from models.transformer_lm import build_model, num_parameters
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.files import remove_unfinished_saves, restore_choice
from trainer.checkpoint.model_weights import load_model_weights
from trainer.checkpoint.save_dir_lock import SaveDirLock
from trainer.config.checks import check_adaptive_vocab
from trainer.config.schema import model_positions, uses_fsdp
from trainer.errors import RankStopped, UsageError
from trainer.formats.shardlm import checkpoint_dir
from trainer.parallel.lost_peer import peer_lost
from trainer.parallel.parallelize import freeze, parallelize, sharded_bytes
from trainer.parallel.ranks import all_reduce_sum, collective_timeout, init_rank, teardown
from trainer.train.ipq import IPQ
from trainer.train.loop import TrainLoop
from trainer.train.meters import flops_per_token
from trainer.train.objectives import build_objective
from trainer.train.preemption import Preemption
from trainer.train.progress import Progress, setup_logging
from trainer.train.task import LMTask
from trainer.train.trainer import Trainer

log = logging.getLogger("shardlm")


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def save_config(cfg):
    """<save-dir>/config.yaml: `train --config-dir <save-dir> --config-name config` reruns it."""
    save_dir = Path(cfg.checkpoint.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(save_dir / "config.yaml", OmegaConf.to_yaml(cfg))


def build(cfg, env):
    """Task, model (wrapped for its backend) and trainer for a composed config."""
    set_seed(cfg.common.seed)
    task = LMTask(cfg, env)
    vocab_size = task.model_vocab_size
    check_adaptive_vocab(cfg.model, vocab_size, task.pad)
    max_positions = model_positions(cfg)
    # Sharded models start on the meta device: no rank ever holds the whole model.
    device = "meta" if uses_fsdp(cfg) else env.device
    model = build_model(cfg.model, vocab_size, max_positions, device=device, padding_idx=task.pad, seed=cfg.common.seed)
    quantized = quantized_specs_to_restore(cfg)
    if quantized:  # iPQ: the checkpoint to resume holds layers quantized already
        model.quantize_structure(quantized, device)
    n_params = num_parameters(model)
    log.info(
        f"model {cfg.model._name}, {len(model.layers)} layers x {cfg.model.decoder_embed_dim}, vocabulary {vocab_size}"
    )
    log.info(
        f"num. model params: {n_params:,} (num. trained: "
        f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,})"
    )
    vocab_modules = (model.embed_tokens, model.embed_positions, model.output_projection, model.adaptive_softmax)
    embed_params = sum(p.numel() for m in vocab_modules if m is not None for p in m.parameters())
    # An adaptive softmax scores the head (first band + clusters) for every token; a tail
    # only for its band's tokens, left out of this count, as the adaptive input's bands are.
    scored = vocab_size if model.adaptive_softmax is None else model.adaptive_softmax.head_size
    fpt = flops_per_token(cfg.model, n_params, scored, embed_params, cfg.task.tokens_per_sample)
    model, grad_sync = parallelize(model, cfg, env)
    log.info(
        f"rank {env.rank} holds {sharded_bytes(model) / 2**20:,.1f} MiB of parameters "
        f"({cfg.distributed_training.ddp_backend}, {env.world_size} rank(s))"
    )
    reference = None
    if cfg.task._name == "dpo":
        reference = build_reference(cfg, env, vocab_size, max_positions, task.pad)
        fpt = fpt * 4 / 3  # and the reference's forward: a third of a training step's FLOPs
    trainer = Trainer(cfg, model, env, task.pad, grad_sync, build_objective(cfg, reference, env))
    if cfg.common.quantization_config_path:

        def make_model(specs):
            model = build_model(
                cfg.model, vocab_size, max_positions, device=device, padding_idx=task.pad, seed=cfg.common.seed
            )
            model.quantize_structure(specs, device)
            return parallelize(model, cfg, env)

        trainer.quantizer = IPQ(cfg, env, make_model)
    return task, trainer, fpt


def quantized_specs_to_restore(cfg):
    """iPQ's quantized layers ({module: shapes}, models/pq.py) of the shardlm checkpoint the
    run starts from, or {}."""
    if not cfg.common.quantization_config_path:
        return {}
    path = restore_choice(cfg.checkpoint)[0]
    if path is None or checkpoint_dir.resolve(path) is None:
        return {}
    return quantized_specs({name: shape for name, (shape, _) in checkpoint_dir.tensor_specs(path).items()})


def build_reference(cfg, env, vocab_size, max_positions, pad):
    """--task dpo's frozen reference: --dpo-reference, else the model the run started from
    (--finetune-from-model), loaded on every start and resume (checkpoints do not hold it)."""
    path = cfg.task.dpo_reference or cfg.checkpoint.finetune_from_model
    device = "meta" if uses_fsdp(cfg) else env.device
    reference = build_model(cfg.model, vocab_size, max_positions, device=device, padding_idx=pad, seed=cfg.common.seed)
    reference = freeze(reference, cfg, env)
    what = load_model_weights(reference, cfg, path)
    log.info(
        f"dpo: the reference model is {path} ({what}), frozen; rank {env.rank} holds "
        f"{sharded_bytes(reference) / 2**20:,.1f} MiB of it; beta {cfg.task.dpo_beta}, "
        f"label smoothing {cfg.task.dpo_label_smoothing}"
    )
    return reference


def run(cfg, rdv):
    """One rank of the job (the whole job when there is one rank)."""
    env = init_rank(cfg, rdv, needs_process_group=uses_fsdp(cfg))
    try:
        return train(cfg, env)
    except BaseException as e:  # DCP's CheckpointException is not an Exception
        lost = peer_lost(e, cfg, env)
        if lost is None:
            raise
        raise lost from None
    finally:
        teardown()


def train(cfg, env):
    setup_logging(cfg.common.log_file, env.is_master)
    log.info("config:\n" + OmegaConf.to_yaml(cfg).rstrip())
    lock = lock_save_dir(cfg, env)
    try:
        task, trainer, fpt = build(cfg, env)
        layout = f" (data {env.data_size} x context {env.cp} x tensor {env.tp})" if env.tp * env.cp > 1 else ""
        log.info(
            f"training on {env.world_size} rank(s){layout}, device {env.device}, backend "
            f"{cfg.distributed_training.ddp_backend}, {torch.get_num_threads()} threads per rank"
        )
        checkpointer = Checkpointer(
            cfg, env, trainer.model, trainer.optimizer, getattr(task, "data_dir", None), trainer.ema
        )
        preemption = Preemption(env, collective_timeout(cfg), cfg.checkpoint)
        loop = TrainLoop(cfg, trainer, task, Progress(cfg, env.is_master), env, fpt, checkpointer, preemption)
        # The training state besides the tensors, each piece saved under its name.
        checkpointer.register("trainer", trainer)
        checkpointer.register("loop", loop)
        if trainer.scaler is not None:
            checkpointer.register("loss_scaler", trainer.scaler, with_optimizer=True)
        if trainer.quantizer is not None:
            checkpointer.register("quantizer", trainer.quantizer)
        checkpointer.restore()
        # Only now, with every input checked, does the save directory change.
        if lock is not None:
            save_config(cfg)
            for name in remove_unfinished_saves(cfg.checkpoint.save_dir):
                log.info(f"removed {name}, left by a run that died while saving")
        loop.run()
        trainer.finish()
        return preemption.exit_code()  # 130 after a Ctrl-C, as an interrupted command ends
    finally:
        if lock is not None:
            lock.release()


def lock_save_dir(cfg, env):
    """Rank 0 locks --save-dir for this run (nothing to lock with --no-save); every rank
    learns whether it could, so all stop together when it could not."""
    lock, refusal = None, None
    if env.is_master and not cfg.checkpoint.no_save:
        lock = SaveDirLock(cfg.checkpoint.save_dir)
        refusal = lock.acquire()
    (refused,) = all_reduce_sum([1.0 if refusal else 0.0], env)
    if refusal:
        raise UsageError(refusal)
    if refused:
        raise RankStopped("rank 0 could not use --save-dir; see its error")
    return lock
