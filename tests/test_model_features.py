"""fairseq's model options beyond the plain transformer: LayerDrop, pruning with
--decoder-layers-to-keep, NormFormer, relu_squared and embeddings/outputs of another
width, and the Llama family's pieces. Each trains the same on FSDP and DDP ranks as in one process, resumes exactly,
and a LayerDrop-trained checkpoint evaluates with fewer layers."""

import pytest
import torch

from helpers import DUMMY, compose, multi_rank_losses, train_updates, update_losses
from trainer.errors import UsageError

UPDATES = 5
BASE = DUMMY + ["--clip-norm", "0.5"]
SAVE = [a for a in BASE if a != "--no-save"]
FEATURES = {
    # 4 layers, each skipped with probability 1/2; with --seed 18 updates 1 and 3 skip all
    # four, and layers 1 and 3 run first in update 4
    "layerdrop": ["--decoder-layers", "4", "--decoder-layerdrop", "0.5", "--seed", "18"],
    "normformer": ["--scale-attn", "--scale-fc", "--scale-heads", "--scale-resids"],
    "relu_squared": ["--activation-fn", "relu_squared"],
    "widths": ["--decoder-input-dim", "48", "--decoder-output-dim", "80"],
    # the Llama family's pieces: 2 query heads of width 24 on 1 key/value head, rotary
    # embeddings scaled as Llama 3.1's (an original context of 16 < 32 tokens, so the
    # scaling acts), gated feed-forward, RMSNorm, Qwen3's q/k norms, no biases
    "llama": [
        "--norm-type",
        "rmsnorm",
        "--gated-ffn",
        "--decoder-kv-heads",
        "1",
        "--decoder-head-dim",
        "24",
        "--no-bias",
        "--qk-norm",
        "--rope",
        "--rope-scaling",
        "llama3",
        "--rope-original-max-positions",
        "16",
    ],
}
EVERY = [a for flags in FEATURES.values() for a in flags]  # all at once: 4 runs of 2 ranks, not 16
BACKENDS = {  # 2 ranks; one process runs each micro-batch of both ranks' sequences as one
    "ddp": ["--batch-size", "4"],
    "fsdp": ["--batch-size", "4", "--ddp-backend", "fully_sharded"],
    "legacy_ddp": ["--batch-size", "4", "--ddp-backend", "legacy_ddp"],
    "fsdp_update_freq_checkpoint": [
        "--batch-size",
        "2",
        "--update-freq",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--checkpoint-activations",
    ],
}
_one_process = {}


def one_process(update_freq):
    """Per-update (losses, gnorms) in one process, computed once per module."""
    if update_freq not in _one_process:
        _one_process[update_freq] = update_losses(
            BASE + EVERY + ["--batch-size", str(4 // update_freq), "--update-freq", str(update_freq)],
            UPDATES,
            with_gnorm=True,
            merge=2,
        )
    return _one_process[update_freq]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_features_train_as_in_one_process(backend, tmp_path):
    """Every feature at once on 2 ranks: each update's loss and gradient norm are one
    process's. LayerDrop skips the same layers on every rank and in one process, whole
    updates included: DDP must expect unused parameters, and FSDP must neither wait for
    nor reduce a skipped layer."""
    flags = BACKENDS[backend]
    ref_losses, ref_gnorms = one_process(2 if "--update-freq" in flags else 1)
    losses, gnorms = multi_rank_losses(BASE + EVERY + flags, 2, UPDATES, tmp_path)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert gnorms == pytest.approx(ref_gnorms, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]


def test_normformer_and_widths_are_placed_as_in_fairseq():
    """fairseq's TransformerDecoderLayerBase: the head scales and attn_ln act on the attention
    block's output after out_proj, ffn_layernorm between the activation and fc2, w_resid on
    the feed-forward residual; TransformerDecoder scales the embeddings by
    sqrt(decoder_embed_dim), then projects them, then adds positions."""
    import math

    import torch.nn.functional as F

    from models.transformer_lm import build_model, sinusoidal_positions

    cfg = compose(BASE + FEATURES["normformer"] + FEATURES["widths"] + FEATURES["relu_squared"] + ["--batch-size", "4"])
    model = build_model(cfg.model, 256, 32, seed=1)
    with torch.no_grad():  # scales and norms away from their initial 1 and 0
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    layer, (B, T, C, H) = model.layers[0], (2, 32, 64, 2)
    tokens = torch.randint(4, 256, (B, T), generator=torch.Generator().manual_seed(0))
    x = model.embed(tokens)
    projected = F.linear(math.sqrt(C) * model.embed_tokens(tokens), model.project_in_dim.weight)
    assert torch.allclose(x, projected + sinusoidal_positions(T, C, x.device, x.dtype))

    h = layer.self_attn_layer_norm(x)
    q, k, v = layer.qkv_proj(h).view(B, T, 3, H, C // H).transpose(1, 3).unbind(2)
    h = layer.out_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
    h = layer.attn_ln((h.view(B, T, H, C // H) * layer.c_attn[:, None]).view(B, T, C))
    residual = x + h
    h = layer.fc2(layer.ffn_layernorm(F.relu(layer.fc1(layer.final_layer_norm(residual))) ** 2))
    assert torch.allclose(layer(x), layer.w_resid * residual + h, atol=1e-5)
    for layer in model.layers:
        x = layer(x)
    logits = F.linear(model.project_out_dim(model.layer_norm(x)), model.output_projection.weight)  # 80 wide
    assert torch.allclose(model(tokens), logits, atol=1e-5)


def _gathers_rank(index, world, port, out):
    """Per micro-batch: the layers FSDP gathered during its forward, and those it ran."""
    import json
    from pathlib import Path

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from data.iterator import grouped
    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    cfg = compose(BASE + FEATURES["layerdrop"] + BACKENDS["fsdp_update_freq_checkpoint"])
    rdv = Rendezvous(f"tcp://127.0.0.1:{port}", world, rank=index, local_rank=index, local_world_size=world)
    env = ranks.init_rank(cfg, rdv, needs_process_group=True)
    try:
        task, trainer, _ = build(cfg, env)
        layer_of = {id(layer._get_fsdp_state()._fsdp_param_group): i for i, layer in enumerate(trainer.model.layers)}
        seen, gathered, unshard, loss_sum = [], None, FSDPParamGroup.unshard, trainer.loss_sum

        def recording_unshard(group, *args, **kwargs):
            if gathered is not None and id(group) in layer_of:
                gathered.add(layer_of[id(group)])
            return unshard(group, *args, **kwargs)

        def recording_forward(batch, layers=None, **kwargs):
            nonlocal gathered
            gathered = set()
            loss = loss_sum(batch, layers, **kwargs)
            seen.append([sorted(gathered), layers])
            gathered = None
            return loss

        FSDPParamGroup.unshard, trainer.loss_sum = recording_unshard, recording_forward
        itr = task.batch_iterator(cfg.dataset.train_subset, training=True)
        for _, samples in zip(range(UPDATES), grouped(itr.next_epoch_itr(), 2)):
            trainer.train_step(samples)
        trainer.finish()
        Path(f"{out}.{index}").write_text(json.dumps(seen))
    finally:
        FSDPParamGroup.unshard = unshard
        ranks.teardown()


def test_fsdp_gathers_only_the_layers_that_run(tmp_path):
    """A layer LayerDrop skips is not all-gathered: the forward prefetch chain (CPU ranks)
    follows the layers each micro-batch runs."""
    import json

    from helpers import run_ranks
    from trainer.rendezvous import free_port

    out = tmp_path / "gathers"
    run_ranks(_gathers_rank, (2, free_port(), str(out)), 2)
    for rank in range(2):
        seen = json.loads(out.with_name(f"gathers.{rank}").read_text())
        assert len(seen) == 2 * UPDATES and any(len(layers) < 4 for _, layers in seen)
        for gathered, layers in seen:
            assert gathered == layers


def _runs_of_each_layer(layerdrop_args, updates):
    """How many of the first `updates` updates run each layer (one micro-batch each)."""
    from models.transformer_lm import build_model
    from trainer.train.trainer import micro_batch_seed

    cfg = compose(BASE + layerdrop_args + ["--batch-size", "4"])
    model = build_model(cfg.model, 256, 32, device="meta")
    runs = [0] * len(model.layers)
    for n in range(updates):
        for i in model.layerdrop_layers(micro_batch_seed(cfg.common.seed, n, 0)):
            runs[i] += 1
    return runs


def test_all_features_resume_exactly(tmp_path):
    """All features at once on 2 FSDP ranks: 3 updates, save, resume to 5 = 5 in one go.
    Layers LayerDrop skipped in all 3 saved updates have no optimizer state yet, and the
    resumed run must step them as such in update 4 (AdamW's first step differs from its
    second), which shows in update 5's loss."""
    assert _runs_of_each_layer(FEATURES["layerdrop"], 3) == [1, 0, 1, 0]
    argv = SAVE + EVERY + ["--batch-size", "4", "--ddp-backend", "fully_sharded"]
    whole = train_updates(argv + ["--max-update", "5", "--no-save"], 2, tmp_path)
    first = train_updates(argv + ["--max-update", "3", "--save-dir", str(tmp_path / "ckpt")], 2, tmp_path)
    second = train_updates(argv + ["--max-update", "5", "--save-dir", str(tmp_path / "ckpt")], 2, tmp_path)
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5]
    for n, (loss, gnorm) in {**first, **second}.items():
        assert (loss, gnorm) == pytest.approx(whole[n], rel=1e-6), f"update {n}"


def test_layerdrop_skips_layers_in_training_only():
    from models.transformer_lm import build_model
    from trainer.train.trainer import micro_batch_seed

    cfg = compose(BASE + FEATURES["layerdrop"] + ["--batch-size", "4"])
    model = build_model(cfg.model, 256, 32, seed=1)
    draws = [model.layerdrop_layers(micro_batch_seed(18, n, i)) for n in range(50) for i in range(2)]
    assert draws[0] == model.layerdrop_layers(micro_batch_seed(18, 0, 0))  # a seed gives one draw, on every rank
    kept = sum(len(d) for d in draws) / (4 * len(draws))
    assert 0.4 < kept < 0.6 and len({tuple(d) for d in draws}) > 8
    layers = next(d for d in draws if 0 < len(d) < 4)
    tokens = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model.train()
    model(tokens, target=tokens, layers=layers).backward()
    for i, layer in enumerate(model.layers):  # a skipped layer gets no gradient (AdamW then skips it)
        assert all((p.grad is None) == (i not in layers) for p in layer.parameters()), i
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens, layers=layers), model(tokens))  # evaluation runs every layer
    # The trainer passes its draw: the first update (which skips every layer) has not the
    # loss of all 4 layers.
    dropping = update_losses(BASE + FEATURES["layerdrop"] + ["--batch-size", "4"], 1)
    keeping = update_losses(BASE + FEATURES["layerdrop"] + ["--decoder-layerdrop", "0", "--batch-size", "4"], 1)
    assert model.layerdrop_layers(micro_batch_seed(18, 0, 0)) == [] and dropping != keeping


def test_a_pruned_model_is_the_layers_it_keeps(tmp_path):
    """A 4-layer LayerDrop checkpoint with decoder_layers_to_keep "0,2" (eval-lm's
    --model-overrides) is the 2-layer model of those layers; --finetune-from-model loads
    the same layers into a pruned run."""
    from models.transformer_lm import build_model
    from trainer.checkpoint.checkpointer import Checkpointer
    from trainer.inference.load import load_model
    from trainer.parallel import ranks
    from trainer.rendezvous import Rendezvous
    from trainer.train.main import build

    save = tmp_path / "ckpt"
    train_updates(
        SAVE + FEATURES["layerdrop"] + ["--batch-size", "4", "--max-update", "3", "--save-dir", str(save)], 1, tmp_path
    )
    full, _, _ = load_model(save / "checkpoint_last")
    # In any order: fairseq sorts the ids too.
    pruned, _, _ = load_model(save / "checkpoint_last", model_overrides={"decoder_layers_to_keep": "2,0"})
    assert len(pruned.layers) == 2
    two = build_model(compose(BASE + ["--decoder-layers", "2", "--batch-size", "4"]).model, 256, 32)
    weights = {n: t for n, t in full.state_dict().items() if not n.startswith("layers.")}
    for i, j in enumerate([0, 2]):
        weights.update({f"layers.{i}.{n}": t for n, t in full.layers[j].state_dict().items()})
    two.load_state_dict(weights)
    two.eval()
    tokens = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(pruned(tokens), two(tokens))
        assert not torch.equal(pruned(tokens), full(tokens))

    ft = compose(
        BASE
        + FEATURES["layerdrop"]
        + [
            "--decoder-layers-to-keep",
            "0,2",
            "--batch-size",
            "4",
            "--finetune-from-model",
            str(save / "checkpoint_last"),
        ]
    )
    env = ranks.init_rank(ft, Rendezvous("", 1), needs_process_group=False)
    try:
        task, trainer, _ = build(ft, env)
        Checkpointer(ft, env, trainer.model, trainer.optimizer).restore()
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), weights[name]), name
    finally:
        ranks.teardown()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--decoder-layers-to-keep", "0,4"], "names a layer outside 0-3"),
        (["--decoder-layers-to-keep", "1,1"], "names a layer twice"),
        (["--decoder-layers-to-keep", "0;2"], "is not a comma-separated list"),
        (["--decoder-layerdrop", "1"], "--decoder-layerdrop must be in [0, 1)"),
        (["--share-decoder-input-output-embed", "--decoder-input-dim", "32"], "must be equal"),
        (["--quant-noise-pq", "1"], "--quant-noise-pq must be in [0, 1)"),
        (["--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "0"], "block-size must be at least 1"),
        (["--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "48"], "48 does not divide --decoder-embed-dim 64"),
        (
            ["--quant-noise-pq", "0.1", "--quant-noise-pq-block-size", "16", "--decoder-ffn-embed-dim", "100"],
            "16 does not divide --decoder-ffn-embed-dim 100",
        ),
        (["--quant-noise-pq", "0.1", "--decoder-input-dim", "32"], "--decoder-input-dim 32 must equal it"),
        (["--quant-noise-scalar", "1.5"], "--quant-noise-scalar must be in [0, 1]"),
        (
            ["--quant-noise-scalar", "0.1", "--adaptive-input", "--adaptive-input-cutoff", "100"],
            "--quant-noise-scalar with an adaptive input or softmax is not built",
        ),
    ],
)
def test_bad_model_features_are_refused(flags, message):
    with pytest.raises(UsageError, match=None) as e:
        compose(DUMMY + ["--decoder-layers", "4", "--batch-size", "4"] + flags)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rmsnorm_is_torchs_forward_and_backward():
    """models/transformer_lm.py's RMSNorm has a backward of its own (torch's is a chain of
    small ops on a CPU): its values and gradients are torch's nn.RMSNorm's, and float64
    gradcheck passes."""
    from models.transformer_lm import RMSNorm, _RMSNormFunction

    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, eps=1e-6), torch.nn.RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 48)
    grad = torch.randn(3, 5, 48)
    outputs, grads = [], []
    for norm in (ours, theirs):
        xi = x.clone().requires_grad_()
        out = norm(xi)
        out.backward(grad)
        outputs.append(out)
        grads.append((xi.grad, norm.weight.grad))
    assert torch.allclose(outputs[0], outputs[1], atol=1e-6)
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-5)
    x64 = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-5), (x64, w64))
