"""Quant-Noise as fairseq 0.12 trains a transformer LM with it (models/quant_noise.py):
--quant-noise-pq drops blocks of weights in training only, as fairseq's hook does, in
fc1, fc2 and fairseq's quant_noise layer on the embeddings; --quant-noise-scalar makes
weights int8 values in training with fairseq's probability and all of them, outputs too,
in evaluation. The draws do not depend on sharding, and activation checkpointing's
recompute draws what the forward drew."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import DUMMY, compose, multi_rank_losses, train_here, update_losses
from models.quant_noise import UPDATE_STEP, NoisyEmbedding, NoisyLinear, pq_noise

PQ = ["--quant-noise-pq", "0.1"]
SCALAR = ["--quant-noise-scalar", "0.5"]


def fairseq_pq_hook(weight, p, block_size):
    """fairseq/modules/quant_noise.py's _forward_pre_hook on a Linear, as the weight it
    leaves (it draws from the global random state)."""
    in_features, out_features = weight.size(1), weight.size(0)
    mask = torch.zeros(in_features // block_size * out_features, device=weight.device)
    mask.bernoulli_(p)
    mask = mask.repeat_interleave(block_size, -1).view(-1, in_features)
    return 1 / (1 - p) * weight.masked_fill(mask.to(torch.bool), 0)


def test_pq_noise_drops_whole_blocks_in_training_only():
    """Training: each row's blocks of B inputs are all zero or all scaled by 1/(1-p), about
    p of them dropped, the very weights fairseq's hook leaves for the same random draws;
    the gradient reaches every weight as the noised weight's. Evaluation: the plain layer."""
    p, B = 0.25, 8
    layer = NoisyLinear(64, 96, pq=p, block_size=B)
    w = layer.weight.detach()
    seed = 1234
    noised = pq_noise(layer.weight, p, B, torch.Generator().manual_seed(seed)).detach()
    torch.manual_seed(seed)
    assert torch.equal(noised, fairseq_pq_hook(w, p, B))
    blocks, kept = noised.view(96, 64 // B, B), (w * (1 / (1 - p))).view(96, 64 // B, B)
    dropped = (blocks == 0).all(-1)
    assert torch.equal(blocks[~dropped], kept[~dropped])
    assert abs(dropped.float().mean().item() - p) < 0.06

    x = torch.randn(3, 5, 64)
    layer.noise_seed = seed
    y = layer.train()(x)
    assert torch.equal(y, F.linear(x, noised, layer.bias))
    y.square().sum().backward()
    expected = (2 * y.detach()).flatten(0, 1).T @ x.flatten(0, 1)  # d/dW of the noised layer, unmasked
    assert torch.allclose(layer.weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.eval()(x), F.linear(x, layer.weight, layer.bias))


def test_the_layers_fairseq_noises():
    """fc1 and fc2 are noised; attention's projections are not: fairseq's MultiheadAttention
    gives their weights to F.multi_head_attention_forward, around their hooks. fairseq's
    quant_noise layer (dim x dim, no bias, nn.Linear's own init) is applied to the scaled
    embeddings, in evaluation too, before the positions are added."""
    from models.transformer_lm import build_model, sinusoidal_positions

    cfg = compose(DUMMY + PQ + ["--batch-size", "4"])
    model = build_model(cfg.model, 256, 32, seed=1)
    layer = model.layers[0]
    assert [type(m) for m in (layer.fc1, layer.fc2, layer.qkv_proj, layer.out_proj)] == [
        NoisyLinear,
        NoisyLinear,
        torch.nn.Linear,
        torch.nn.Linear,
    ]
    names = dict(model.named_parameters())
    assert names["quant_noise.weight"].shape == (64, 64) and "quant_noise.bias" not in names
    assert names["quant_noise.weight"].abs().max() <= 1 / math.sqrt(64)  # kaiming_uniform(a=sqrt(5))
    assert names["quant_noise.weight"].abs().max() > 0.9 / math.sqrt(64)

    tokens = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    embedded = math.sqrt(64) * model.embed_tokens(tokens)
    expected = F.linear(embedded, model.quant_noise.weight) + sinusoidal_positions(32, 64, "cpu", torch.float32)
    assert torch.allclose(model.eval().embed(tokens), expected)
    assert not torch.allclose(model.train().embed(tokens), expected)


@pytest.mark.parametrize("noise", [PQ, PQ + SCALAR], ids=["pq", "pq_scalar"])
def test_checkpointing_recomputes_the_same_noise(noise):
    """--checkpoint-activations recomputes each layer in backward: with the noise of the
    forward (and the int8 ranges), so the gradients are those of the run without it."""
    from types import SimpleNamespace

    from models.transformer_lm import build_model
    from trainer.parallel.parallelize import apply_activation_checkpointing

    cfg = compose(DUMMY + noise + ["--batch-size", "4"])
    tokens = torch.randint(4, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointed in (False, True):
        model = build_model(cfg.model, 256, 32, seed=1)
        with torch.no_grad():  # int8 ranges of other tokens, which the next forward's recompute
            model.eval()(tokens[:, 1:])  # would estimate afresh if it counted as a forward
        for _, module in model._noisy:
            if getattr(module, "scalar", None):
                module.scalar.forwards = UPDATE_STEP - 1
        model.train()
        if checkpointed:
            apply_activation_checkpointing(model, False, SimpleNamespace(device=torch.device("cpu"), is_master=True))
        model(tokens[:, :-1], target=tokens[:, 1:], noise_seed=7).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
    assert not torch.equal(grads[0]["layers.0.fc1.weight"], torch.zeros_like(grads[0]["layers.0.fc1.weight"]))


@pytest.mark.parametrize("noise", [PQ, SCALAR], ids=["pq", "scalar"])
def test_training_with_quant_noise_lowers_the_loss(noise, capfd):
    # No data loader process: on 2 cores it would take turns with training.
    flags = ["--batch-size", "8", "--max-update", "12", "--log-format", "json", "--log-interval", "1"]
    records, _ = train_here(DUMMY + noise + flags + ["--num-workers", "0"], capfd)
    losses = [float(r["loss"]) for r in records["train_inner"]]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.2


def test_two_fsdp_ranks_draw_what_one_process_draws(tmp_path):
    """The same update on 2 FSDP ranks, 2 micro-batches each, layers recomputed in backward,
    as in one process: each micro-batch's masks are the same on every rank, and the
    quant_noise layer's weight, in the root, is not needed in backward."""
    base = DUMMY + PQ + ["--clip-norm", "0.5", "--update-freq", "2", "--num-workers", "0"]
    # the ranks' batches, two at a time: each micro-batch holds what rank 0's and rank 1's hold
    ref = update_losses(base + ["--batch-size", "2"], 3, merge=2)
    flags = ["--batch-size", "2", "--ddp-backend", "fully_sharded", "--checkpoint-activations"]
    losses, _ = multi_rank_losses(base + flags, 2, 3, tmp_path)
    assert losses == pytest.approx(ref, rel=1e-5)


def test_adaptive_input_bands_must_be_whole_blocks():
    """fairseq noises each adaptive input band's projection: its width must be whole blocks."""
    from trainer.config.checks import check_adaptive_vocab
    from trainer.errors import UsageError

    flags = ["--adaptive-input", "--adaptive-input-cutoff", "100", "--adaptive-input-factor", "8", "--batch-size", "4"]
    model_cfg = compose(DUMMY + PQ + flags).model  # bands 64 and 8 wide
    check_adaptive_vocab(model_cfg, 256)
    model_cfg.quant_noise_pq_block_size = 16
    with pytest.raises(UsageError, match="16 does not divide band 1's width 8"):
        check_adaptive_vocab(model_cfg, 256)


def fairseq_int_linear(weight, bias, x, p, training):
    """fairseq's IntLinear forward (histogram method, 8 bits) and the ActivationQuantizer
    quantize_model_ hooks on it (p=0), at a forward that estimates both ranges; its draw
    from the global random state."""
    from torch.ao.quantization.observer import HistogramObserver

    def emulate_int8_histogram(w):
        obs = HistogramObserver()
        obs(w.float())
        scale, zero_point = obs.calculate_qparams()
        scale, zero_point = scale.type_as(w), zero_point.type_as(w)
        return (torch.clamp(torch.round(w / scale + zero_point), 0, 255) - zero_point) * scale, scale, zero_point

    def noised(t, p):
        t_q, scale, zero_point = emulate_int8_histogram(t.detach())
        mask = torch.zeros_like(t)
        mask.bernoulli_(1 - p)
        noise = (t_q - t).masked_fill(mask.bool(), 0)
        low, high = -scale * zero_point, scale * (255 - zero_point)
        return torch.clamp(t, low.item(), high.item()) + noise.detach()

    y = F.linear(x, noised(weight, p if training else 1), bias)
    return noised(y, 0 if training else 1)


def on_int8_grid(t, qparams):
    """The fraction of t's elements that are int8 values of the range `qparams`."""
    scale, zero_point, _, _ = qparams
    steps = t / scale + zero_point
    return ((steps - steps.round()).abs() < 1e-3).float().mean().item()


def test_scalar_noise_is_fairseqs_int_linear():
    """Training: the output of fairseq's IntLinear for the same draws, and its gradients
    (straight through the rounding, not through the clamps); evaluation: int8 weights and
    outputs (fairseq's formula: an output beyond its range lands as far inside it). The
    ranges stay until the UPDATE_STEP-th forward re-estimates them."""
    p, seed = 0.5, 99
    layer = NoisyLinear(64, 32, scalar=p)
    weight = layer.weight.detach().clone().requires_grad_()
    x = torch.randn(4, 7, 64) * 3
    layer.noise_seed = seed
    y = layer.train()(x)
    torch.manual_seed(seed)
    expected = fairseq_int_linear(weight, layer.bias, x, p, training=True)
    assert torch.equal(y, expected)
    y.sum().backward()
    expected.sum().backward()
    assert torch.equal(layer.weight.grad, weight.grad)

    ranges = layer.scalar.weight_qparams
    layer.eval()
    layer.scalar.forwards = UPDATE_STEP  # the next forward estimates the ranges afresh
    y = layer(x)
    assert layer.scalar.weight_qparams is not ranges
    assert torch.equal(y, fairseq_int_linear(weight, layer.bias, x, p, training=False))
    assert on_int8_grid(y, layer.scalar.output_qparams) > 0.9
    ranges = layer.scalar.output_qparams
    layer(x * 2)
    assert layer.scalar.output_qparams is ranges and layer.scalar.forwards == UPDATE_STEP + 2


def test_scalar_noise_takes_the_embeddings_and_the_logits():
    """fairseq's quantize_model_ takes every nn.Embedding and every nn.Linear whose forward
    runs: the token table (fairseq's IntEmbedding), fc1, fc2 and the untied output
    projection, whose int8 logits are the ones evaluation scores (all at once, whatever
    --softmax-batch says); attention's projections are not."""
    from models.transformer_lm import build_model

    cfg = compose(DUMMY + SCALAR + ["--batch-size", "4"])
    model = build_model(cfg.model, 256, 32, seed=1).eval()
    layer = model.layers[0]
    assert isinstance(model.embed_tokens, NoisyEmbedding) and isinstance(model.output_projection, NoisyLinear)
    assert [type(m) for m in (layer.fc1, layer.fc2, layer.qkv_proj)] == [NoisyLinear, NoisyLinear, torch.nn.Linear]
    tokens = torch.randint(4, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # a fresh model's first forward estimates the ranges: of the whole logits, chunked or not
        chunked = build_model(cfg.model, 256, 32, seed=1).eval()(tokens[:, :-1], target=tokens[:, 1:], softmax_batch=5)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.view(-1, 256), tokens[:, 1:].reshape(-1), reduction="sum")
        assert torch.allclose(model(tokens[:, :-1], target=tokens[:, 1:]), loss) and torch.allclose(chunked, loss)
    assert on_int8_grid(logits, model.output_projection.scalar.output_qparams) > 0.9


def test_scalar_noise_trains_alike_on_fsdp_and_ddp(tmp_path):
    """Each rank estimates its outputs' int8 ranges from its own batch, as fairseq's ranks
    do, so two ranks are not one process; but FSDP (the root gathered through backward,
    whose clamps read its weights) and DDP compute the same updates."""
    base = DUMMY + PQ + SCALAR + ["--batch-size", "4", "--num-workers", "0"]
    ddp, _ = multi_rank_losses(base, 2, 3, tmp_path)
    fsdp, _ = multi_rank_losses(base + ["--ddp-backend", "fully_sharded"], 2, 3, tmp_path)
    assert fsdp == pytest.approx(ddp, rel=1e-5)
