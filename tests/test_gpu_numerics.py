"""What a first GPU run would otherwise find wrong (issue 47), shown here on the CPU: fp16's
gradients of a large update, the skip flag handed to an optimizer on another device, the
CUDA random streams a resumed rank restores, the memory fields logged, pinned batches."""

import pytest
import torch

from helpers import DUMMY, compose


def update_gradients(argv, sample_size):
    """The gradients one update hands its optimizer (fp32 copies), on one batch of 4 sequences
    counted as `sample_size` tokens: one rank's micro-batch in an update of that many tokens
    over many ranks, whose gradients the whole update's sample size divides."""
    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(DUMMY + ["--batch-size", "4"] + argv)
    env = ranks.init_rank(cfg, Rendezvous("", 1), needs_process_group=False)
    try:
        task, trainer, _ = build(cfg, env)
        batch = next(task.batch_iterator(cfg.dataset.train_subset, training=True).next_epoch_itr())
        batch["sample_size"] = sample_size
        captured = []
        trainer.step = lambda bad: captured.append([p.grad.float().clone() for p in trainer.model.parameters()])
        trainer.train_step([batch])
        return torch.cat([g.flatten() for g in captured[0]])
    finally:
        ranks.teardown()


def test_fp16_gradients_of_a_4m_token_update_match_fp32():
    """fairseq backprops the loss-scaled *summed* loss and divides the gradients by the sample
    size after backward. Folding 1/2**22 (a 4M-token update, Llama's) into the loss before
    the scale (128) started fp16's backward at 3e-5, where fp16 is subnormal: 0.28 % of the
    gradients were flushed to zero and the rest were 1.4 % off fp32's (0.0 % and 0.06 % now)."""
    n = 2**22
    fp32 = update_gradients([], n)
    fp16 = update_gradients(["--fp16"], n)
    nonzero = fp32 != 0
    zeros = ((fp16 == 0) & nonzero).sum().item() / nonzero.sum().item()
    error = ((fp16 - fp32).norm() / fp32.norm()).item()
    print(f"fp16 vs fp32 at sample size {n}: {zeros:.4f} of gradients zero, relative error {error:.4g}")
    assert zeros < 0.001 and error < 0.004


class OnCuda(torch.Tensor):
    """A 0-d flag that says it is on cuda (no GPU here): copying it anywhere records the
    copy's arguments and gives its value on the host; any other use raises."""

    @staticmethod
    def __new__(cls, value):
        flag = torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=value.dtype, device=torch.device("cuda"))
        flag.value, flag.copies = value, []
        return flag

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            args[0].copies.append(dict(kwargs or {}))
            return args[0].value.clone()
        raise NotImplementedError(f"{func} on a flag that stands for a cuda tensor")


def test_a_skip_flag_on_another_device_reaches_host_parameters_by_a_blocking_copy():
    """--cpu-offload: found_inf is on the GPU, the shards and the fused step on the host. torch's
    step would copy it with non_blocking=True, and the CPU kernel could read the host copy
    before it landed; the step copies it synchronously, and the skip it says happens."""
    from trainer.train.optim import ShardLocalAdamW

    for skip in (1.0, 0.0):
        param = torch.nn.Parameter(torch.ones(8))
        param.grad = torch.ones(8)
        optimizer = ShardLocalAdamW([param], lr=0.1, fused=True)
        optimizer.found_inf = flag = OnCuda(torch.tensor(skip))
        optimizer.step()
        assert flag.copies and not any(c.get("non_blocking") for c in flag.copies), flag.copies
        assert all(c["device"] == torch.device("cpu") for c in flag.copies)
        assert torch.equal(param.detach(), torch.ones(8)) == bool(skip)


def test_a_skip_flag_on_the_parameters_device_is_not_copied():
    """On the GPU, flag and parameters both there: no copy, so no wait for the device."""
    from trainer.train.optim import flag_for_params

    flag = torch.zeros(())
    assert flag_for_params(flag, torch.device("cpu")) is flag and flag_for_params(None, torch.device("cpu")) is None


class CudaRandomStates:
    """torch.cuda's random-state functions for `visible` GPUs (no GPU here): a device index
    that is not visible raises as CUDA's invalid device ordinal does; the _all forms are
    torch's own loops over the visible indices."""

    def __init__(self, visible):
        self.visible, self.states, self.calls = visible, {}, []

    def index(self, device):
        index = device if isinstance(device, int) else torch.device(device).index
        index = 0 if index is None else index
        if not 0 <= index < self.visible:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({self.visible} visible)")
        return index

    def get_rng_state(self, device="cuda"):
        index = self.index(device)
        self.calls.append(("get", index))
        return self.states.get(index, torch.full((16,), index, dtype=torch.uint8)).clone()

    def set_rng_state(self, state, device="cuda"):
        index = self.index(device)
        self.calls.append(("set", index))
        self.states[index] = state.clone()

    def get_rng_state_all(self):
        return [self.get_rng_state(i) for i in range(self.visible)]

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, i)

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self


def test_a_rank_resumes_its_own_cuda_stream_on_the_gpu_it_has_now(monkeypatch):
    """Saved by local rank 3 on cuda:3 of 4 visible GPUs, resumed with one GPU per task: its
    stream, and only its, is saved and is restored on cuda:0."""
    import json

    from trainer.checkpoint.rng import rng_state, set_rng_state

    saving = CudaRandomStates(visible=4).install(monkeypatch)
    saving.states[3] = torch.arange(16, dtype=torch.uint8)
    saved = json.loads(json.dumps(rng_state(torch.device("cuda", 3))))
    assert saving.calls == [("get", 3)]

    resuming = CudaRandomStates(visible=1).install(monkeypatch)
    set_rng_state(saved, torch.device("cuda", 0), local_rank=3)
    assert resuming.calls == [("set", 0)] and torch.equal(resuming.states[0], torch.arange(16, dtype=torch.uint8))


def test_an_old_checkpoints_list_of_cuda_streams_still_loads(monkeypatch):
    """Checkpoints before held every visible GPU's stream: local rank r ran on GPU r when it
    saw more than r of them, else on the one it saw; that entry is restored on the rank's
    device now. None matching (a list of 2 for local rank 3): the stream is left as it is."""
    from trainer.checkpoint.rng import rng_state, set_rng_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    host = rng_state(torch.device("cpu"))
    streams = [[k] * 16 for k in range(4)]
    for entries, local_rank, device, expected in [
        (streams, 3, 0, 3),
        (streams, 1, 1, 1),
        (streams[:1], 5, 0, 0),
        (streams[:2], 3, 0, None),
    ]:
        resuming = CudaRandomStates(visible=2).install(monkeypatch)
        set_rng_state({**host, "cuda": entries}, torch.device("cuda", device), local_rank=local_rank)
        if expected is None:
            assert resuming.calls == []
        else:
            assert resuming.calls == [("set", device)]
            assert resuming.states[device].tolist() == [expected] * 16


def test_a_gpu_rank_logs_allocated_and_reserved_peaks_a_cpu_rank_its_peak_rss(monkeypatch):
    """mem_gb is the CUDA allocator's peak of live tensors (plan's ledger); mem_reserved_gb adds
    what it keeps cached; both of the rank's own device, both reset for the next record. A
    CPU rank logs its peak resident set size alone."""
    from trainer.train.meters import peak_memory

    calls = []

    def peak(name, nbytes):
        def read(device):
            calls.append((name, torch.device(device).index))
            return nbytes

        return read

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", peak("allocated", 3 * 2**30))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", peak("reserved", 5 * 2**29))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", peak("reset", None))
    assert peak_memory(torch.device("cuda", 2)) == {"mem_gb": 3.0, "mem_reserved_gb": 2.5}
    assert sorted(calls) == [("allocated", 2), ("reserved", 2), ("reset", 2)] and calls[-1][0] == "reset"
    cpu = peak_memory(torch.device("cpu"))
    assert list(cpu) == ["mem_gb"] and cpu["mem_gb"] > 0.05


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_a_gpu_rank_reads_pinned_batches_a_cpu_rank_pageable(monkeypatch):
    """Batches bound for a GPU are read into page-locked memory (the DataLoader's pin_memory), so
    `.to(device, non_blocking=True)` copies them asynchronously; from pageable memory the copy
    is staged and waits. Not on a CPU rank, where pinning has no accelerator to pin for. Both
    with worker processes and without."""
    from torch.utils import data as torch_data

    from trainer.parallel.ranks import DistEnv
    from trainer.train.task import LMTask

    loaders = []

    class RecordingLoader(torch_data.DataLoader):
        def __init__(self, *args, **kwargs):
            loaders.append(kwargs.get("pin_memory", False))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch_data, "DataLoader", RecordingLoader)
    # (device, --num-workers, pin_memory of each DataLoader made): none on a CPU rank without workers
    for device, workers, pinned in [("cuda", 1, [True]), ("cuda", 0, [True]), ("cpu", 1, [False]), ("cpu", 0, [])]:
        cfg = compose(DUMMY + ["--batch-size", "4", "--num-workers", str(workers)])
        task = LMTask(cfg, DistEnv(0, 1, 0, 1, torch.device(device, 0) if device == "cuda" else torch.device(device)))
        loaders.clear()
        batch = next(task.batch_iterator(cfg.dataset.train_subset, training=True).next_epoch_itr())
        assert batch["src_tokens"].shape == (4, 32)  # read (pinned where an accelerator is)
        assert loaders == pinned, (device, workers, loaders)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
def test_a_gpu_eval_lm_reads_pinned_batches_a_cpu_one_pageable(monkeypatch):
    """eval-lm reads its blocks as training does: pinned for a GPU rank, with workers or without."""
    from pathlib import Path
    from types import SimpleNamespace

    from torch.utils import data as torch_data

    from data.indexed_dataset import IndexedDataset
    from data.token_block import TokenBlockDataset
    from trainer.inference.eval_lm import eval_batches
    from trainer.parallel.ranks import DistEnv

    loaders = []

    class RecordingLoader(torch_data.DataLoader):
        def __init__(self, *args, **kwargs):
            loaders.append(kwargs.get("pin_memory", False))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(torch_data, "DataLoader", RecordingLoader)
    valid = IndexedDataset(str(Path(__file__).parent / "fixtures" / "fairseq" / "data-bin" / "valid"))
    blocks = TokenBlockDataset(valid, 32, "none", pad=1, eos=2)
    for device, workers, pinned in [("cuda", 1, [True]), ("cuda", 0, [True]), ("cpu", 1, [False]), ("cpu", 0, [])]:
        args = SimpleNamespace(batch_size=4, max_tokens=None, context_window=0, num_workers=workers)
        env = DistEnv(0, 1, 0, 1, torch.device(device, 0) if device == "cuda" else torch.device(device))
        loaders.clear()
        batch = next(eval_batches(blocks, args, 1, None, env).next_epoch_itr())
        assert batch["src_tokens"].shape == (4, 32)
        assert loaders == pinned, (device, workers, loaders)


def test_eval_lm_reads_its_summed_loss_once_not_every_batch(monkeypatch):
    """Each `.item()` makes the host wait for the GPU: eval-lm sums the batches' losses on the
    device (float64, as Python's float sum was) and reads the sum once, at the end."""
    from pathlib import Path
    from types import SimpleNamespace

    from data.indexed_dataset import IndexedDataset
    from data.token_block import TokenBlockDataset
    from trainer.inference.eval_lm import evaluate
    from trainer.parallel.ranks import DistEnv

    losses = []

    def model(src_tokens, target, softmax_batch=None, segments=None):
        losses.append(torch.tensor(1 / 3 + 0.7 * len(losses), dtype=torch.float32))  # not exact in float32
        return losses[-1]

    reads, item = [], torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    valid = IndexedDataset(str(Path(__file__).parent / "fixtures" / "fairseq" / "data-bin" / "valid"))
    blocks = TokenBlockDataset(valid, 32, "none", pad=1, eos=2)
    args = SimpleNamespace(batch_size=4, max_tokens=None, context_window=0, num_workers=0, no_progress_bar=True)
    loss_sum, ntokens = evaluate(model, blocks, args, 1, None, DistEnv(0, 1, 0, 1, torch.device("cpu")))
    assert len(losses) > 3 and len(reads) == 1
    expected = 0.0
    for loss in losses:
        expected += float(loss)  # what summing .item() per batch gave
    assert loss_sum == expected and isinstance(loss_sum, float) and ntokens > 0
