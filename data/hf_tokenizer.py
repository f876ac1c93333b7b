"""A Hugging Face tokenizer (``tokenizer.json`` + its configs) as a shardlm tokenizer.

``preprocess --tokenizer HF_DIR`` encodes with a model's own tokenizer through the
``tokenizers`` library, so data made for, e.g., Llama 3 or Qwen3 has exactly the ids
that model was trained on. Same interface as ``SentencePieceTokenizer``
(data/tokenizer.py); ``bos`` and ``unk`` are None when the tokenizer has none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from data.errors import DataError

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# transformers 5 saves a chat template here rather than in tokenizer_config.json, and reads
# it first: a chat model's data dir, checkpoints and exports keep it beside tokenizer.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_KEYS = ("bos", "eos", "pad", "unk")


def hf_tokenizer_paths(path: str | os.PathLike) -> tuple[Path, list[Path]]:
    """(tokenizer.json, the config files beside it that exist) of an HF model or
    tokenizer directory, or of a path to a tokenizer.json file."""
    path = Path(path)
    tokenizer_json = path / HF_TOKENIZER_FILE if path.is_dir() else path
    if not tokenizer_json.is_file():
        where = f"{path} has no {HF_TOKENIZER_FILE}" if path.is_dir() else f"{path} does not exist"
        raise DataError(
            f"{where}; pass a Hugging Face model or tokenizer directory (with {HF_TOKENIZER_FILE}) "
            "or the path of a tokenizer.json file"
        )
    configs = [tokenizer_json.parent / name for name in HF_CONFIG_FILES]
    return tokenizer_json, [p for p in configs if p.is_file()]


def chat_template_path(tokenizer_json: Path) -> Path | None:
    """chat_template.jinja beside a tokenizer.json, if there is one."""
    path = Path(tokenizer_json).parent / CHAT_TEMPLATE_FILE
    return path if path.is_file() else None


def load_hf_tokenizer_file(path: Path):
    """``tokenizers.Tokenizer`` of a tokenizer.json, or a one-line DataError."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("reading tokenizer.json needs the tokenizers library; pip install tokenizers") from None
    try:
        return Tokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"{path} is not a tokenizers tokenizer.json ({reason[:200]}); pass the file a Hugging Face model ships"
        ) from None


def hf_vocab_size(tokenizer) -> int:
    """Ids run from 0 to this (exclusive), added tokens included."""
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(tokenizer.get_vocab_size(with_added_tokens=True), largest + 1)


def _read_configs(configs: list[Path]) -> dict:
    """tokenizer_config.json, then special_tokens_map.json over it (transformers' order:
    the map's entries win)."""
    merged = {}
    for path in configs:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{path} is not valid JSON ({e}); fix it or remove it") from None
        if not isinstance(data, dict):
            raise DataError(f"{path} is not a JSON object; fix it or remove it")
        merged.update(data)
    return merged


def _token_content(value):
    """A special token's string: configs hold a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    """``tokenizer.json`` through the ``tokenizers`` library, special ids from its configs."""

    def __init__(self, path: str | os.PathLike):
        self.path, configs = hf_tokenizer_paths(path)
        self._tok = load_hf_tokenizer_file(self.path)
        config = _read_configs(configs)
        # transformers' split_special_tokens: "</s>" in a text is spelled out, not the special id.
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self.vocab_size = hf_vocab_size(self._tok)
        self.tokens = {key: _token_content(config.get(f"{key}_token")) for key in _SPECIAL_KEYS}
        where = " or ".join(p.name for p in configs) or f"no tokenizer_config.json beside {self.path}"
        ids = {}
        for key, content in self.tokens.items():
            ids[key] = None if content is None else self._tok.token_to_id(content)
            if content is not None and ids[key] is None:
                raise DataError(
                    f"{key}_token {content!r} ({where}) is not in {self.path}'s vocabulary; "
                    "fix the config to name one of its tokens"
                )
        if ids["eos"] is None:
            raise DataError(
                f"{self.path}: no eos_token ({where}); preprocess ends every sequence with it: add "
                '"eos_token" to tokenizer_config.json'
            )
        self.bos, self.eos, self.unk = ids["bos"], ids["eos"], ids["unk"]
        self.pad, self.pad_reason = self._choose_pad(ids["pad"])
        self._skip_on_decode = {self.bos, self.pad, self.eos} - {None}

    def _choose_pad(self, named: int | None) -> tuple[int, str]:
        """The pad id, and which rule chose it.

        The loss ignores every target equal to pad (fairseq's padding_idx), so pad must
        never be a token of the data: not eos, which ends every sequence, nor bos. Many
        HF tokenizers have no pad_token, or set it to eos (Qwen's <|endoftext|>, a common
        fine-tuning habit); then an otherwise unused special token serves: one named for
        padding (Llama 3.1's <|finetune_right_pad_id|>), else a reserved one (the last:
        fine-tunes and chat formats take the first ones).
        """
        real = {self.eos, self.bos}
        if named is not None and named not in real:
            return named, "pad_token"
        specials = sorted(
            (i, token.content)
            for i, token in self._tok.get_added_tokens_decoder().items()
            if token.special and i not in real
        )
        for i, content in specials:
            if "pad" in content.lower():
                return i, f"its special token {content} (no pad_token distinct from eos and bos)"
        reserved = [(i, content) for i, content in specials if "reserved" in content.lower()]
        if reserved:
            i, content = reserved[-1]
            return i, f"its special token {content} (no pad_token distinct from eos and bos)"
        same = f" (its pad_token {self.tokens['pad']!r} is its eos or bos)" if named is not None else ""
        raise DataError(
            f"{self.path} has no pad token{same}, and the loss ignores pad so it cannot be a real token: add "
            '"pad_token" naming an unused special token to tokenizer_config.json'
        )

    def special_ids(self) -> dict[str, int | None]:
        return dict(bos=self.bos, pad=self.pad, eos=self.eos, unk=self.unk)

    def special_tokens(self) -> dict[str, str]:
        """The special ids' tokens, of those the tokenizer has."""
        return {key: self._tok.id_to_token(i) for key, i in self.special_ids().items() if i is not None}

    def _ids(self, text: str, encoding, add_eos: bool) -> list[int]:
        """The ids of a text with the tokenizer's own specials (Llama 3's <|begin_of_text|>),
        without a trailing eos its template added; with eos when ``add_eos``.

        An empty text is no ids, whatever the template adds: a sequence that is just eos
        is a document boundary (sample_break_mode=complete_doc), as with sentencepiece."""
        ids = encoding.ids if text else []
        if ids and ids[-1] == self.eos and encoding.special_tokens_mask[-1]:
            ids = ids[:-1]
        return ids + [self.eos] if add_eos else ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without eos (preprocess appends it per sequence)."""
        return self._ids(text, self._tok.encode(text), add_eos=False)

    def encode_batch(self, texts: list[str], add_eos: bool = False) -> list[list[int]]:
        texts = list(texts)
        return [self._ids(t, e, add_eos) for t, e in zip(texts, self._tok.encode_batch(texts), strict=True)]

    def special_token_ids(self) -> list[int]:
        """Ids of the tokenizer's added tokens marked special."""
        return [i for i, token in self._tok.get_added_tokens_decoder().items() if token.special]

    def encoding(self, text: str, add_special_tokens: bool):
        """The ``tokenizers.Encoding`` (ids and character offsets) of ``text``, as transformers'
        ``tokenizer(text, add_special_tokens=...)`` tokenizes it."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) not in self._skip_on_decode], skip_special_tokens=False)

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a text whose specials are already written in it (a rendered chat template):
        nothing added, as apply_chat_template tokenizes (add_special_tokens=False)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode_without_specials(self, ids) -> str:
        """A reply as transformers' decode(skip_special_tokens=True) gives it."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def pieces(self) -> list[str]:
        """The vocabulary, by id (None where no token has the id)."""
        return [self._tok.id_to_token(i) for i in range(self.vocab_size)]
