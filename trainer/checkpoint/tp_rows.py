"""Checkpoints keep the model's own row order under tensor parallelism.

Tensor parallelism orders the rows of the parameters that stack several matrices (qkv_proj,
a gated fc1) by process (trainer/parallel/tensor_parallel.py): process r's query heads,
key heads, value heads, then process r+1's. A checkpoint written in that order could only
be read back at the same degree. So DCP is told where each run of a rank's rows lies in the
model's own order: a rank writes (and reads) its rows as several chunks of the tensor, one
per run of consecutive rows there, and a checkpoint is the same on every layout: TP 2 ×
FSDP 2 resumes on FSDP 4, on one process, or at another degree. Their optimizer state and
average (--store-ema) have the parameter's shape and sharding, and go the same way.
"""

import dataclasses

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainer.parallel.tensor_parallel import runs


class RowChunks:
    """{flattened state-dict key: its chunks} of the tensors whose rows are reordered:
    each chunk (the offsets DCP knows it by, the model-order chunk, this rank's local rows)."""

    def __init__(self, state_dict, orders):
        self.chunks = {}
        orders = {
            name: order
            for name, order in orders.items()
            if not name.startswith("layers.") or name.startswith("layers.0.")
        }
        for key, obj in state_dict.items():
            order = self._order(key, obj, orders)
            if order is None:
                continue
            sizes, offsets = compute_local_shape_and_global_offset(obj.shape, obj.device_mesh, obj.placements)
            rest_off, rest_size = tuple(offsets[1:]), tuple(sizes[1:])
            self.chunks[key] = [
                (
                    (row, *rest_off),
                    ChunkStorageMetadata(offsets=torch.Size((row, *rest_off)), sizes=torch.Size((count, *rest_size))),
                    slice(local, local + count),
                )
                for local, row, count in runs(order, offsets[0], sizes[0])
            ]

    @staticmethod
    def _order(key, obj, orders):
        """The row order of state-dict entry `key` (model.<param>, optim.<param>.<state>,
        ema.<param>), or None when its rows are the model's."""
        if not isinstance(obj, DTensor) or obj.dim() == 0:
            return None
        name = key.split(".", 1)[1] if "." in key else key
        if name.startswith("layers."):  # every layer's are alike: a pruned model's are renumbered
            name = "layers.0." + name.split(".", 2)[2]
        for param, order in orders.items():
            if (name == param or name.startswith(param + ".")) and obj.shape[0] == len(order):
                return order
        return None

    def local(self, key, obj, offsets):
        for chunk_offsets, _, rows in self.chunks[key]:
            if tuple(chunk_offsets) == tuple(offsets):
                return obj.to_local()[rows]
        raise KeyError(f"no chunk of {key} at {tuple(offsets)}")


class RowOrderSavePlanner(DefaultSavePlanner):
    def __init__(self, orders):
        super().__init__()
        self.orders = orders

    def create_local_plan(self):
        self.row_chunks = RowChunks(self.state_dict, self.orders)
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self.row_chunks.chunks]
        for key, chunks in self.row_chunks.chunks.items():
            obj = self.state_dict[key]
            for offsets, chunk, _ in chunks:
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk, properties=TensorProperties.create_from_tensor(obj.to_local()), size=obj.size()
                        ),
                    )
                )
        plan = dataclasses.replace(plan, items=items)
        self.plan = plan
        return plan

    def lookup_object(self, index):
        if index.fqn in self.row_chunks.chunks:
            return self.row_chunks.local(index.fqn, self.state_dict[index.fqn], index.offset)
        return super().lookup_object(index)


def row_order_load(planner_class, orders):
    """A load planner of `planner_class` (a DefaultLoadPlanner) that reads the reordered
    tensors' rows from wherever they lie in the model's order."""

    class Planner(planner_class):
        def create_local_plan(self):
            self.row_chunks = RowChunks(self.state_dict, orders)
            rest = {k: v for k, v in self.state_dict.items() if k not in self.row_chunks.chunks}
            plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
            items = list(plan.items)
            for key, chunks in self.row_chunks.chunks.items():
                md = self.metadata.state_dict_metadata[key]
                items += create_read_items_for_chunk_list(key, md, [chunk for _, chunk, _ in chunks])
            return dataclasses.replace(plan, items=items)

        def lookup_tensor(self, index):
            if index.fqn in self.row_chunks.chunks:
                return self.row_chunks.local(index.fqn, self.state_dict[index.fqn], index.offset)
            return super().lookup_tensor(index)

    return Planner()
