"""The options of the commands beside train: one dataclass per command, one field per flag.

As in schema.py, a field is the single definition of an option: trainer/config/flags.py
generates its flag (`--context-window`) and its key=value override, whose group is the
command's name (`eval_lm.context_window=512`, as fairseq names eval-lm's group). Field
metadata as schema.py's (`help`, `choices`, `flag`, `alias`), plus `type` (a checked type
of trainer/config/command_checks.py, or a parser), `required`, `repeatable` (the flag may
be given several times) and `metavar`. plan's own options are PlanConfig; its other flags
are train's. Torch-free: `eval-lm --help` must answer before torch is imported (the data/
modules imported here, for preprocess's choices and defaults, import neither torch nor numpy).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from data.sources import INPUT_FORMATS
from data.tokenizer import DEFAULT_SPM_MODEL_TYPE, DEFAULT_SPM_SEED, DEFAULT_SPM_VOCAB_SIZE, SPM_MODEL_TYPES
from trainer.config.checks import parse_model_overrides
from trainer.config.command_checks import non_negative_int, positive_float, positive_int
from trainer.config.schema import BREAK_MODES

EMA_HELP = "the moving average of the weights a checkpoint of train --store-ema holds, not its weights (fairseq's EMA)"
MODEL_PATH_HELP = (
    "checkpoint directory, export-model output, fairseq-train checkpoint (.pt), or Hugging Face "
    "model directory (Llama/Qwen3: config.json, safetensors, tokenizer.json)"
)


def _f(default, help, **meta):
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EvalLMConfig:
    """eval-lm (fairseq-eval-lm): trainer/inference/eval_lm.py reads every field;
    distributed_world_size and cpu also set the launch (cli.py)."""

    data: Optional[str] = _f(None, "data directory (default: the embedded corpus)", flag="data")
    path: Optional[str] = _f(None, MODEL_PATH_HELP, required=True)
    ema: bool = _f(False, f"evaluate {EMA_HELP}")
    gen_subset: str = _f("test", "split to evaluate")
    tokens_per_sample: Optional[int] = _f(None, "block length (default: the training run's)", type=positive_int)
    context_window: int = _f(0, "score each block with this many earlier tokens as unscored context")
    sample_break_mode: Optional[str] = _f(None, "how blocks are cut (default: the training run's)", choices=BREAK_MODES)
    batch_size: Optional[int] = _f(None, "blocks per batch", alias="--max-sentences", type=positive_int)
    max_tokens: Optional[int] = _f(None, "tokens per batch (default 36000 without --batch-size)", type=positive_int)
    distributed_world_size: int = _f(1, "ranks to spawn", type=positive_int)
    model_parallel_size: int = _f(
        1,
        "split the model's heads, width and vocabulary over N ranks (tensor parallelism, as train's); "
        "the blocks are shared out over the world size / N groups",
        alias="--tensor-parallel-size",
        type=positive_int,
    )
    cpu: bool = _f(False, "evaluate on the CPU even when a GPU is present")
    num_workers: int = _f(
        1, "processes that read and collate batches ahead (0: in the evaluating process)", type=non_negative_int
    )
    no_progress_bar: bool = _f(False, "no progress line while evaluating (default: one on a terminal)")
    softmax_batch: Optional[int] = _f(
        None,
        "score at most this many tokens' output distributions at a time "
        "(bounds the B x T x V memory of large vocabularies)",
        type=positive_int,
    )
    # Parsed while parsing (a dict from here on), so a bad dict is refused before any rank starts.
    model_overrides: Dict[str, Any] = _f(
        {},
        "model config keys to change before loading, as fairseq's Python "
        "dict, e.g. \"{'decoder_layers_to_keep':'0,2,4'}\"",
        type=parse_model_overrides,
    )


@dataclass
class GenerateConfig:
    """generate (fairseq-interactive): trainer/inference/generate.py."""

    data: Optional[str] = _f(
        None,
        "data directory whose tokenizer reads the prompts, as fairseq-interactive's DATA (default: the "
        "model's own; a fairseq checkpoint has none: its dict.txt beside it, or pass its data-bin)",
        flag="data",
    )
    path: Optional[str] = _f(None, MODEL_PATH_HELP, required=True)
    ema: bool = _f(False, f"sample from {EMA_HELP}")
    prompt: Optional[List[str]] = _f(
        None, "prompt text (repeatable); default: one prompt per stdin line", repeatable=True
    )
    max_new_tokens: int = _f(64, "tokens to sample per prompt", type=positive_int)
    temperature: float = _f(1.0, "0 is greedy decoding")
    top_k: int = _f(0, "sample among the k most likely tokens (0: all)")
    top_p: float = _f(1.0, "nucleus sampling: smallest set with this probability")
    seed: int = _f(1, "the same seed gives the same text")
    no_kv_cache: bool = _f(False, "re-run the whole prefix for every token (slow)")
    chat: bool = _f(
        False,
        "talk to a chat model through its chat template (chat_template.jinja or tokenizer_config.json's): "
        "each --prompt is the user turn of a conversation of its own; without --prompt or --messages, each "
        "stdin line is the next user turn of one conversation. Prints only the assistant's reply, stopped "
        "at the end of its turn or at any eos id of config.json / generation_config.json",
    )
    system: Optional[str] = _f(None, "--chat: a system message opening each conversation", metavar="TEXT")
    messages: Optional[str] = _f(
        None,
        "--chat: conversations to reply to, each a list of {role, content} messages: FILE.json holds one "
        "(or a list of them), FILE.jsonl one per line",
        metavar="FILE",
    )
    cpu: bool = _f(False, "sample on the CPU even when a GPU is present")
    model_parallel_size: int = _f(
        1,
        "split the model over N ranks started here, by heads, width and vocabulary (tensor parallelism, as "
        "train's): for a model too big for one device",
        alias="--tensor-parallel-size",
        type=positive_int,
    )


@dataclass
class ServeConfig:
    """serve: an OpenAI-compatible HTTP server (trainer/serve/command.py, serve.py)."""

    path: Optional[str] = _f(None, MODEL_PATH_HELP, required=True)
    ema: bool = _f(False, f"serve {EMA_HELP}")
    host: str = _f("127.0.0.1", "address to listen on (0.0.0.0: every interface; add --api-key then)")
    port: int = _f(8000, "port to listen on", type=non_negative_int)
    api_key: Optional[str] = _f(
        None, "answer /v1 requests only with 'Authorization: Bearer KEY' (default: anyone who reaches the port)"
    )
    model_name: Optional[str] = _f(None, "the model's name in requests and /v1/models (default: the path's last part)")
    max_batch: int = _f(
        16, "requests decoded together (continuous batching: rows join and leave between steps)", type=positive_int
    )
    max_positions: Optional[int] = _f(
        None,
        "positions a request may use, prompt and completion (default: the model's); the KV cache holds "
        "--max-batch rows of them, so a long-context model needs this lowered to fit",
        type=positive_int,
    )
    max_queue: int = _f(
        64, "requests that may wait for a free row; one more is answered 429 (busy)", type=non_negative_int
    )
    shutdown_timeout: float = _f(
        30.0, "on Ctrl-C or SIGTERM, seconds the requests in flight have to finish", type=positive_float
    )
    cpu: bool = _f(False, "run the model on the CPU even when a GPU is present")
    fp16: bool = _f(False, "hold and run the weights in float16 (log-probabilities still in fp32)")
    bf16: bool = _f(False, "hold and run the weights in bfloat16 (log-probabilities still in fp32)")
    distributed_world_size: int = _f(
        1, "ranks to spawn: the model is sharded across them (FSDP); rank 0 serves HTTP", type=positive_int
    )
    model_parallel_size: int = _f(
        1,
        "split the model's heads, width and vocabulary over the ranks instead (tensor parallelism: each rank "
        "computes its share of every layer); the world size or 1",
        alias="--tensor-parallel-size",
        type=positive_int,
    )


@dataclass
class ExportModelConfig:
    """export-model: trainer/inference/export.py."""

    path: Optional[str] = _f(None, "checkpoint directory, export, or fairseq-train checkpoint (.pt)", required=True)
    out: Optional[str] = _f(None, "output directory (must not hold a model yet)", required=True)
    ema: bool = _f(False, f"export {EMA_HELP}")
    format: str = _f(
        "safetensors",
        "hf: a directory transformers loads (LlamaForCausalLM, Qwen3ForCausalLM with "
        "--qk-norm, or GPT2LMHeadModel), with the tokenizer as tokenizer.json",
        choices=("safetensors", "hf"),
    )
    dtype: Optional[str] = _f(None, "cast the weights (default: as saved)", choices=("fp32", "bf16", "fp16"))
    max_shard_size: Optional[str] = _f(
        None,
        "--format hf: split the weights into files of at most this size, "
        "as save_pretrained does (e.g. 500MB, 2GiB; default: 5GB)",
    )
    pq_compact: bool = _f(
        False,
        "a model iPQ quantized (train --quantization-config-path): write its layers as their checkpoint holds "
        "them, centroids, assignments and counts, as fairseq's PQ layers (default: each weight rebuilt)",
    )


@dataclass
class PlanConfig:
    """plan's own options, beside train's flags: trainer/plan/command.py."""

    device_memory_gb: Optional[float] = _f(
        None,
        "memory of one GPU (plans for GPUs; without it, and with --cpu, plans for this host's CPU)",
        type=positive_float,
    )
    host_memory_gb: Optional[float] = _f(
        None,
        "memory of one host (default: this one's; with --device-memory-gb, not checked unless given)",
        type=positive_float,
    )
    ranks_per_host: Optional[int] = _f(
        None, "ranks on one host (default: all of them on a CPU, up to 8 on GPUs)", type=positive_int
    )
    format: str = _f("text", "json: one object", choices=("text", "json"))
    path: Optional[str] = _f(
        None,
        "plan for the Hugging Face model in this directory (Llama, Qwen3), or the model of a "
        "fairseq-train checkpoint (.pt): its config gives the model's shape and vocabulary, over "
        "--arch and model flags",
        metavar="MODEL",
    )
    serve: bool = _f(
        False,
        "plan `serve` instead of `train`: this rank's share of the weights, the KV cache and the "
        "largest forward, against --device-memory-gb over --distributed-world-size ranks",
    )
    max_batch: int = _f(16, "with --serve: serve's --max-batch, rows of the KV cache", type=positive_int)
    max_positions: Optional[int] = _f(
        None, "with --serve: serve's --max-positions, positions of a row (default: the model's)", type=positive_int
    )


INPUTS = "a path, a glob, or a comma-separated list of them"


@dataclass
class PreprocessConfig:
    """preprocess (fairseq-preprocess): data/preprocess.py reads every field (data/ imports
    nothing from trainer/: cli.py hands it this object). --trainpref, --validpref, --testpref,
    --destdir and --workers are fairseq-preprocess's own, with its defaults."""

    trainpref: Optional[str] = _f(None, f"train input: {INPUTS}", metavar="FP")
    validpref: Optional[str] = _f(
        None, f"valid input: {INPUTS}; comma-separated parts become splits valid, valid1, ...", metavar="FP"
    )
    testpref: Optional[str] = _f(
        None, f"test input: {INPUTS}; comma-separated parts become splits test, test1, ...", metavar="FP"
    )
    destdir: str = _f("data-bin", "output dir", metavar="DIR")
    text_column: str = _f("text", "column holding the text in json/parquet/csv/saved inputs")
    input_format: str = _f(
        "auto",
        "input file format; auto picks by extension: .txt/.tokens/.raw/none -> text, .json/.jsonl -> json, "
        ".parquet, .csv, .arrow; a save_to_disk dir is always read as saved",
        choices=INPUT_FORMATS,
    )
    # None is "not given", so that one of these three passed with --spm-model or --tokenizer
    # (which they cannot shape) is refused rather than ignored; data/preprocess.py fills in
    # the defaults their help states.
    vocab_size: Optional[int] = _f(None, f"sentencepiece vocabulary size (default: {DEFAULT_SPM_VOCAB_SIZE})")
    spm_model_type: Optional[str] = _f(
        None, f"sentencepiece model type (default: {DEFAULT_SPM_MODEL_TYPE})", choices=SPM_MODEL_TYPES
    )
    spm_model: Optional[str] = _f(
        None,
        "reuse this sentencepiece .model instead of training one (needs ids bos=0 pad=1 eos=2 unk=3)",
        metavar="PATH",
    )
    tokenizer: Optional[str] = _f(
        None,
        "encode with this Hugging Face model's own tokenizer instead of sentencepiece: a model or tokenizer "
        "directory (tokenizer.json, tokenizer_config.json) or a tokenizer.json file. Its template adds BOS where "
        "the model has one, its eos_token ends every sequence, pad comes from its config (docs/data.md)",
        metavar="HF_DIR",
    )
    chat_template: Optional[str] = _f(
        None,
        "with --tokenizer, for conversation (messages) and preference-pair (prompt, chosen, rejected) rows: "
        "render them with this Jinja chat template instead of the model's own (chat_template.jinja or "
        "tokenizer_config.json's chat_template)",
        metavar="FILE",
    )
    max_length: Optional[int] = _f(
        None,
        "drop a conversation with more than N tokens, or a preference pair whose longer side has more "
        "(counted per split in the summary and metadata.json) (default: keep all; train skips what exceeds "
        "--tokens-per-sample)",
        metavar="N",
        type=positive_int,
    )
    workers: int = _f(
        1, "encoding processes; text, jsonl and parquet files are shared among them by chunks", type=positive_int
    )
    seed: Optional[int] = _f(None, f"seed for sentencepiece's sentence sampling (default: {DEFAULT_SPM_SEED})")
    shard_mb: Optional[float] = _f(
        None,
        "text/jsonl/parquet inputs: MB of input files (on disk) per chunk, which one worker encodes into one shard "
        "(train, train1, ... of --destdir; a killed run continues by shard); a .gz file is never cut "
        "(default: the split's size / 64, between 1 and 256)",
        metavar="MB",
        type=positive_float,
    )


# Each command's options and the group of their key=value overrides.
COMMAND_GROUPS = {
    "eval-lm": ("eval_lm", EvalLMConfig),
    "generate": ("generate", GenerateConfig),
    "serve": ("serve", ServeConfig),
    "export-model": ("export_model", ExportModelConfig),
    "plan": ("plan", PlanConfig),
    "preprocess": ("preprocess", PreprocessConfig),
}
