"""A small Hugging Face Llama model and the --task sft and --task dpo data dirs for it, made
here rather than downloaded, for bench/bench_plan.py's sft and dpo rows.

The data dirs are what `preprocess --tokenizer HF_DIR` writes (token files, their
`.targets` flags, metadata.json with the data's kind, the model's tokenizer), with random
token ids: memory depends on the shapes, not on the text. Every dpo sequence and every
packed sft row fills --tokens-per-sample positions, the longest batch `plan` assumes.
"""

import json
import shutil
from pathlib import Path

import numpy as np

from data.indexed_dataset import IndexedDatasetBuilder
from data.preprocess_tokenizer import METADATA_FORMAT
from data.tokenizer import file_sha256

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|pad|>"]


def save_hf_llama(path: Path, layers, dim, ffn, heads, kv_heads, vocab, positions):
    """A randomly initialised LlamaForCausalLM (untied) with a byte-level tokenizer of its
    own; the model's vocabulary pads past the tokenizer's, as Qwen3's does."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = [f"message {i}: the quick brown fox jumps over the lazy dog" for i in range(50)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=alphabet))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(SPECIALS[0]),
        eos_token_id=tok.token_to_id(SPECIALS[1]),
        pad_token_id=tok.token_to_id(SPECIALS[2]),
    )
    path.mkdir(parents=True, exist_ok=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2]})
    )
    return tok.get_vocab_size()


def write_task_data(out: Path, hf_dir: Path, kind, sequences, length, tokenizer_vocab, seed=0):
    """`sequences` sequences of `length` tokens each (kind "preference_pairs": chosen and
    rejected in turn), every split the trainer checks; the second half of each is flagged
    as target (a completion or an assistant's turn)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, out / name)
    rng = np.random.default_rng(seed)
    flags = np.zeros(length, dtype=np.uint8)
    flags[length // 2 :] = 1
    counts = {}
    for split in ("train", "valid"):
        tokens, targets = IndexedDatasetBuilder(out / split), IndexedDatasetBuilder(out / f"{split}.targets", np.uint8)
        for _ in range(sequences):
            tokens.add_item(rng.integers(0, tokenizer_vocab - len(SPECIALS), length))
            targets.add_item(flags)
        tokens.finalize()
        targets.finalize()
        counts[split] = sequences
    metadata = {
        "format": METADATA_FORMAT,
        "kind": kind,
        "tokenizer": "tokenizer.json",
        "tokenizer_kind": "hf",
        "tokenizer_sha256": file_sha256(out / "tokenizer.json"),
        "tokenizer_source": str(hf_dir),
        "vocab_size": tokenizer_vocab,
        "dtype": "uint16",
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2))
    return out
