"""A data dir's tokenizer as Hugging Face tokenizer files, for ``transformers`` users.

``write_hf_tokenizer(src, out)`` writes ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` such that ``AutoTokenizer.from_pretrained(out)(text)["input_ids"]``
is exactly what ``preprocess`` wrote for ``text``: the tokenizer's ids followed by
``</s>``. ``src`` is a data dir, a checkpoint or an export: it holds ``tokenizer.model``
(sentencepiece, ours), ``dict.txt`` (fairseq's) or already ``tokenizer.json``.

Torch-free, and free of ``transformers`` too: only ``tokenizers`` builds the files
(``sentencepiece``'s own model proto, which needs ``protobuf``, a dependency of
tensorboard, is read for the model's settings).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from pathlib import Path

from data.dictionary import Dictionary
from data.errors import DataError
from data.hf_tokenizer import CHAT_TEMPLATE_FILE, HF_CONFIG_FILES, HF_TOKENIZER_FILE
from data.tokenizer import tokenizer_files

# sentencepiece's ModelProto enums (sentencepiece_model.proto).
_UNIGRAM, _BPE = 1, 2
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
_SPACE = "\u2581"  # "▁", sentencepiece's escaped space


@functools.cache
def _py_whitespace() -> str:
    """A regex class of what Python's str.isspace() calls whitespace (data/encode.py and
    fairseq use it), each character escaped."""
    spaces = "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace())
    return f"[{_regex_escape(spaces, every=True)}]"


def write_hf_tokenizer(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the tokenizer of ``src_dir`` (data dir, checkpoint or export) into ``out_dir``
    as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``;
    returns ``out_dir``."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    kind, path = tokenizer_files(src_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "hf":  # made by preprocess --tokenizer: the files are already the model's own
        for name in (HF_TOKENIZER_FILE, *HF_CONFIG_FILES, CHAT_TEMPLATE_FILE):
            if (src_dir / name).is_file() and src_dir.resolve() != out_dir.resolve():
                shutil.copyfile(src_dir / name, out_dir / name)
        return out_dir
    if kind == "sentencepiece":
        tokenizer, specials = _from_sentencepiece(path)
    else:
        tokenizer, specials = _from_dictionary(Dictionary.load(path))
    tokenizer.save(os.fspath(out_dir / HF_TOKENIZER_FILE))
    special_map = {
        key: specials[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token") if key in specials
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        # preprocess encoded "</s>" in a text as the characters it is, never as the eos id:
        # so must transformers (its default would turn the string into the special token).
        "split_special_tokens": True,
        # transformers would otherwise rewrite " ." to "." when decoding, losing text.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", special_map)
    return out_dir


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _eos_template(eos: str, eos_id: int):
    """Every sequence ends in </s>, as preprocess ends every row with it."""
    from tokenizers import processors

    return processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, eos_id)]
    )


def _blank_to_empty():
    """preprocess writes a whitespace-only text as an empty sequence (just </s>)."""
    from tokenizers import Regex, normalizers

    return normalizers.Replace(Regex(rf"\A{_py_whitespace()}+\z"), "")


def _special_tokens(pieces: list[str], ids: dict[str, int]):
    """The added-token list and the config's names for shardlm's four special ids."""
    from tokenizers import AddedToken

    names = {f"{key}_token": pieces[i] for key, i in ids.items()}
    added = [AddedToken(pieces[i], special=True, normalized=False) for i in sorted(ids.values())]
    return added, names


def _from_sentencepiece(path: Path):
    """A ``tokenizers`` Tokenizer that encodes as sentencepiece's ``encode`` does.

    Follows the model's own normalizer spec: a dummy "▁" before the text (when
    add_dummy_prefix, as ours have), spaces escaped to "▁", user-defined pieces (our
    "\\n") cut out whole and never merged, BPE merges ranked by piece score.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # protobuf's DecodeError, whose module path varies by version
        raise DataError(f"{path} is not a sentencepiece model ({e}); pass a data dir written by preprocess") from None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    unsupported = [
        what
        for what, bad in (
            ("treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix),
            ("escape_whitespaces=false", not norm.escape_whitespaces),
            (f"model_type {trainer.model_type} (only bpe and unigram)", trainer.model_type not in (_BPE, _UNIGRAM)),
        )
        if bad
    ]
    if unsupported:
        raise DataError(f"{path}: cannot convert a sentencepiece model with {', '.join(unsupported)} to tokenizer.json")
    pieces = [p.piece for p in proto.pieces]
    ids = dict(bos=trainer.bos_id, eos=trainer.eos_id, unk=trainer.unk_id, pad=trainer.pad_id)
    ids = {key: i for key, i in ids.items() if 0 <= i < len(pieces)}
    if "eos" not in ids or "unk" not in ids:
        raise DataError(f"{path} has no eos or unk piece; shardlm's tokenizers have both (ids eos=2 unk=3)")
    user_defined = [p.piece for p in proto.pieces if p.type == _USER_DEFINED]

    if trainer.model_type == _BPE:
        vocab = {piece: i for i, piece in enumerate(pieces)}
        # sentencepiece merges the adjacent pair whose joined piece scores highest; a
        # `tokenizers` BPE merges the pair listed first. So: every split of every normal
        # piece into two normal pieces, by the joined piece's score (ties by id). Only
        # normal pieces: control, unknown and user-defined pieces are never merged into.
        normal = {p.piece: (p.score, i) for i, p in enumerate(proto.pieces) if p.type == _NORMAL}
        ranked = sorted(
            (-score, i, piece[:k], piece[k:])
            for piece, (score, i) in normal.items()
            for k in range(1, len(piece))
            if piece[:k] in normal and piece[k:] in normal
        )
        model = models.BPE(
            vocab=vocab,
            merges=[(a, b) for _, _, a, b in ranked],
            unk_token=trainer.unk_piece or pieces[ids["unk"]],
            fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )
    else:
        # sentencepiece's lattice never holds control or unknown pieces; a `tokenizers`
        # Unigram holds every piece, so those get a score no path would choose (a literal
        # "<s>" in the text is then spelled out, as sentencepiece does).
        lowest = min(p.score for p in proto.pieces if p.type == _NORMAL)
        vocab = [(p.piece, p.score if p.type not in (_CONTROL, _UNKNOWN) else lowest - 1e6) for p in proto.pieces]
        model = models.Unigram(vocab, unk_id=ids["unk"], byte_fallback=trainer.byte_fallback)
    tokenizer = Tokenizer(model)

    steps = [_blank_to_empty()]
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    steps.append(normalizers.Replace(" ", _SPACE))
    if norm.add_dummy_prefix:
        # sentencepiece puts "▁" before every non-empty text. Not Metaspace's prepend:
        # that skips it when the text already starts with a space, sentencepiece doesn't.
        steps.append(normalizers.Prepend(_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    splits = []
    if user_defined:
        pattern = "|".join(_regex_escape(p) for p in sorted(user_defined, key=len, reverse=True))
        splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    if trainer.model_type == _UNIGRAM:
        # A run of characters no piece has (<unk> in both) cut out on its own: a path of
        # sentencepiece's lattice has a boundary on each side of it anyway, and a
        # control piece such as "<s>" can then not cover an unseen "<" (its low score
        # above does not keep it out there: `tokenizers` scores <unk> below every piece).
        seen = {c for p in proto.pieces if p.type in (_NORMAL, _USER_DEFINED) for c in p.piece}
        splits.append(
            pre_tokenizers.Split(
                Regex(f"[^{''.join(_regex_escape(c, every=True) for c in sorted(seen))}]+"), behavior="isolated"
            )
        )
    if splits:
        tokenizer.pre_tokenizer = splits[0] if len(splits) == 1 else pre_tokenizers.Sequence(splits)

    steps = [decoders.Replace(_SPACE, " ")]
    if trainer.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if norm.add_dummy_prefix:  # drop the dummy prefix's space, once, at the start of the text
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)

    added, names = _special_tokens(pieces, ids)
    tokenizer.add_special_tokens(added)
    tokenizer.post_processor = _eos_template(pieces[ids["eos"]], ids["eos"])
    return tokenizer, names


def _from_dictionary(dictionary: Dictionary):
    """fairseq's dict.txt: whitespace-split words, each its id or <unk>."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    # A symbol repeated with #fairseq:overwrite keeps its old slot but is looked up at
    # its new id; the old slot gets a name no text can produce, so the ids stay put.
    vocab = {symbol: i for i, symbol in enumerate(dictionary.symbols) if dictionary.indices[symbol] == i}
    for i, symbol in enumerate(dictionary.symbols):
        if dictionary.indices[symbol] != i:
            vocab[f"{symbol} <overwritten {i}>"] = i
    unk = dictionary.symbols[dictionary.unk()]
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    # str.split() (fairseq's and ours) and WhitespaceSplit disagree on a few control
    # characters (\x1c-\x1f): make every one Python calls whitespace a space first.
    tokenizer.normalizer = normalizers.Replace(_whitespace_regex(), " ")
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    ids = dict(bos=dictionary.bos(), eos=dictionary.eos(), unk=dictionary.unk(), pad=dictionary.pad())
    added, names = _special_tokens(dictionary.symbols, ids)
    tokenizer.add_special_tokens(added)
    tokenizer.post_processor = _eos_template(dictionary.symbols[dictionary.eos()], dictionary.eos())
    # No decoder: tokenizers joins the words with single spaces, as fairseq's string() does.
    return tokenizer, names


def _whitespace_regex():
    from tokenizers import Regex

    return Regex(_py_whitespace())


def _regex_escape(text: str, every: bool = False) -> str:
    """Oniguruma (the regex engine of ``tokenizers``) escaping of every non-alphanumeric
    character (``every``: every character, as inside a [] class)."""
    return "".join(c if c.isalnum() and not every else f"\\x{{{ord(c):x}}}" for c in text)
