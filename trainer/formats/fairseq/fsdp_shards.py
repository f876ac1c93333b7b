"""fairseq's FSDP checkpoints (`fairseq-train --ddp-backend fully_sharded`, fairscale 0.4.13's
FullyShardedDataParallel) read as one fairseq checkpoint, so every command that takes a
fairseq `.pt` takes them.

With --use-sharded-state each rank writes its own file, `checkpoint_last-shard{rank}.pt`
(fairseq adds `-shard{rank}` to the name; `checkpoint_last.pt` itself is never written). Its
`model` holds, per FSDP unit (the root, and each layer wrapped by --min-params-to-wrap), the
rank's chunk of one flat parameter: the unit's parameters flattened in order, cut in
world-size chunks as torch.chunk cuts them, the shorter ones zero-padded at the end to the
first one's length. Its `fsdp_metadata` names the unit (`fsdp_path`), its parameters (names
relative to the unit, shapes, numels), the rank's padding, and parameters tied to another
(`shared_param_info`: flattened once). Its Adam state (`last_optimizer_state`) is flat like
the parameters, one entry per flat parameter in the model's `parameters()` order (the order
of their keys in `model`). Un-flattening is fairscale's consolidate_shard_weights: each unit's
chunks, padding dropped, joined and cut back into its parameters; buffers are rank 0's.

Without --use-sharded-state rank 0 writes one file: the whole model under its own names,
`fsdp_metadata`, and fairscale's gather_full_optim_state_dict, whose Adam state is keyed by a
parameter's position in fsdp_metadata's order (unit by unit, each its names in turn), not
in the model's: `fsdp_parameter_order` gives that order. Consolidated shards keep it too.

Torch-free at import (a command composes its config from the checkpoint before importing
torch): tensors are cut and joined with their own methods.
"""

import glob
import re
from pathlib import Path

from trainer.errors import UsageError

_SHARD_NAME = re.compile(r"(.+)-shard(\d+)\.pt")
# What differs from rank to rank in a shard's config.
_PER_RANK = {("distributed_training", "distributed_rank"), ("distributed_training", "device_id")}


def shard_files(path):
    """{rank: file} of fairseq's sharded checkpoint that `path` names, or None: `path` is
    `DIR/NAME.pt` that does not exist, with `NAME-shard{i}.pt` beside it (the name fairseq's
    commands are given), or one of those shard files itself."""
    path = Path(path)
    named = _SHARD_NAME.fullmatch(path.name)
    if named:
        stem = named[1]
    elif path.suffix == ".pt" and not path.exists():
        stem = path.stem
    else:
        return None
    files = {}
    for candidate in Path(path.parent).glob(glob.escape(stem) + "-shard*.pt"):
        found = _SHARD_NAME.fullmatch(candidate.name)
        if found and found[1] == stem and candidate.is_file():
            files[int(found[2])] = candidate
    return files or None


def is_shard(state):
    """One rank's file of an FSDP run with --use-sharded-state (its `model` holds flat chunks)."""
    if not isinstance(state, dict) or not isinstance(state.get("fsdp_metadata"), dict):
        return False
    distributed = (state.get("cfg") or {}).get("distributed_training") or {}
    return bool(distributed.get("use_sharded_state"))


def world_size(state):
    return int(((state.get("cfg") or {}).get("distributed_training") or {}).get("distributed_world_size") or 1)


def missing_shards(name, files, world):
    """UsageError naming the shard files of a `world`-rank checkpoint that are not in `files`."""
    some = next(iter(files.values()))
    stem = _SHARD_NAME.fullmatch(some.name)[1]
    missing = [f"{stem}-shard{r}.pt" for r in range(world) if r not in files]
    if missing:
        raise UsageError(
            f"{name}: fairseq's sharded checkpoint {stem}.pt was written by {world} ranks "
            f"(--use-sharded-state), and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            f"in {some.parent}; put all {world} shard files there"
        )


def fsdp_parameter_order(state):
    """The fairseq names of the parameters in fairscale's consolidated optimizer order (unit
    by unit, each its parameters in flattening order), or None for a checkpoint without FSDP."""
    meta = state.get("fsdp_metadata")
    if not isinstance(meta, dict):
        return None
    return [
        _join(unit["fsdp_path"], name)
        for unit in meta["param_metadata"]
        for flat in unit["params"].values()
        for name in flat["names"]
    ]


def _join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def _first_difference(a, b, keys=()):
    """The first dotted key whose values differ in two configs (per-rank keys aside), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if (*keys, key) in _PER_RANK:
                continue
            found = _first_difference(a.get(key), b.get(key), (*keys, key))
            if found:
                return found
        return None
    return None if a == b else (".".join(map(str, keys)), a, b)


def _layout(meta):
    """fsdp_metadata less each rank's padding: what every shard of one checkpoint shares."""
    units = [
        (
            unit["fsdp_path"],
            [(k, v["names"], [tuple(s) for s in v["shapes"]], v["numels"]) for k, v in unit["params"].items()],
            [tuple(x) for x in unit.get("shared_param_info", [])],
        )
        for unit in meta["param_metadata"]
    ]
    return units, list(meta.get("buffer_names", []))


def _num_updates(state):
    return ((state.get("optimizer_history") or [{}])[-1]).get("num_updates")


def _check_one_checkpoint(shards):
    """Every shard is its rank's, of the same save of the same run."""
    world = len(shards)
    first_path, first = shards[0]
    for rank, (path, state) in enumerate(shards):
        if not is_shard(state):
            raise UsageError(f"{path} is not a shard of a --use-sharded-state FSDP run (it has no fsdp_metadata)")
        said = ((state.get("cfg") or {}).get("distributed_training") or {}).get("distributed_rank", rank)
        if world_size(state) != world or said != rank:
            raise UsageError(
                f"{path} holds rank {said}'s shard of {world_size(state)}, not rank {rank}'s of {world} as its name "
                f"says; pass the shard files of one checkpoint under fairseq's names"
            )
        if rank == 0:
            continue
        differs = None
        if _num_updates(state) != _num_updates(first):
            differs = ("update count (num_updates)", _num_updates(first), _num_updates(state))
        elif _layout(state["fsdp_metadata"]) != _layout(first["fsdp_metadata"]):
            differs = ("FSDP layout (fsdp_metadata)", "", "")
        else:
            found = _first_difference(first.get("cfg"), state.get("cfg"))
            if found:
                differs = (f"config ({found[0]})", found[1], found[2])
        if differs:
            what, a, b = differs
            values = f" ({a} vs {b})" if a != "" else ""
            raise UsageError(
                f"{first_path.name} and {path.name} are shards of different checkpoints: their {what} "
                f"differ{values}; pass the shard files of one save of one run"
            )


def _span(chunks, start, numel):
    """Values start..start+numel of the chunks joined: a view where one chunk holds them all."""
    pieces, offset = [], 0
    for chunk in chunks:
        lo, hi = max(start - offset, 0), min(start + numel - offset, chunk.numel())
        if lo < hi:
            pieces.append(chunk[lo:hi])
        offset += chunk.numel()
    if len(pieces) == 1:
        return pieces[0]
    out = chunks[0].new_empty(numel)
    at = 0
    for piece in pieces:
        out[at : at + piece.numel()].copy_(piece)
        at += piece.numel()
    return out


def _unflatten(chunks, flat, where):
    """The parameters of one flat parameter from its ranks' chunks (padding already dropped)."""
    total = sum(c.numel() for c in chunks)
    if total != sum(flat["numels"]):
        raise UsageError(
            f"{where}: its shards hold {total:,} values, its fsdp_metadata names {sum(flat['numels']):,}; "
            "the shard files are damaged or of different runs"
        )
    out, start = [], 0
    for shape, numel in zip(flat["shapes"], flat["numels"]):
        out.append(_span(chunks, start, numel).view(tuple(shape)))
        start += numel
    return out


def _unpadded(tensor, padding):
    flat = tensor.reshape(-1)
    return flat[: flat.numel() - padding] if padding else flat


def consolidate(shards):
    """One fairseq checkpoint dict of `shards` ([(path, state)] by rank): the model under its
    own names, tied names included, rank 0's buffers, and Adam's state un-flattened like the
    parameters, keyed in fsdp_parameter_order as fairscale's gathered state is."""
    _check_one_checkpoint(shards)
    first_path, first = shards[0]
    units = first["fsdp_metadata"]["param_metadata"]
    # params: a flat parameter's key -> (its unit, its name there, its first parameter's
    # position in fsdp_parameter_order)
    model, params = {}, {}
    index = 0
    for u, unit in enumerate(units):
        for backing, flat in unit["params"].items():
            key = _join(unit["fsdp_path"], backing)
            params[key] = (u, backing, index)
            index += len(flat["names"])
            chunks = []
            for path, state in shards[: 1 if unit.get("no_broadcast_optim_state") else None]:
                if key not in state["model"]:
                    raise UsageError(f"{path} has no tensor {key}, which its fsdp_metadata names; the file is damaged")
                padding = state["fsdp_metadata"]["param_metadata"][u]["params"][backing]["padding"]
                chunks.append(_unpadded(state["model"][key], padding))
            for name, tensor in zip(flat["names"], _unflatten(chunks, flat, f"{first_path.parent}/{key}")):
                model[_join(unit["fsdp_path"], name)] = tensor
        for src, dst in unit.get("shared_param_info", []):
            model[_join(unit["fsdp_path"], dst)] = model[_join(unit["fsdp_path"], src)]
    for name in first["fsdp_metadata"].get("buffer_names", []):
        if name in first["model"]:
            model[name] = first["model"][name]
    out = {**first, "model": model}
    if isinstance(first.get("last_optimizer_state"), dict):
        out["last_optimizer_state"] = _consolidate_optimizer(shards, params)
    return out


def _consolidate_optimizer(shards, params):
    """fairscale's gather_full_optim_state_dict of the shards' flat Adam states: a tensor of a
    flat parameter's shard length is un-flattened like the parameter; the rest (the step
    count) is the same on every rank and copied to each of its parameters."""
    first_path, first = shards[0]
    units = first["fsdp_metadata"]["param_metadata"]
    # the optimizer's parameters are the model's in `parameters()` order: their keys' order
    flat_keys = [key for key in first["model"] if key in params]
    state = {}
    for local_id in first["last_optimizer_state"]["state"]:
        if local_id >= len(flat_keys):
            raise UsageError(f"{first_path}: optimizer state {local_id} for {len(flat_keys)} flat parameters")
        u, backing, start = params[flat_keys[local_id]]
        flat = units[u]["params"][backing]
        ranks = shards[: 1 if units[u].get("no_broadcast_optim_state") else None]
        per_rank = [s["last_optimizer_state"]["state"].get(local_id, {}) for _, s in ranks]
        merged = [{} for _ in flat["names"]]
        for name, value in per_rank[0].items():
            if hasattr(value, "reshape") and value.dim() > 0:
                chunks = [
                    _unpadded(rs[name], s["fsdp_metadata"]["param_metadata"][u]["params"][backing]["padding"])
                    for rs, (_, s) in zip(per_rank, ranks)
                ]
                where = f"{first_path.parent}/{flat_keys[local_id]} (Adam's {name})"
                for i, tensor in enumerate(_unflatten(chunks, flat, where)):
                    merged[i][name] = tensor
            else:
                values = [rs.get(name) for rs in per_rank]
                if any(_plain(v) != _plain(value) for v in values):
                    raise UsageError(
                        f"{first_path.parent}: the shards' Adam {name} differ ({', '.join(map(str, values))}); "
                        "they are not of one save"
                    )
                for m in merged:
                    m[name] = value
        for i, m in enumerate(merged):
            state[start + i] = m
    groups = [dict(g) for g in first["last_optimizer_state"].get("param_groups", [])]
    if groups:
        groups[0]["params"] = list(range(sum(len(flat["names"]) for u in units for flat in u["params"].values())))
    return {**first["last_optimizer_state"], "state": dict(sorted(state.items())), "param_groups": groups}


def _plain(value):
    return value.item() if hasattr(value, "item") else value
