"""Iterative product quantization in training (--quantization-config-path; fairseq's
Quantizer hooks in fairseq/trainer.py): when the schedule (trainer/train/quantization.py)
says, the layers of the next stage are quantized with k-means (models/pq.py) and training
goes on with their centroids in their weights' place, under a new optimizer, as fairseq's
trainer.reinitialize does.

The config's regexes are fairseq's layer names (`decoder.layers.0.fc1`,
`decoder.layers.0.self_attn.q_proj`): each of our layers answers to its fairseq name, and
our qkv_proj, which stacks fairseq's q_proj, k_proj and v_proj by rows, is quantized by
parts, each with its own centroids (models/pq.py StackedLinear).

A stage takes every weight whole: the model's whole tensors are gathered on every rank
(DCP's full state dict), rank 0 runs each layer's k-means and sends the centroids and
assignments to the others, then a model with those layers quantized is built and
parallelized as the run's was and takes the whole tensors, each rank keeping its shards.
Under FSDP the centroids are sharded as any parameter (by rows); the assignments and counts
are buffers, whole on every rank, as FSDP keeps buffers.
"""

import gc
import logging
import random
import re

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from models.pq import (
    PQEmbedding,
    PQLinear,
    SizeTracker,
    StackedLinear,
    block_counts,
    pq_param,
    quantize,
    quantized_specs,
    split_stacked,
)
from trainer.config.quantization import check_stage_matches, load_config, stage_matches
from trainer.cpu import host_allocator
from trainer.train.quantization import QuantizationSchedule

log = logging.getLogger("shardlm")
_ATTENTION = re.compile(r"layers\.(\d+)\.(qkv_proj|out_proj)$")
_STACKED_PART = re.compile(r"(layers\.\d+\.qkv_proj)\.parts\.(q|k|v)$")


def fairseq_layers(model):
    """[(fairseq's name, our name, a stand-in module of its type and shape)] of the model's
    linear and embedding layers not quantized yet; a qkv_proj answers as its three parts,
    which a StackedLinear names `<qkv_proj>.parts.{q,k,v}`."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (PQLinear, PQEmbedding, StackedLinear)) or not isinstance(
            module, (nn.Linear, nn.Embedding)
        ):
            continue
        attention, part = _ATTENTION.match(name), _STACKED_PART.match(name)
        if attention and attention.group(2) == "qkv_proj":
            for piece, rows in model.stacked_rows(name).items():
                stand_in = nn.Linear(module.in_features, rows, bias=False, device="meta")
                out.append(
                    (f"decoder.layers.{attention.group(1)}.self_attn.{piece}_proj", f"{name}.parts.{piece}", stand_in)
                )
        elif attention:
            out.append((f"decoder.layers.{attention.group(1)}.self_attn.out_proj", name, module))
        elif part:
            layer = part.group(1).split(".")[1]
            out.append((f"decoder.layers.{layer}.self_attn.{part.group(2)}_proj", name, module))
        else:
            out.append(("decoder." + name, name, module))
    return out


def stage_layers(model, stage, regex):
    """The layers (fairseq_layers' entries) the stage's regex names, as fairseq's get_layers
    matches (trainer/config/quantization.py stage_matches: a regex with its backslashes
    doubled is read with single ones, and said so)."""
    layers = fairseq_layers(model)
    names, read = stage_matches(regex, [fairseq for fairseq, _, _ in layers])
    if read != regex:
        log.warning(
            f"quantization config: layers_to_quantize[{stage}] = {regex} has its backslashes doubled (a plain "
            f"YAML scalar keeps both), which matches no layer (fairseq then quantizes nothing); read as {read}"
        )
    check_stage_matches(stage, regex, names)
    return [entry for entry in layers if entry[0] in names]


def give_back_pages():
    """After a stage, the host pages the old model, its optimizer state, the whole tensors
    and k-means freed go back to the OS: the caching host allocator (trainer/cpu/
    host_allocator.py) would keep them, and the quantized model, smaller, would not reuse
    them all, so a CPU rank's resident memory (mem_gb) would stay the old model's, not the
    one `plan` predicts for the last stage. The old model's modules may hold each other
    (hooks): collected first."""
    gc.collect()
    host_allocator.release_cached()


class IPQ:
    """The run's quantizer: its schedule (checkpointed as "quantizer"), and the stage's work."""

    def __init__(self, cfg, env, make_model):
        """make_model(specs): a new model with the layers `specs` names quantized
        (models/pq.py quantized_specs), parallelized as the run's: (model, grad_sync)."""
        self.cfg, self.env, self.make_model = cfg, env, make_model
        optimization = cfg.optimization
        self.schedule = QuantizationSchedule(
            load_config(cfg.common.quantization_config_path), optimization.max_epoch, optimization.max_update
        )

    def state_dict(self):
        return self.schedule.state_dict()

    def load_state_dict(self, state):
        self.schedule.load_state_dict(state)

    def begin_epoch(self, epoch, trainer, checkpointer):
        stage = self.schedule.begin_epoch(epoch)
        if stage is not None:
            self.quantize(stage, trainer, checkpointer)
            give_back_pages()

    def due_after(self, n):
        """Whether a stage is quantized after update n (the loop then makes its count exact)."""
        every = self.schedule.update_schedule
        return (
            every is not None
            and n % every == 0
            and self.schedule.quantization_step < len(self.schedule.layers_to_quantize)
        )

    def step_update(self, trainer, checkpointer):
        stage = self.schedule.step_update(trainer.num_updates)
        if stage is not None:
            self.quantize(stage, trainer, checkpointer)
            give_back_pages()

    def quantize(self, stage, trainer, checkpointer):
        """Quantize stage `stage`'s layers of the trainer's model, and train the new model."""
        model = getattr(trainer.model, "module", trainer.model)
        regex = self.schedule.layers_to_quantize[stage]
        layers = stage_layers(model, stage, regex)
        whole = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
        state = {name: t.detach().cpu() for name, t in whole.items()}
        tracker = SizeTracker(model)
        # one random stream through the stage's layers, as fairseq's quantize_model_ draws
        draws = {"generator": torch.Generator().manual_seed(self.cfg.common.seed + stage), "rng": random.Random(stage)}
        for fairseq_name, name, stand_in in layers:
            owner = _STACKED_PART.match(name)
            if owner:
                state = split_stacked(state, owner.group(1), model.stacked_rows(owner.group(1)))
            weight = state.pop(name + ".weight")
            block = pq_param(stand_in, fairseq_name, self.schedule.block_sizes_config)
            k = pq_param(stand_in, fairseq_name, self.schedule.n_centroids_config)
            centroids, assignments = self.kmeans(weight, block, k, draws)
            state[name + ".centroids"], state[name + ".assignments"] = centroids, assignments
            state[name + ".counts"] = block_counts(assignments, centroids)
            tracker.update(weight, block, k)
        specs = quantized_specs({name: tuple(t.shape) for name, t in state.items()})
        new_model, grad_sync = self.make_model(specs)
        set_model_state_dict(new_model, state, options=StateDictOptions(full_state_dict=True))
        trainer.replace_model(new_model, grad_sync)
        if checkpointer is not None:
            checkpointer.follow(trainer)
        if self.env.is_master:
            log.info(
                f"iterative PQ stage {stage + 1}/{len(self.schedule.layers_to_quantize)} at update "
                f"{trainer.num_updates}: quantized {len(layers)} layers ({', '.join(f for f, _, _ in layers)}); "
                f"a new optimizer; {tracker}"
            )

    def kmeans(self, weight, block, k, draws):
        """(centroids, assignments) of `weight`'s blocks: rank 0's, on every rank."""
        n_blocks = weight.numel() // block
        if self.env.rank == 0:  # on the rank's device, as fairseq's (a GPU's k-means takes seconds, a host's minutes)
            centroids, assignments = quantize(weight.to(self.env.device).float(), block, k, **draws)
        else:
            centroids, assignments = torch.empty(k, block), torch.empty(n_blocks, dtype=torch.long)
        if self.env.world_size > 1:
            device = self.env.device
            centroids, assignments = centroids.to(device), assignments.to(device)
            dist.broadcast(centroids, 0)
            dist.broadcast(assignments, 0)
        return centroids.cpu().to(weight.dtype), assignments.cpu()
