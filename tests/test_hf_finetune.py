"""`train DATA --finetune-from-model HF_DIR`: a Hugging Face Llama or Qwen3 model fine-tuned
with FSDP. Its first loss is the one transformers computes (the weights loaded, every rank
its rows), 2 sharded ranks train as one process does, a stopped run resumes from its own
checkpoint, and a flag or data that does not fit the model is refused before anything is
written.

The models are tiny and random (every parameter drawn, norms included, so a weight left at
its initial value shows), the data exactly BLOCKS blocks: one update's batch is all of it,
so transformers scores the same batch."""

import json
import random
import shutil

import pytest

from helpers import byte_level_tokenizer, compose, preprocess_options, train_updates

TOKENS_PER_SAMPLE = 32
BLOCKS = 8  # one process: --batch-size 8; 2 ranks: 4 each. Every update sees every block.
UPDATES = 5
WORDS = "the a fox dog runs jumps over under lazy quick brown red cat sees big small tree house".split()


def save_hf_model(path, tok, kind, vocab_size, max_shard_size):
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tok.token_to_id("<|eos|>"),
        pad_token_id=tok.token_to_id("<|pad|>"),
    )
    if kind == "llama":  # grouped-query attention, untied output
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=False))
    elif kind == "qwen3":  # q/k norms, heads wider than hidden/heads, tied, a vocabulary padded past the tokenizer's
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    else:  # Qwen3-MoE: 4 experts, 2 a token (no balancing loss: output_router_logits off, as published)
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.ndim > 1 else 1.0)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>", "pad_token": "<|pad|>"}))


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Two HF model dirs sharing one tokenizer, and DATA made by it (`preprocess --tokenizer`)."""
    from data.preprocess import preprocess

    root = tmp_path_factory.mktemp("hf-finetune")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(60)]
    tok = byte_level_tokenizer(lines, ["<|eos|>", "<|pad|>"], vocab_size=280)
    # Text of 226-257 tokens (each line and its eos): BLOCKS blocks of TOKENS_PER_SAMPLE targets.
    kept, tokens = [], 0
    for line in lines:
        n = len(tok.encode(line).ids) + 1
        if tokens + n > BLOCKS * TOKENS_PER_SAMPLE + 1:
            break
        kept.append(line)
        tokens += n
    assert tokens > (BLOCKS - 1) * TOKENS_PER_SAMPLE + 1
    (root / "train.txt").write_text("\n".join(kept) + "\n")
    save_hf_model(root / "llama", tok, "llama", tok.get_vocab_size(), "40KB")  # a dozen shard files
    save_hf_model(root / "qwen3", tok, "qwen3", tok.get_vocab_size() + 12, "5GB")
    assert len(list((root / "llama").glob("model-*.safetensors"))) > 4
    preprocess(
        preprocess_options(
            [
                "--trainpref",
                str(root / "train.txt"),
                "--destdir",
                str(root / "data"),
                "--tokenizer",
                str(root / "llama"),
            ]
        )
    )
    return root


def argv(hf, model, *extra, batch_size=BLOCKS):
    """train's command line for the model dir hf/model (or the dir `model`)."""
    return [
        str(hf / "data"),
        "--finetune-from-model",
        str(hf / model),
        "--tokens-per-sample",
        str(TOKENS_PER_SAMPLE),
        "--batch-size",
        str(batch_size),
        "--required-batch-size-multiple",
        "1",
        "--optimizer",
        "adam",
        "--lr",
        "0.002",
        "--clip-norm",
        "0.5",
        "--max-update",
        str(UPDATES),
        "--no-save",
        "--disable-validation",
        *extra,
    ]


def transformers_loss(hf, model):
    """Mean cross-entropy (nats) transformers' own model gives the data's BLOCKS blocks."""
    import torch
    import transformers

    from data.indexed_dataset import IndexedDataset
    from data.iterator import collate
    from data.token_block import TokenBlockDataset
    from data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hf / "data")
    blocks = TokenBlockDataset(
        IndexedDataset(str(hf / "data" / "train")), TOKENS_PER_SAMPLE, "none", pad=tokenizer.pad, eos=tokenizer.eos
    )
    assert len(blocks) == BLOCKS
    batch = collate([blocks[i] for i in range(len(blocks))], tokenizer.pad)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf / model, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(batch["src_tokens"]).logits  # right-padded: causal, pads come last
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), batch["target"].flatten(), ignore_index=tokenizer.pad, reduction="sum"
    )
    return loss.item() / batch["ntokens"]


def losses(updates):
    return [updates[n][0] for n in sorted(updates)]


def gnorms(updates):
    return [updates[n][1] for n in sorted(updates)]


@pytest.fixture(scope="module")
def one_process(hf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-process")
    return {model: train_updates(argv(hf, model), 1, tmp) for model in ("llama", "qwen3")}


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_first_loss_is_transformers(hf, one_process, model):
    """The first update's loss is computed before any step: it is the HF model's own loss
    on the batch, so every weight (fused q/k/v and gate/up, GQA, q/k norms, tied or not)
    loaded where it belongs. The vocabulary is config.json's (Qwen3's exceeds the data's)."""
    assert one_process[model][1][0] == pytest.approx(transformers_loss(hf, model), rel=1e-5)
    assert losses(one_process[model])[-1] < losses(one_process[model])[0]


@pytest.mark.parametrize("model,flags", [("llama", []), ("qwen3", ["--cpu-offload", "--checkpoint-activations"])])
def test_fsdp_matches_one_process(hf, one_process, tmp_path, model, flags):
    """2 FSDP ranks, each reading only its rows of the HF files, train as one process does
    (test_distributed.py's tolerances)."""
    sharded = train_updates(
        argv(hf, model, "--ddp-backend", "fully_sharded", *flags, batch_size=BLOCKS // 2), 2, tmp_path
    )
    assert losses(sharded) == pytest.approx(losses(one_process[model]), rel=1e-5)
    assert gnorms(sharded) == pytest.approx(gnorms(one_process[model]), rel=1e-5)


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_other_optimizers_fine_tune_sharded_as_one_process(hf, tmp_path, optimizer):
    """Muon (q, k, v, gate and up as the Hugging Face layout's own matrices, each whole on its
    owner rank) and Adafactor (whole-matrix statistics) fine-tune the HF model on 2 FSDP ranks
    as one process does."""
    flags = [a if a != "adam" else optimizer for a in argv(hf, "llama", batch_size=BLOCKS // 2)]
    one = train_updates(flags + ["--batch-size", str(BLOCKS), "--max-update", "3"], 1, tmp_path)
    sharded = train_updates(flags + ["--ddp-backend", "fully_sharded", "--max-update", "3"], 2, tmp_path)
    # Muon's Newton-Schulz runs in bf16, as torch's: a last-bit difference in a gradient (ranks
    # sum it in another order than one process) can round its input the other way
    # (tests/test_muon.py shows the sharded step bitwise equal on equal gradients).
    rel = 3e-5 if optimizer == "muon" else 1e-5
    assert losses(sharded) == pytest.approx(losses(one), rel=rel)
    assert gnorms(sharded) == pytest.approx(gnorms(one), rel=rel)
    assert losses(one)[-1] < losses(one)[0]


def test_bf16_fsdp_matches_one_process(hf, tmp_path):
    ref = losses(train_updates(argv(hf, "llama", "--bf16"), 1, tmp_path))
    sharded = losses(
        train_updates(
            argv(hf, "llama", "--bf16", "--ddp-backend", "fully_sharded", batch_size=BLOCKS // 2), 2, tmp_path
        )
    )
    assert sharded == pytest.approx(ref, rel=2e-2)
    assert sharded[-1] < sharded[0]


def test_resume_continues_the_run(hf, one_process, tmp_path):
    """Stopped after 3 updates and started again with the same command line, the run resumes
    from its checkpoint_last (not from the HF weights again): the uninterrupted run's losses.
    The saved config.yaml names the model by its directory and records its shape."""
    import yaml

    save = ["--save-dir", str(tmp_path / "ck"), "--no-epoch-checkpoints"]
    run = [a for a in argv(hf, "llama") if a != "--no-save"] + save
    first = train_updates(run + ["--max-update", "3"], 1, tmp_path)
    saved = yaml.safe_load((tmp_path / "ck" / "config.yaml").read_text())["model"]
    assert saved["_name"] == str(hf / "llama") and saved["decoder_kv_heads"] == 2 and saved["norm_type"] == "rmsnorm"
    rest = train_updates(run, 1, tmp_path)
    assert sorted(first) == [1, 2, 3] and sorted(rest) == [4, 5]
    assert losses(first) + losses(rest) == pytest.approx(losses(one_process["llama"]), rel=1e-6)
    # The saved config composes again (its model by the directory's config.json): the rerun's.
    cfg = compose(["--config-dir", str(tmp_path / "ck"), "--config-name", "config"])
    assert cfg.model == compose(run).model


def refused(capsys, argv_):
    """(exit status, stderr) of `train` refusing argv_ before any rank starts."""
    from cli import train_main

    capsys.readouterr()  # what came before
    code = train_main(argv_)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return code, err


def test_contradicting_model_flag_refused(hf, capsys, tmp_path):
    save = ["--save-dir", str(tmp_path / "ck")]
    code, err = refused(capsys, argv(hf, "llama", "--decoder-layers", "4", *save))
    assert code == 2 and err == (
        f"train: error: --decoder-layers 4 contradicts {hf / 'llama' / 'config.json'}'s "
        "num_hidden_layers 2; drop the flag"
    )
    code, err = refused(capsys, argv(hf, "qwen3", "model.qk_norm=false", *save))
    assert code == 2 and "--qk-norm false contradicts" in err and "model_type 'qwen3'" in err
    assert not (tmp_path / "ck").exists()


def test_training_keys_stay_settable(hf):
    cfg = compose(argv(hf, "llama", "--dropout", "0.1", "--checkpoint-activations"))
    assert cfg.model.dropout == 0.1 and cfg.model.checkpoint_activations and cfg.model.decoder_layers == 2
    assert compose(argv(hf, "llama")).model.dropout == 0.0  # the published models have none


def test_data_of_another_tokenizer_refused(hf, capsys, tmp_path):
    """Data of sentencepiece, of another tokenizer.json, or with more ids than the model has."""
    from data.preprocess import preprocess

    save = ["--save-dir", str(tmp_path / "ck")]
    spm = tmp_path / "spm"
    preprocess(preprocess_options(["--trainpref", str(hf / "train.txt"), "--destdir", str(spm), "--vocab-size", "60"]))
    code, err = refused(capsys, [str(spm)] + argv(hf, "llama", *save)[1:])
    assert code == 2 and err == (
        f"train: error: DATA {spm} was made by sentencepiece (vocabulary 60); the model's "
        f"vocabulary is 282: preprocess with --tokenizer {hf / 'llama'}"
    )
    other = tmp_path / "other"  # the same model with one more special token in its tokenizer
    shutil.copytree(hf / "qwen3", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 282, "content": "<|extra|>"})
    (other / "tokenizer.json").write_text(json.dumps(tok))
    code, err = refused(capsys, argv(hf, other, *save))
    assert code == 2 and "was made by another tokenizer than" in err and f"--tokenizer {other}" in err
    small = tmp_path / "small"  # config.json's vocabulary smaller than the data's ids
    small.mkdir()
    shutil.copy(hf / "llama" / "tokenizer.json", small)
    (small / "config.json").write_text(
        json.dumps({**json.loads((hf / "llama" / "config.json").read_text()), "vocab_size": 200})
    )
    code, err = refused(capsys, argv(hf, small, *save))
    assert code == 2 and "has a vocabulary of 282, more than the model's 200" in err
    assert not (tmp_path / "ck").exists()


def test_bad_weights_refused_before_save_dir_is_written(hf, tmp_path):
    """A missing shard stops the run in one line while restoring, before config.yaml."""
    from trainer.errors import UsageError
    from trainer.rendezvous import Rendezvous
    from trainer.train import main

    broken = tmp_path / "broken"
    shutil.copytree(hf / "llama", broken)
    shard = sorted(broken.glob("model-*.safetensors"))[3]
    shard.unlink()
    run = [a for a in argv(hf, broken) if a != "--no-save"]
    with pytest.raises(UsageError, match=f"missing shard {shard}"):
        main.run(compose(run + ["--save-dir", str(tmp_path / "ck")]), Rendezvous("", 1))
    assert not (tmp_path / "ck").exists()


def _hf_tensors(path):
    from safetensors.torch import load_file

    return {name: t for f in sorted(path.glob("*.safetensors")) for name, t in load_file(f).items()}


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_import_train_export_round_trip(hf, tmp_path, capsys, model):
    """The way back: HF dir → 2 FSDP ranks → export-model --format hf → transformers. At lr 0
    every tensor comes back bit-identical (the fused q/k/v and gate/up split where they were
    stacked, the shards stitched); after training, transformers computes the logits shardlm
    does from the same checkpoint."""
    import torch
    import transformers

    import cli
    from trainer.inference.load import load_model

    source = _hf_tensors(hf / model)
    for lr, updates in (("0", "1"), ("0.002", str(UPDATES))):
        save, out = tmp_path / f"ck-{lr}", tmp_path / f"hf-{lr}"
        run = [a for a in argv(hf, model, "--ddp-backend", "fully_sharded", batch_size=BLOCKS // 2) if a != "--no-save"]
        train_updates(run + ["--lr", lr, "--max-update", updates, "--save-dir", str(save)], 2, tmp_path)
        assert (
            cli.export_model_main(["--path", str(save / "checkpoint_last"), "--out", str(out), "--format", "hf"]) == 0
        )
        exported = _hf_tensors(out)
        assert sorted(exported) == sorted(source)
        if lr == "0":
            assert all(torch.equal(exported[name], source[name]) for name in source)
            continue
        assert not torch.equal(
            exported["model.layers.0.mlp.gate_proj.weight"], source["model.layers.0.mlp.gate_proj.weight"]
        )  # it trained
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        ours, _, _ = load_model(save / "checkpoint_last")
        tokens = torch.randint(0, 280, (2, TOKENS_PER_SAMPLE), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert (theirs(tokens).logits - ours(tokens)).abs().max().item() < 1e-5
    capsys.readouterr()
