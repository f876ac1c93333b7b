"""decode(ids) of a growing list of ids, each new id re-decoding only the last few.

Decoding the whole list again for every new id is quadratic: `serve` spent about 2 s of its
event loop on the text offsets of a 4,000-token echo that way (bench/bench_serve_decode.py).
This is vLLM's incremental detokenizer (vllm/transformers_utils/detokenizer_utils.py,
detokenize_incrementally): keep the text of the ids before a read offset, and for a new id
decode only a window from an earlier offset (the read offset before) on; what the window
adds past the text of ids[start:read] is the new text. Unlike vLLM's, the text after every
id is exactly decode(ids) of the whole list, a trailing U+FFFD of a character still missing
bytes included (serve's text offsets are the lengths of those texts), for the decode of each
tokenizer data/tokenizer.py loads; tests/test_incremental_decode.py checks it id by id.

Why a small window decodes to the same text:
- A decoder treats the first piece of its input apart: sentencepiece and Llama 2's
  tokenizer.json drop its leading space (▁word), a fairseq dict.txt puts no space before it.
  The window's start moves on to the read offset only when the ids between have text (not
  all specials that decode to nothing, not a lone ▁), so that treatment falls on ids whose
  text the window does not add.
- Bytes (byte-level BPE, <0xE2> byte-fallback pieces) make a character only together: the
  read offset moves on only where the text does not end in U+FFFD, so a character that is
  still missing bytes is decoded again, whole, once they come.
- What is not local is caught: if the window's text no longer begins with the text of
  ids[start:read], the new id changed text before the read offset. Hugging Face's
  ByteFallback decoder does that: while one character of a run of byte pieces lacks bytes,
  every byte of the run is a U+FFFD. The window then goes back over earlier read offsets,
  twice as far each time, to one whose text stays (before the run), until the text ends
  with a whole character again. As that text changes along the whole run at each
  character, a long run of byte pieces costs its length for each token (a run of 480 bytes
  of emoji: 300 ids decoded a token), not the whole text's.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain, islice

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a character


class IncrementalText:
    """The text of `ids` as ids are pushed: `len()` and `text` are decode(ids) of all of them;
    `stable`: how many leading characters the last push left as they were."""

    def __init__(self, decode, ids=()):
        self._decode = decode
        self.ids = []
        # The text of ids[:read] at each read offset so far, in pieces: _chunks[i] ends at
        # character _ends[i] and is the text of the ids before _reads[i]. The text is that of
        # the first `_kept` of them, then `_tail`.
        self._chunks, self._ends, self._reads = [], [], []
        self._kept = 0
        self._tail = ""
        self._start = 0  # the window's first id (vLLM's prefix_offset)
        self._prefix = ""  # decode(ids[start:read]): the window's text begins with it
        self._back = None  # (kept, start, prefix) of a window further back, while the window's fails
        self._joined = None  # the text, once asked for, until the next push
        self.stable = 0
        self.rewinds = 0  # times an id changed the text before the read offset
        for token_id in ids:
            self.push(token_id)

    def __len__(self):
        return self._length(self._kept) + len(self._tail)

    def _length(self, kept):
        return self._ends[kept - 1] if kept else 0

    @property
    def text(self):
        if self._joined is None:
            self._joined = "".join(self._chunks[: self._kept]) + self._tail
        return self._joined

    def startswith(self, prefix):
        """text.startswith(prefix), in time that grows with len(prefix), not the text's."""
        n = 0
        for piece in chain(islice(self._chunks, self._kept), (self._tail,)):
            if n >= len(prefix):
                break
            if not piece.startswith(prefix[n : n + len(piece)]):
                return False
            n += len(piece)
        return n >= len(prefix)

    def text_from(self, start):
        """text[start:], in time that grows with its length, not the text's."""
        start = max(0, min(start, len(self)))
        committed = self._length(self._kept)
        if start >= committed:
            return self._tail[start - committed :]
        i = bisect_right(self._ends, start, 0, self._kept)
        return self._chunks[i][start - self._length(i) :] + "".join(self._chunks[i + 1 : self._kept]) + self._tail

    def push(self, token_id):
        self.ids.append(token_id)
        self._joined = None
        was = self._kept
        window = self._decode(self.ids[self._start :])
        if window.startswith(self._prefix):
            self._kept, self._back = len(self._reads), None
            self._tail = window[len(self._prefix) :]
        else:  # the new id changed the text of ids[start:read]
            if self._back is not None:
                kept, start, prefix = self._back
                window = self._decode(self.ids[start:])
            if self._back is None or not window.startswith(prefix):
                kept, start, prefix, window = self._rewind(self._back[0] if self._back else len(self._reads))
                self._back = kept, start, prefix
            self._kept, self._tail = kept, window[len(prefix) :]
        self.stable = self._length(min(was, self._kept))
        if not self._tail.endswith(REPLACEMENT):  # (the text before the tail never does)
            self._advance(window)

    def _rewind(self, kept):
        """A window further back than the read offset, whose first ids keep their text:
        Hugging Face's ByteFallback turns a whole run of byte pieces into U+FFFDs while one
        of them is not UTF-8 (a character that has not all its bytes yet). Read offsets
        twice as far back each time; returns (read offsets kept, start, prefix, window's text)."""
        self.rewinds += 1
        step = 1
        while True:
            kept = max(0, kept - step)  # read offsets kept
            first = max(0, kept - step)  # the window starts at the one before them
            start = self._reads[first - 1] if first else 0
            read = self._reads[kept - 1] if kept else 0
            prefix = self._decode(self.ids[start:read]) if read > start else ""
            window = self._decode(self.ids[start:])
            if window.startswith(prefix) and (prefix or start == 0):
                return kept, start, prefix, window
            if start == 0:  # the text changed from the first id on: it is the window's
                return 0, 0, "", window
            step *= 2

    def _advance(self, window):
        """The text ends with a whole character: it stays as it is (the read offsets after
        a window further back are gone for good), and the window's next start is the read
        offset, unless the ids since then have no text to carry a first piece's treatment
        (then the window keeps its start); it reads from here on."""
        if self._back is not None:
            _, self._start, self._prefix = self._back
            del self._chunks[self._kept :], self._ends[self._kept :], self._reads[self._kept :]
            self._back = None
        read = self._reads[-1] if self._reads else 0
        if self._start == read:  # the window is every id: decode(ids[read:]) is its text
            self._prefix = window
        else:
            since = self._decode(self.ids[read:])
            if since:
                self._start, self._prefix = read, since
            else:
                self._prefix = window
        self._chunks.append(self._tail)
        self._ends.append(self._length(self._kept) + len(self._tail))
        self._reads.append(len(self.ids))
        self._kept, self._tail = len(self._reads), ""
