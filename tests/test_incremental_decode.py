"""serve's text decoded incrementally (data/incremental_decode.py, trainer/serve/text.py)
is, token by token, the text of decoding every token again, for each kind of tokenizer
shardlm serves: sentencepiece (bpe, unigram, and with byte fallback as Llama 2's), Hugging
Face tokenizer.json (byte-level BPE as Llama 3's and GPT-2's, Llama 2's sentencepiece
decoders, a Metaspace decoder, a fairseq dict's), and fairseq dict.txt. The old quadratic
functions are kept here as the reference."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

from data.dictionary import Dictionary
from data.hf_convert import write_hf_tokenizer
from data.hf_tokenizer import HFTokenizer
from data.incremental_decode import IncrementalText
from data.tokenizer import DictionaryTokenizer, SentencePieceTokenizer, train_sentencepiece
from helpers import byte_level_tokenizer
from trainer.serve.text import ContinuationText, StopText, text_offsets

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a café in the old town, über naïve crème brûlée",
    "日本語のテキスト 中文文本",
    "  two leading spaces, and  a double one",
    "numbers 1234 and (brackets) [too]!",
    "tabs\tand more words the fox the dog",
]
TEXTS = [
    "the quick brown fox",
    " one leading space",
    "  two leading spaces and  a double one ",
    "café über naïve — ünïcödé crème",
    "日本語のテキスト 漢字 中文",  # 漢字 is not in the corpus: unknown, or bytes
    "emoji 😀 and 👍🏽 split into bytes 🎉!",
    "x😀😀y",
    "\nnewline first\n\nand a\ttab",
    "😀",
]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"]


# ----------------------------------------------------------------------- the reference
def _bench_module(name):
    """A module of bench/ (not a package): the old functions live there, beside their benchmark."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_old = _bench_module("old_serve_text")
OldStopText, old_continuation_text, old_text_offsets = (
    _old.OldStopText,
    _old.old_continuation_text,
    _old.old_text_offsets,
)


# ----------------------------------------------------------------------- the tokenizers
def _spm_byte_fallback(lines, path):
    """A sentencepiece model with byte fallback, as Llama 2's tokenizer.model."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["\n"],
        hard_vocab_limit=False,
        num_threads=1,
        minloglevel=2,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (tokenizer, [the decode functions serve uses with it])."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders

    root = tmp_path_factory.mktemp("tokenizers")
    (root / "corpus.txt").write_text("\n".join(CORPUS * 20) + "\n", encoding="utf-8")
    made = {}
    for kind in ("bpe", "unigram"):
        (root / kind).mkdir()
        made[f"spm-{kind}"] = SentencePieceTokenizer(
            train_sentencepiece(root / "corpus.txt", root / kind / "tokenizer", 300, kind)
        )
    made["spm-byte-fallback"] = SentencePieceTokenizer(
        _spm_byte_fallback(CORPUS * 20, root / "llama2" / "tokenizer.model")
    )
    # Llama 2's tokenizer.json: Replace ▁, ByteFallback, Fuse, Strip one leading space.
    made["hf-llama2"] = HFTokenizer(write_hf_tokenizer(root / "llama2", root / "hf-llama2"))
    # The same vocabulary with a Metaspace decoder (Mistral's, Gemma's tokenizer.json).
    metaspace = Tokenizer.from_file(str(root / "hf-llama2" / "tokenizer.json"))
    metaspace.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    )
    (root / "hf-metaspace").mkdir()
    metaspace.save(str(root / "hf-metaspace" / "tokenizer.json"))
    (root / "hf-metaspace" / "tokenizer_config.json").write_text(
        (root / "hf-llama2" / "tokenizer_config.json").read_text()
    )
    made["hf-metaspace"] = HFTokenizer(root / "hf-metaspace")
    # Llama 3's and GPT-2's: byte-level BPE, added special tokens.
    byte_level = byte_level_tokenizer(CORPUS * 5, SPECIALS, bos=SPECIALS[0], vocab_size=300)
    config = dict(bos_token=SPECIALS[0], eos_token=SPECIALS[1], pad_token=SPECIALS[3])
    transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level, **config).save_pretrained(root / "llama3")
    made["hf-byte-level"] = HFTokenizer(root / "llama3")
    # fairseq: dict.txt, and the tokenizer.json write_hf_tokenizer makes of it.
    words = sorted({w for line in CORPUS + TEXTS for w in line.split()})[::2]  # half are unknown
    (root / "dict").mkdir()
    (root / "dict" / "dict.txt").write_text("".join(f"{w} {i + 1}\n" for i, w in enumerate(words)))
    made["fairseq-dict"] = DictionaryTokenizer(Dictionary.load(root / "dict" / "dict.txt"))
    made["hf-dict"] = HFTokenizer(write_hf_tokenizer(root / "dict", root / "hf-dict"))
    return {
        name: (tok, [tok.decode, tok.decode_without_specials] if isinstance(tok, HFTokenizer) else [tok.decode])
        for name, tok in made.items()
    }


KINDS = [
    "spm-bpe",
    "spm-unigram",
    "spm-byte-fallback",
    "hf-llama2",
    "hf-metaspace",
    "hf-byte-level",
    "fairseq-dict",
    "hf-dict",
]


def sequences(tok):
    """Each text's ids, alone and with special ids woven in (bos, eos, pad, unk, and an HF
    tokenizer's added specials), then all the texts in one."""
    specials = [i for i in tok.special_ids().values() if i is not None]
    if isinstance(tok, HFTokenizer):
        specials += tok.special_token_ids()
    out = []
    for n, text in enumerate(TEXTS):
        ids = tok.encode(text)
        out.append(ids)
        woven = list(ids)
        for k, special in enumerate(specials):
            woven.insert((k * 7 + n) % (len(woven) + 1), special)
        out.append(woven)
        out.append([specials[n % len(specials)], *ids])  # a special first: the first piece's space
    out.append(tok.encode("\n".join(TEXTS)))
    return out


def random_ids(tok, count, seed):
    """Any ids at all: lone bytes, invalid UTF-8, specials anywhere."""
    rng = random.Random(seed)
    return [[rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))] for _ in range(count)]


# ----------------------------------------------------------------------- the checks
def test_the_texts_meet_every_case(tokenizers):
    """The texts do hold what the tokenizers treat apart: byte pieces, characters split across
    tokens, unknown pieces, lone leading-space pieces."""
    spm = tokenizers["spm-byte-fallback"][0]
    pieces = [spm.pieces()[i] for i in spm.encode("".join(TEXTS))]
    assert "<0xF0>" in pieces and "<0x9F>" in pieces  # 😀's bytes
    assert any(spm.decode(spm.encode(t)[:k]).endswith("\ufffd") for t in TEXTS for k in range(20))
    assert "▁" in [tokenizers["spm-bpe"][0].pieces()[i] for i in tokenizers["spm-bpe"][0].encode(TEXTS[2])]
    assert tokenizers["spm-bpe"][0].unk in tokenizers["spm-bpe"][0].encode(TEXTS[5])
    byte_level = tokenizers["hf-byte-level"][0]
    ids = byte_level.encode(TEXTS[6])
    assert any(byte_level.decode(ids[:k]).endswith("\ufffd") for k in range(len(ids)))


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_text_is_the_whole_decode(tokenizers, kind):
    tok, decodes = tokenizers[kind]
    for decode in decodes:
        for ids in sequences(tok) + random_ids(tok, 60, seed=len(kind)):
            text, before = IncrementalText(decode), ""
            for i in range(len(ids)):
                text.push(ids[i])
                want = decode(ids[: i + 1])
                assert (len(text), text.text) == (len(want), want), (kind, ids[: i + 1])
                assert want[: text.stable] == before[: text.stable]  # what `stable` promises
                k = (i * 5) % (len(want) + 1)
                assert text.text_from(k) == want[k:] and text.startswith(want[:k])
                before = want
        # On real text no id changes the text before the window's read offset, but where
        # Hugging Face's ByteFallback turns a run of bytes into U+FFFDs (a character's first byte).
        for ids in sequences(tok):
            rewinds = IncrementalText(decode, ids).rewinds
            assert rewinds == 0 or kind in ("hf-llama2", "hf-metaspace"), (kind, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_the_window_stays_small(tokenizers, kind):
    """Each token re-decodes a few tokens, not the text so far (the old way decoded
    n²/2 token ids for n tokens)."""
    tok, decodes = tokenizers[kind]
    ids = tok.encode(" ".join(TEXTS * 20))
    decoded = []

    def counting(some):
        decoded.append(len(some))
        return decodes[0](some)

    assert IncrementalText(counting, ids).text == decodes[0](ids)
    assert sum(decoded) < 12 * len(ids), (kind, len(ids), sum(decoded), max(decoded))


@pytest.mark.parametrize("kind", KINDS)
def test_text_offsets_are_as_before(tokenizers, kind):
    """echo's and logprobs' text_offset: a prompt then a continuation, split at every token
    (inside a character too: then the continuation is decoded without its context)."""
    tok, decodes = tokenizers[kind]
    for decode in decodes:
        for ids in sequences(tok)[:12] + random_ids(tok, 20, seed=1):
            for k in range(len(ids) + 1):
                assert text_offsets(decode, ids[:k], ids[k:]) == old_text_offsets(decode, ids[:k], ids[k:]), (
                    kind,
                    ids,
                    k,
                )


def stops_for(text, rng):
    """Stop strings that do appear in `text` (a character, a multi-byte one, a few
    characters across tokens) and one that does not."""
    stops = [["never appears"]]
    for length in (1, 2, 5):
        if len(text) > length:
            start = rng.randrange(len(text) - length)
            stops.append([text[start : start + length], "never appears"])
    wide = [c for c in text if ord(c) > 127 and c != "\ufffd"]
    if wide:
        stops.append([rng.choice(wide)])
    return stops


@pytest.mark.parametrize("kind", KINDS)
def test_streams_and_stop_strings_are_as_before(tokenizers, kind):
    """What each push sends, where a stop string cuts the text, and the tokens kept: for
    completions (a continuation of a prompt) and chat (the reply's text alone)."""
    tok, decodes = tokenizers[kind]
    rng = random.Random(0)
    for decode in decodes:
        for ids in sequences(tok) + random_ids(tok, 20, seed=2):
            k = rng.randrange(len(ids) + 1)
            prompt, new = ids[:k], ids[k:]
            for stops in stops_for(old_continuation_text(decode, prompt, new), rng):
                made = {
                    "completion": (
                        StopText(ContinuationText(decode, prompt), stops),
                        OldStopText(lambda some, d=decode, p=prompt: old_continuation_text(d, p, some), stops),
                    ),
                    "chat": (StopText(IncrementalText(decode), stops), OldStopText(decode, stops)),
                }
                for how, (text, old) in made.items():
                    case = (kind, how, ids, k, stops)
                    for token_id in new:
                        assert text.push(token_id) == old.push(token_id), case
                        assert (text.stopped, text.sent) == (old.stopped, old.sent), case
                        if old.stopped:
                            break
                    assert (text.flush(), text.text, text.ids) == (old.flush(), old.text, old.ids), case
                    offsets = old_text_offsets(decode, prompt, new)[len(prompt) :]
                    base = len(decode(prompt))
                    assert text.kept_tokens(base, offsets) == old.kept_tokens(base, offsets), case


def test_a_stop_string_across_a_character_and_tokens():
    """A hand-made decode whose text changes before its end (a character completed by a later
    byte, as U+FFFD turns into it): a stop string is found where the text changed."""
    pieces = {1: b"a", 2: b"\xe2", 3: b"\x82", 4: b"\xac", 5: b"b", 6: b" ", 7: b"\x80"}

    def decode(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")

    for ids in ([1, 2, 3, 4, 5], [1, 2, 3, 7, 5, 6, 2, 3, 4], [2, 3, 4, 2, 3, 4, 1], [7, 7, 1, 2, 4, 1]):
        for stops in (["€b"], ["a€"], ["\ufffd"], ["€", "b"], [" "]):
            text, old = StopText(IncrementalText(decode), stops), OldStopText(decode, stops)
            for token_id in ids:
                assert text.push(token_id) == old.push(token_id), (ids, stops)
                if old.stopped:
                    break
            assert (text.flush(), text.text) == (old.flush(), old.text), (ids, stops)
        for k in range(len(ids) + 1):
            assert text_offsets(decode, ids[:k], ids[k:]) == old_text_offsets(decode, ids[:k], ids[k:])


def test_tokenizer_configs_were_read(tokenizers):
    """The fixtures are what they claim: Llama 2's decoders, Llama 3's specials."""
    llama2 = json.loads(tokenizers["hf-llama2"][0].path.read_text())["decoder"]
    assert [d["type"] for d in llama2["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    byte_level = tokenizers["hf-byte-level"][0]
    assert byte_level.decode(byte_level.encode("the")) == "the" and byte_level.bos is not None
