"""`train --task sft` and `--task dpo` on small random Llama and Qwen3 models with chat
templates: the first update's loss (and dpo's rewards) equal TRL's SFTTrainer (assistant-only
loss) and DPOTrainer on the same rows; packed and padded conversations give the same loss;
one process == 2 FSDP ranks == 2 FSDP ranks with --update-freq 2; a stopped run resumes
exactly; what does not fit is refused in one line.

The templates are TRL's own training variants of Llama 3's and Qwen3's (with generation
markers, so TRL takes them as they are and its assistant mask is transformers'). One
update's batch holds every row, so TRL's batch (its sampler shuffles) holds the same rows."""

import json
import random
from pathlib import Path

import pytest
from test_hf_finetune import save_hf_model

from helpers import byte_level_tokenizer, preprocess_options, train_update_stats, train_updates

WORDS = "the a fox dog runs jumps over under lazy quick brown red cat sees big small tree house why how".split()
SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|pad|>",
]
TEMPLATES = {
    "llama": ("llama3_training.jinja", "<|eot_id|>"),
    "qwen3": ("qwen3_training.jinja", "<|im_end|>"),
    "qwen3_moe": ("qwen3_training.jinja", "<|im_end|>"),  # a mixture of experts
}
CONVERSATIONS = 24
PAIRS = 8
TOKENS_PER_SAMPLE = 128


def _sentence(rng, lo=2, hi=6):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(rng, n):
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": _sentence(rng)}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):  # one or two exchanges
            messages += [{"role": "user", "content": _sentence(rng)}, {"role": "assistant", "content": _sentence(rng)}]
        rows.append({"messages": messages})
    return rows


def preference_pairs(rng, n):
    return [
        {
            "prompt": [{"role": "user", "content": _sentence(rng)}],
            "chosen": [{"role": "assistant", "content": _sentence(rng)}],
            "rejected": [{"role": "assistant", "content": _sentence(rng, 1, 4)}],
        }
        for _ in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def template_text(name):
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """Per model: an HF dir with the template, a second (the dpo reference, other weights),
    and data dirs of conversations and of preference pairs made by `preprocess`."""
    import torch

    from data.preprocess import preprocess

    root = tmp_path_factory.mktemp("chat")
    rng = random.Random(0)
    rows = {"sft": conversations(rng, CONVERSATIONS), "dpo": preference_pairs(rng, PAIRS)}
    tok = byte_level_tokenizer([_sentence(rng) for _ in range(200)], SPECIALS, vocab_size=300)
    for kind, rows_ in rows.items():
        write_jsonl(root / f"{kind}.jsonl", rows_)
    for model, (template, eos) in TEMPLATES.items():
        for name, seed in ((model, 0), (f"{model}-ref", 1)):
            path = root / name
            save_hf_model(path, tok, model, tok.get_vocab_size() + (12 if model == "qwen3" else 0), "5GB")
            config = {"eos_token": eos, "pad_token": "<|pad|>", "chat_template": template_text(template)}
            if model == "llama":
                config["bos_token"] = "<|begin_of_text|>"
            (path / "tokenizer_config.json").write_text(json.dumps(config))
            if seed:  # the reference: other weights than the policy's
                from safetensors.torch import load_file, save_file

                weights = load_file(path / "model.safetensors")
                g = torch.Generator().manual_seed(seed)
                save_file(
                    {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
                    path / "model.safetensors",
                    metadata={"format": "pt"},
                )
        for kind in ("sft", "dpo"):
            args = ["--trainpref", str(root / f"{kind}.jsonl"), "--destdir", str(root / f"{model}-{kind}")]
            preprocess(preprocess_options(args + ["--tokenizer", str(root / model)]))
    return root, rows


def task_argv(root, model, task, *extra, batch_size):
    """train's command line: the model dir root/model on its data of `task` (sft or dpo), one
    update holding every row by default."""
    task_flags = {
        "sft": [],
        "dpo": ["--dpo-reference", str(root / f"{model}-ref"), "--dpo-beta", "0.2", "--dpo-label-smoothing", "0.1"],
    }
    return [
        str(root / f"{model}-{task}"),
        "--task",
        task,
        "--finetune-from-model",
        str(root / model),
        *task_flags[task],
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
        "--max-update",
        "2",
        "--no-save",
        "--disable-validation",
        # a mixture of experts without its balancing loss, as TRL runs with router_aux_loss_coef 0:
        # the losses compared are the tokens' (tests/test_moe.py compares the balancing loss)
        *(["--moe-aux-loss-coef", "0"] if model.endswith("moe") else []),
        *extra,
    ]


def sft_argv(root, model, *extra, batch_size=CONVERSATIONS):
    return task_argv(root, model, "sft", *extra, batch_size=batch_size)


def dpo_argv(root, model, *extra, batch_size=PAIRS):
    return task_argv(root, model, "dpo", *extra, batch_size=batch_size)


def _tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def trl_sft_loss(root, rows, model, tmp_path):
    """SFTTrainer's loss (nats per target token) on one batch of every conversation."""
    import datasets
    import torch
    import transformers
    import trl

    policy = transformers.AutoModelForCausalLM.from_pretrained(root / model, dtype=torch.float32)
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        per_device_train_batch_size=len(rows),
        max_length=None,
        packing=False,
        report_to="none",
        use_cpu=True,
        router_aux_loss_coef=0.0,
    )
    trainer = trl.SFTTrainer(
        model=policy,
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=_tokenizer(root / model),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch).item()


def trl_dpo(root, rows, model, tmp_path):
    """DPOTrainer's loss and reward metrics on one batch of every pair."""
    import datasets
    import torch
    import transformers
    import trl

    load = lambda name: transformers.AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32)  # noqa: E731
    config = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=0.2,
        loss_type=["sigmoid"],
        per_device_train_batch_size=len(rows),
        max_length=None,
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's default autocasts the reference's forward (not the policy's) to bf16
        router_aux_loss_coef=0.0,
    )
    trainer = trl.DPOTrainer(
        model=load(model),
        ref_model=load(f"{model}-ref"),
        args=config,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=_tokenizer(root / model),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch).item()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}
    return loss, metrics


@pytest.mark.parametrize("model", list(TEMPLATES))
def test_sft_first_loss_is_trl(chat, model, tmp_path):
    """The first update's loss, packed and one conversation per row, is SFTTrainer's with
    assistant_only_loss: the same target tokens, each conversation attending to itself."""
    root, rows = chat
    expected = trl_sft_loss(root, rows["sft"], model, tmp_path)
    packed = train_updates(sft_argv(root, model), 1, tmp_path)
    padded = train_updates(sft_argv(root, model, "--sample-break-mode", "eos"), 1, tmp_path)
    assert packed[1][0] == pytest.approx(expected, rel=1e-5)
    assert padded[1][0] == pytest.approx(expected, rel=1e-5)
    assert packed[1][1] == pytest.approx(padded[1][1], rel=1e-5)  # the same gradients
    assert packed[2][0] < packed[1][0]


# the mixture's DPO: test_split_sequences_or_heads_train_as_one_process (EP 2 against one process)
@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_dpo_first_loss_and_rewards_are_trl(chat, model, tmp_path):
    """The first update's rewards are DPOTrainer's, and its loss is TRL's sigmoid loss plus
    --dpo-label-smoothing's share: -(1-e) log s(m) - e log s(-m) = -log s(m) + e m, with m the
    reward margin (TRL 1.16's sigmoid loss has no smoothing; its cDPO form is the "aot" loss's)."""
    root, rows = chat
    loss, metrics = trl_dpo(root, rows["dpo"], model, tmp_path)
    stats = train_update_stats(dpo_argv(root, model), 1, tmp_path)
    first = {k: v / PAIRS for k, v in stats[1].items()}
    assert stats[1]["nsentences"] == stats[1]["sample_size"] == PAIRS
    assert first["reward_chosen"] == pytest.approx(metrics["rewards/chosen"], rel=1e-5)
    assert first["reward_rejected"] == pytest.approx(metrics["rewards/rejected"], rel=1e-5)
    assert first["reward_correct"] == pytest.approx(metrics["rewards/accuracies"])
    assert first["loss_sum"] == pytest.approx(loss + 0.1 * metrics["rewards/margins"], rel=1e-5)
    assert metrics["rewards/chosen"] != 0  # policy and reference differ
    assert stats[2]["loss_sum"] < stats[1]["loss_sum"]


ARGV = {"sft": sft_argv, "dpo": dpo_argv}
_one_process = {}


def one_process(chat, task, update_freq, tmp_path, model="llama", *extra):
    """{update: (loss, gnorm)} of one process, one sample (pair) per micro-batch."""
    key = (task, update_freq, model, *extra)
    if key not in _one_process:
        argv = ARGV[task](chat[0], model, "--update-freq", str(update_freq), *extra, batch_size=1)
        _one_process[key] = train_updates(argv, 1, tmp_path)
    return _one_process[key]


@pytest.mark.parametrize(
    "task,backend,update_freq",
    [(task, "fully_sharded", 1) for task in ARGV] + [("dpo", "pytorch_ddp", 1)],
)
def test_ranks_train_as_one_process(chat, task, backend, update_freq, tmp_path):
    """2 FSDP ranks take the samples one process takes with twice the --update-freq: the same
    losses and gradient norms. dpo's reference is sharded too (under DDP each rank holds its
    own). (--update-freq 2 on 2 ranks: test_split_sequences_or_heads_train_as_one_process.)"""
    flags = ["--ddp-backend", backend, "--update-freq", str(update_freq)]
    sharded = train_updates(ARGV[task](chat[0], "llama", *flags, batch_size=1), 2, tmp_path)
    expected = one_process(chat, task, 2 * update_freq, tmp_path)
    assert sorted(sharded) == sorted(expected) == [1, 2]
    for n in expected:
        assert sharded[n] == pytest.approx(expected[n], rel=1e-5)


SPLITS = ("--context-parallel-size", "--model-parallel-size", "--expert-parallel-size")
# on a mixture of experts, the experts split over the ranks of a tensor-parallel group, each
# of which routes its own positions; its balancing loss on, which counts no padding
SPLIT_FLAGS = {"--expert-parallel-size": ["--expert-parallel-size", "2", "--model-parallel-size", "2"]}
BALANCED = ["--moe-aux-loss-coef", "0.5"]


@pytest.mark.parametrize("task,parallel", [(task, parallel) for task in ARGV for parallel in SPLITS])
def test_split_sequences_or_heads_train_as_one_process(chat, task, parallel, tmp_path):
    """--context-parallel-size 2: each rank holds half of every row's positions (a chunk
    from each end), packed documents their masks over the whole row, dpo's sequence
    log-likelihoods summed over the two ranks (policy and reference); --model-parallel-size
    2: half of every layer's heads and width, the Hugging Face weights read straight into
    those shards (dpo's reference split as the policy is); --expert-parallel-size 2 ×
    --model-parallel-size 2 (a Qwen3-MoE): half of every layer's heads and half of its
    experts, each rank routing its own positions (padding uncounted in the balancing loss;
    dpo's reference split as the policy is): one process's run."""
    experts = parallel == "--expert-parallel-size"
    model = "qwen3_moe" if experts else "llama"
    balanced = BALANCED if experts else []
    flags = ["--ddp-backend", "fully_sharded", "--update-freq", "2", *SPLIT_FLAGS.get(parallel, [parallel, "2"])]
    split = train_updates(ARGV[task](chat[0], model, *flags, *balanced, batch_size=1), 2, tmp_path)
    # the ranks of a tensor or context group read the same samples
    expected = one_process(chat, task, 2, tmp_path, model, *balanced)
    assert sorted(split) == sorted(expected) == [1, 2]
    for n in expected:
        assert split[n] == pytest.approx(expected[n], rel=1e-5)


@pytest.mark.parametrize("task", list(ARGV))
def test_resume_continues_the_run(chat, task, tmp_path):
    """Stopped after one update and started again, the run continues the uninterrupted
    curve: the weights, the optimizer and the data position from its checkpoint, dpo's
    reference loaded again from --dpo-reference (checkpoints do not hold it)."""
    argv = ARGV[task](chat[0], "llama", "--update-freq", "2", batch_size=1)
    run = [a for a in argv if a != "--no-save"] + ["--save-dir", str(tmp_path / "ck"), "--no-epoch-checkpoints"]
    first = train_updates(run[:] + ["--max-update", "1"], 1, tmp_path)
    rest = train_updates(run, 1, tmp_path)
    assert sorted(first) == [1] and sorted(rest) == [2]
    expected = one_process(chat, task, 2, tmp_path)
    assert first[1] == pytest.approx(expected[1], rel=1e-6)
    assert rest[2] == pytest.approx(expected[2], rel=1e-6)


def test_language_modeling_per_document_attention(chat, tmp_path, capsys):
    """--per-document-attention: whole sequences packed into a sample (complete) score as
    each on a row of its own (eos), the first update's loss and gradient norm alike; without
    the flag the packed sequences read each other and the loss differs."""
    import cli
    from data.preprocess import preprocess

    root, _ = chat
    rng = random.Random(1)
    (tmp_path / "text.txt").write_text("".join(_sentence(rng) + "\n" for _ in range(24)))
    data = tmp_path / "text-data"
    preprocess(
        preprocess_options(
            ["--trainpref", str(tmp_path / "text.txt"), "--destdir", str(data), "--tokenizer", str(root / "llama")]
        )
    )

    def first(*flags):
        argv = sft_argv(root, "llama", *flags, batch_size=24)
        argv[argv.index("sft")] = "language_modeling"
        argv[0] = str(data)
        return train_updates(argv, 1, tmp_path)[1]

    padded = first("--sample-break-mode", "eos")
    packed = first("--sample-break-mode", "complete", "--per-document-attention")
    assert packed == pytest.approx(padded, rel=1e-5)
    assert first("--sample-break-mode", "complete")[0] != pytest.approx(padded[0], rel=1e-3)
    # eval-lm scores its checkpoint as it trained: packed blocks as sequences one per row
    ck = tmp_path / "ck"
    argv = [a for a in sft_argv(root, "llama", batch_size=24) if a != "--no-save"]
    argv[argv.index("sft")], argv[0] = "language_modeling", str(data)
    train_updates(
        argv + ["--sample-break-mode", "complete", "--per-document-attention", "--save-dir", str(ck)], 1, tmp_path
    )

    def eval_lm(mode):
        capsys.readouterr()
        args = [str(data), "--path", str(ck / "checkpoint_last"), "--gen-subset", "train", "--batch-size", "4"]
        assert cli.COMMANDS["eval-lm"](args + ["--sample-break-mode", mode]) in (0, None)
        return next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Loss (base 2):"))

    assert eval_lm("complete") == eval_lm("eos")


@pytest.mark.parametrize("ranks", [[], ["--distributed-world-size", "2", "--model-parallel-size", "2"]])
def test_eval_lm_scores_the_assistants_tokens(chat, tmp_path, capfd, ranks):
    """eval-lm on conversations scores their target tokens only: sft's loss before any step;
    with --model-parallel-size 2 the model split over 2 ranks, each reading its own rows and
    columns of the Hugging Face weights, scores the same."""
    import math

    import cli

    root, _ = chat
    expected = train_updates(sft_argv(root, "llama", "--sample-break-mode", "eos"), 1, tmp_path)[1][0]
    capfd.readouterr()
    argv = [str(root / "llama-sft"), "--path", str(root / "llama"), "--gen-subset", "train", *ranks]
    assert cli.COMMANDS["eval-lm"](argv + ["--tokens-per-sample", str(TOKENS_PER_SAMPLE), "--batch-size", "4"]) in (
        0,
        None,
    )
    out = capfd.readouterr().out
    loss = float(next(x for x in out.splitlines() if x.startswith("Loss (base 2):")).split(":")[1].split(",")[0])
    assert loss == pytest.approx(expected / math.log(2), abs=1e-4)


def test_dpo_records_carry_the_rewards(chat, tmp_path, capfd):
    from helpers import train_here

    root, _ = chat
    argv = dpo_argv(root, "llama", "--log-format", "json", "--log-interval", "1", "--max-update", "1")
    records, _ = train_here(argv, capfd)
    inner = records["train_inner"][0]
    assert {"loss", "ppl", "wps", "wpb", "bsz", "gnorm", "lr", "num_updates"} <= set(inner)
    assert inner["reward_margin"] == pytest.approx(inner["reward_chosen"] - inner["reward_rejected"], abs=2e-4)
    assert 0 <= inner["reward_accuracy"] <= 1 and inner["bsz"] == PAIRS


@pytest.mark.parametrize(
    "task,data,flags,message",
    [
        ("dpo", "llama-sft", [], "--task dpo trains on preference pairs"),
        ("sft", "llama-dpo", [], "--task sft trains on conversations"),
        ("sft", "llama-dpo", ["--dpo-beta", "0.5"], "--dpo-beta is a setting of --task dpo"),
        ("dpo", "llama-dpo", ["--sample-break-mode", "complete"], "--task dpo scores each sequence"),
        ("sft", "llama-sft", ["--sample-break-mode", "none"], "--task sft keeps conversations whole"),
    ],
)
def test_wrong_data_or_flags_refused_in_one_line(chat, tmp_path, capsys, task, data, flags, message):
    from cli import train_main

    root, _ = chat
    argv = (sft_argv if task == "sft" else dpo_argv)(root, "llama", *flags)
    argv[0] = str(root / data)
    capsys.readouterr()
    assert train_main(argv + ["--save-dir", str(tmp_path / "ck")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "ck").exists()


def test_dpo_without_a_reference_refused(chat, capsys):
    from cli import train_main

    root, _ = chat
    argv = [a for a in dpo_argv(root, "llama") if a not in ("--dpo-reference", str(root / "llama-ref"))]
    argv = [a for a in argv if a not in ("--finetune-from-model", str(root / "llama"))]
    capsys.readouterr()
    assert train_main(argv) != 0
    assert "--task dpo needs a reference model" in capsys.readouterr().err


def test_dpo_starts_from_the_sft_checkpoint(chat, tmp_path):
    """SFT's checkpoint starts DPO with no model flags (its config.yaml names the Hugging Face
    model it came from), and is DPO's reference too: before the first step policy and
    reference are the same weights, so every reward is 0 and the loss log 2 per pair."""
    import math

    root, _ = chat
    sft = [a for a in sft_argv(root, "llama") if a != "--no-save"]
    train_updates(sft + ["--max-update", "1", "--save-dir", str(tmp_path / "sft")], 1, tmp_path)
    argv = dpo_argv(root, "llama", "--update-freq", "2", batch_size=PAIRS // 2)
    argv[argv.index("--finetune-from-model") + 1] = str(tmp_path / "sft" / "checkpoint_last")
    i = argv.index("--dpo-reference")
    del argv[i : i + 2]
    first = train_update_stats(argv, 2, tmp_path)[1]
    assert first["reward_chosen"] == first["reward_rejected"] == 0.0
    assert first["loss_sum"] / first["sample_size"] == pytest.approx(math.log(2), rel=1e-6)
