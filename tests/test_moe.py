"""Mixtures of experts (models/moe.py): Qwen3-MoE and Mixtral models built by transformers
load with their router and experts, give transformers' logits and load-balancing loss,
export back bit for bit, and train on FSDP ranks as one process does, the load-balancing
loss included (its expert counts summed over the ranks: the whole batch's)."""

import tempfile
from pathlib import Path

import pytest

from helpers import assert_resumes_on_the_curve, multi_rank_losses, update_losses

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# 3 layers, the middle one dense (Qwen3-MoE's mlp_only_layers), 6 experts, 2 a token
SHAPES = {
    "qwen3_moe": lambda vocab: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=6,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            output_router_logits=True,
            router_aux_loss_coef=0.3,
        )
    ),
    "mixtral": lambda vocab: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.3,
        )
    ),
}


def hf_model(kind, root, vocab=96):
    torch.manual_seed(0)
    model = SHAPES[kind](vocab)
    for p in model.parameters():  # transformers' 0.02 would route every token alike
        torch.nn.init.normal_(p, std=0.2)
    model.save_pretrained(root / kind)
    return model, root / kind


@pytest.mark.parametrize("kind", SHAPES)
def test_logits_and_load_balancing_loss_equal_transformers(kind, tmp_path):
    from trainer.inference.load import load_model
    from trainer.train.objectives import LoadBalancing

    theirs, path = hf_model(kind, tmp_path)
    ours, cfg, _ = load_model(str(path), "cpu")
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = theirs(ids, labels=ids)
        assert (ours(ids) - out.logits).abs().max() < 1e-5
        ours.train()  # the balancing loss is training's; no dropout in either
        for module in ours.modules():
            if isinstance(getattr(module, "dropout", None), float):
                module.dropout = 0.0
        ours(ids)
    loss, sums = LoadBalancing(cfg, None)(ours, torch.zeros(()), 22)
    assert cfg.model.moe_aux_loss_coef == pytest.approx(0.3)
    assert sums[0].item() / 22 == pytest.approx(out.aux_loss.item(), rel=1e-5)
    # each sparse layer's busiest expert over the mean one, from transformers' router logits
    for load, logits in zip(sums[1:].tolist(), out.router_logits):
        chosen = torch.topk(logits.softmax(-1), 2, dim=-1).indices.flatten()
        counts = torch.bincount(chosen, minlength=logits.shape[-1]).double()
        assert load / 22 == pytest.approx((counts.max() / counts.mean()).item(), rel=1e-6)
    assert loss.item() == pytest.approx(0.3 * out.aux_loss.item() * 22, rel=1e-5)


def test_greedy_tokens_with_the_kv_cache_are_transformers(tmp_path):
    """Decoding one token at a time through the KV cache routes each new token as the whole
    sequence's forward routes it: transformers' greedy tokens."""
    from models.generate import sample
    from trainer.inference.load import load_model

    theirs, path = hf_model("mixtral", tmp_path)
    ours, _, _ = load_model(str(path), "cpu")
    prompt = [5, 17, 33, 2, 71]
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=None)
    assert sample(ours, prompt, 12, temperature=0) == expected[0, len(prompt) :].tolist()


def test_a_fine_tuned_qwen3_moe_exports_bit_for_bit(tmp_path):
    """train (lr 0) from a Hugging Face Qwen3-MoE, then export-model --format hf: its tensors
    bit for bit, its config's experts."""
    import json

    from safetensors.torch import load_file

    import cli
    from helpers import train_updates

    _, path = hf_model("qwen3_moe", tmp_path)
    train = ["--task", "dummy_lm", "--dict-size", "96", "--dataset-size", "32", "--finetune-from-model", str(path)]
    train += ["--lr", "0", "--optimizer", "sgd", "--max-update", "1", "--save-dir", str(tmp_path / "ckpt")]
    train_updates(train + ["--batch-size", "2", "--tokens-per-sample", "16"], 1, tmp_path)
    export = ["--path", str(tmp_path / "ckpt" / "checkpoint_last"), "--out", str(tmp_path / "out"), "--format", "hf"]
    assert cli.export_model_main(export) == 0
    a, b = load_file(path / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_experts"], config["mlp_only_layers"], config["norm_topk_prob"]) == (6, [1], True)


MOE = ["--arch", "qwen3_moe_30b_a3b", "--decoder-layers", "2", "--decoder-embed-dim", "32"]
MOE += ["--decoder-attention-heads", "4", "--decoder-kv-heads", "2", "--decoder-head-dim", "8"]
MOE += ["--moe-ffn-embed-dim", "16", "--moe-expert-count", "4", "--moe-top-k", "2", "--moe-aux-loss-coef", "0.5"]
RUN = ["--task", "dummy_lm", "--dict-size", "250", "--dataset-size", "256", "--tokens-per-sample", "32"]
RUN += ["--optimizer", "adam", "--lr", "0.003", "--clip-norm", "0.5", "--no-save", "--max-valid-steps", "2"]


def _broken_rank(index, argv, world, port, n_updates, out):
    """A rank whose experts' gradients come out twice what they are."""
    from helpers import _rank_worker
    from trainer.parallel import experts

    def doubled(p):
        local = p.to_local()
        local.register_hook(lambda g: 2 * g)
        return local

    experts._local_rows = doubled
    _rank_worker(index, argv, world, port, n_updates, out)


# (ranks, layout flags, flags one process shares): expert parallelism 2 alone (2 experts a
# rank), and with FSDP 2 (the experts reduce-scattered over the 2 ranks that hold the same
# ones) or HSDP; one process reads what all ranks read, an update's sequences in one batch
FSDP = ["--ddp-backend", "fully_sharded"]
EXPERT_PARALLEL = {
    # with auxiliary-loss-free balancing: the biases moved by every rank's counts alike
    "ep2": (2, FSDP, ["--update-freq", "2", "--moe-router-bias-update-rate", "0.05"]),
    # Muon: each expert's gate, up and down matrices orthogonalised whole by one owner
    "ep2_fsdp2_muon": (4, FSDP, ["--checkpoint-activations", "--optimizer", "muon", "--lr", "0.01"]),
    # Adafactor's row and column statistics of each expert, summed over the expert groups
    # fairseq's FSDP line: fp16's loss scale over both meshes' gradients, parameters on the host
    "ep2_fp16_cpu_offload": (2, FSDP, ["--fp16", "--cpu-offload"]),
    # under tensor parallelism each rank routes its own positions: the experts split over the
    # two ranks of a tensor-parallel group, HSDP's replicas the other data-parallel ranks
    "hsdp2_tp2_ep2_adafactor": (
        4,
        ["--ddp-backend", "hybrid_shard", "--shard-group-size", "2", "--model-parallel-size", "2"],
        ["--optimizer", "adafactor", "--lr", "0.01"],
    ),
    # the router and whole experts of each layer on every rank of the tensor-parallel group,
    # sharded over both by FSDP; the balancing biases moved by both ranks' choices
    "tp2_checkpointed_biased": (
        2,
        [*FSDP, "--model-parallel-size", "2"],
        ["--checkpoint-activations", "--moe-router-bias-update-rate", "0.05"],
    ),
}


@pytest.mark.parametrize("layout", EXPERT_PARALLEL)
def test_expert_and_tensor_parallelism_train_the_mixture_one_process_trains(layout, tmp_path):
    world, parallel, shared = EXPERT_PARALLEL[layout]
    tp = 2 if "--model-parallel-size" in parallel else 1  # its ranks read the same samples
    ref_loss, ref_gnorm = update_losses(
        RUN + MOE + ["--batch-size", "2", *FSDP, *shared], 3, with_gnorm=True, merge=world // tp
    )
    experts = [] if layout.startswith("tp2") else ["--expert-parallel-size", "2"]
    argv = RUN + MOE + ["--batch-size", "2", *parallel, *shared, *experts]
    loss, gnorm = multi_rank_losses(argv, world, 3, tmp_path)
    tol = 1e-3 if "--fp16" in shared else 1e-5  # fp16's rounding, in another summation order
    assert loss == pytest.approx(ref_loss, rel=tol) and gnorm == pytest.approx(ref_gnorm, rel=tol)
    if layout == "ep2":  # the experts' gradients at twice their scale: not what one process trains
        import json

        from helpers import run_ranks
        from trainer.rendezvous import free_port

        run_ranks(_broken_rank, (argv, world, free_port(), 3, str(tmp_path / "broken")), world)
        broken = json.loads((tmp_path / "broken.0").read_text())
        assert broken["gnorms"] != pytest.approx(ref_gnorm, rel=1e-3)


def test_fsdp_trains_the_mixture_one_process_trains():
    """2 FSDP ranks, each half of every batch: loss (the load-balancing term at 0.5 included)
    and gradient norm of one process reading both halves. Summing each rank's own balancing
    loss instead of the whole batch's is 1e-2 off."""
    argv = RUN + MOE + ["--batch-size", "2", "--ddp-backend", "fully_sharded"]
    ref_loss, ref_gnorm = update_losses(argv, 3, with_gnorm=True, merge=2)
    loss, gnorm = multi_rank_losses(argv, 2, 3, Path(tempfile.mkdtemp()))
    assert loss == pytest.approx(ref_loss, rel=1e-5) and gnorm == pytest.approx(ref_gnorm, rel=1e-5)
    assert ref_loss[-1] < ref_loss[0]


def test_a_hugging_face_mixture_loads_into_expert_shards(tmp_path):
    """--finetune-from-model into EP 2 (each rank reading its own experts' rows of the
    per-expert tensors; a dense layer between the sparse ones): one process's training."""
    _, path = hf_model("qwen3_moe", tmp_path)
    argv = ["--task", "dummy_lm", "--dict-size", "96", "--dataset-size", "64", "--tokens-per-sample", "16"]
    argv += ["--finetune-from-model", str(path), "--optimizer", "adam", "--lr", "0.001", "--no-save"]
    argv += ["--batch-size", "2", *FSDP, "--max-valid-steps", "1"]
    ref_loss, ref_gnorm = update_losses(argv, 3, with_gnorm=True, merge=2)
    loss, gnorm = multi_rank_losses(argv + ["--expert-parallel-size", "2"], 2, 3, tmp_path)
    assert loss == pytest.approx(ref_loss, rel=1e-5) and gnorm == pytest.approx(ref_gnorm, rel=1e-5)


# 4 sequences an update on every layout, in micro-batches of other sizes: without the
# balancing term, whose batch statistics depend on them, the loss is the same on each
RESUMED_ON = {
    "one_process": (1, ["--batch-size", "2", "--update-freq", "2"]),
    "ep4": (4, ["--batch-size", "1", *FSDP, "--expert-parallel-size", "4"]),
}
SAVED = [a for a in RUN + MOE if a != "--no-save"] + ["--required-batch-size-multiple", "1", "--moe-aux-loss-coef", "0"]
SAVED += ["--moe-router-bias-update-rate", "0.05"]  # the routers' biases resume with the weights


@pytest.fixture(scope="module")
def saved_on_ep2(tmp_path_factory):
    """4 updates at EP 2 (2 ranks), saved; and 8 updates of one process, not stopped."""
    from helpers import train_updates

    tmp = tmp_path_factory.mktemp("ep2")
    flags = ["--batch-size", "2", *FSDP, "--expert-parallel-size", "2"]
    first = train_updates(SAVED + flags + ["--max-update", "4", "--save-dir", str(tmp / "ckpt")], 2, tmp)
    whole = train_updates(SAVED + RESUMED_ON["one_process"][1] + ["--max-update", "8", "--no-save"], 1, tmp)
    return first, whole, tmp / "ckpt"


@pytest.mark.parametrize("layout", RESUMED_ON)
def test_an_expert_parallel_checkpoint_resumes_on_any_layout(layout, saved_on_ep2, tmp_path):
    """Saved at EP 2, resumed at one process (EP 1) and at EP 4: the curve of a run never
    stopped (the checkpoint holds every expert's rows in order, the routers' balancing
    biases, and the data position)."""
    first, whole, saved = saved_on_ep2
    world, flags = RESUMED_ON[layout]
    assert_resumes_on_the_curve(saved, SAVED + flags, world, tmp_path, first, whole)


def test_serve_answers_the_openai_client_with_the_mixture(tmp_path, capsys):
    """serve on a Qwen3-MoE with its tokenizer: two concurrent completions (a batch of rows in
    the KV cache, each routed on its own) are generate's greedy text; so is generate's with
    the model split over 2 tensor-parallel ranks, each routing its own positions."""
    import json
    import random
    import subprocess
    import sys
    import threading

    from test_serve import _start, _wait_healthy

    import cli
    from helpers import byte_level_tokenizer
    from trainer.rendezvous import free_port

    openai = pytest.importorskip("openai")
    words = "the a fox dog runs jumps over lazy quick brown cat sees big tree house".split()
    rng = random.Random(0)
    tok = byte_level_tokenizer([" ".join(rng.choices(words, k=6)) for _ in range(40)], ["<|eos|>", "<|pad|>"])
    _, path = hf_model("qwen3_moe", tmp_path, vocab=tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "pad_token": "<|pad|>"}))
    prompts = ["the quick brown fox", "a lazy dog sees"]
    expected = []
    for prompt in prompts:
        capsys.readouterr()
        argv = ["--path", str(path), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "10"]
        assert cli.generate_main(argv) == 0
        expected.append(capsys.readouterr().out.rstrip("\n"))
    split = subprocess.run(
        [str(Path(sys.executable).with_name("generate")), *argv, "--model-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (split.returncode, split.stdout) == (0, expected[-1] + "\n"), split.stderr
    port = free_port()
    proc = _start(path, port, "--max-batch", "2")
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        texts = [None, None]

        def complete(i):
            out = client.completions.create(model=path.name, prompt=prompts[i], max_tokens=10, temperature=0)
            texts[i] = prompts[i] + out.choices[0].text

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert texts == expected
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_balancing_biases_are_refused_by_the_hugging_face_export():
    from helpers import compose
    from trainer.formats.hf.llama import hf_model_type, llama_incompatibility

    cfg = compose(RUN + MOE + ["--batch-size", "2"])
    assert llama_incompatibility(cfg.model) is None and hf_model_type(cfg.model) == "qwen3_moe"
    cfg = compose(RUN + MOE + ["--batch-size", "2", "--moe-router-bias-update-rate", "0.01"])
    assert "balancing biases" in llama_incompatibility(cfg.model)


def test_the_grouped_matmul_branch_is_the_per_expert_one(monkeypatch):
    """CUDA's one grouped matmul over the experts (torch._grouped_mm, bf16), taken here on a
    CPU (forward: torch has its kernel there too): each expert's run of rows, an empty one
    among them, gives what one matmul per expert gives."""
    from models import moe

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 7, 4])
    x = torch.randn(16, 32, generator=g).bfloat16()
    fc1, fc2 = torch.randn(4 * 2 * 8, 32, generator=g).bfloat16(), torch.randn(4 * 32, 8, generator=g).bfloat16()
    act = torch.nn.functional.silu
    with torch.no_grad():
        looped = moe.expert_ffn(x, fc1, fc2, counts, act)
        monkeypatch.setattr(moe, "grouped_mm_runs", lambda x, w: True)
        grouped = moe.expert_ffn(x, fc1, fc2, counts, act)
    assert torch.allclose(grouped.float(), looped.float(), rtol=2e-2, atol=2e-2)
