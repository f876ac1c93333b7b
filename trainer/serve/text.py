"""Text out of token ids for `serve`: continuations decoded in context, stop strings, and
the character offsets of OpenAI's legacy logprobs. Torch-free.

Every text here grows by a token at a time and is decoded incrementally
(data/incremental_decode.py): the same text as decoding all the ids again for each token,
in time that grows with the tokens, not with their square (a 4,000-token echo with
logprobs held the event loop for about 2 s that way; bench/bench_serve_decode.py)."""

from data.incremental_decode import REPLACEMENT, IncrementalText

_CONTEXT = 8  # prompt tokens decoded with a continuation: enough for a piece's leading space


def continuation_text(decode, context_ids, new_ids):
    """The text `new_ids` add after `context_ids`. Decoded together, because a sentencepiece
    piece's leading space (▁word) shows only after other text; byte-level BPE is the same
    either way."""
    context = list(context_ids[-_CONTEXT:])
    before = decode(context)
    whole = decode(context + list(new_ids))
    return whole[len(before) :] if whole.startswith(before) else decode(new_ids)


class ContinuationText:
    """continuation_text(decode, context_ids, ids) as ids are pushed, with IncrementalText's
    interface: ids, push, len(), text, text_from, stable."""

    def __init__(self, decode, context_ids):
        self._decode = decode
        self._whole = IncrementalText(decode, list(context_ids[-_CONTEXT:]))
        self._before = self._whole.text
        self._in_context = True  # the whole text begins with the context's
        self._alone = None  # decode(ids) without the context: once the whole text does not
        self.ids, self.stable = [], 0

    def push(self, token_id):
        self.ids.append(token_id)
        self._whole.push(token_id)
        if self._alone is not None:
            self._alone.push(token_id)
        was = self._in_context
        if self._whole.stable < len(self._before):  # else its start is as it was
            self._in_context = self._whole.startswith(self._before)
        if self._in_context:
            self.stable = max(0, self._whole.stable - len(self._before)) if was else 0
            return
        if self._alone is None:
            self._alone = IncrementalText(self._decode, self.ids)
        self.stable = self._alone.stable if not was else 0

    def __len__(self):
        return len(self._whole) - len(self._before) if self._in_context else len(self._alone)

    def text_from(self, start):
        if self._in_context:
            return self._whole.text_from(len(self._before) + start)
        return self._alone.text_from(start)

    @property
    def text(self):
        return self.text_from(0)


def text_offsets(decode, prompt_ids, new_ids):
    """Each token's first character in decode(prompt) + continuation_text(prompt, new), as
    OpenAI's text_offset; a token that ends inside a character gets that character's offset."""
    prompt, offsets = IncrementalText(decode), []
    for token_id in prompt_ids:
        offsets.append(len(prompt))  # len(decode(prompt_ids[:i]))
        prompt.push(token_id)
    new = ContinuationText(decode, prompt_ids)
    for token_id in new_ids:
        offsets.append(len(prompt) + len(new))  # + len(continuation_text(prompt, new_ids[:j]))
        new.push(token_id)
    return offsets


class StopText:
    """A continuation's text as tokens arrive (`text`: an IncrementalText or ContinuationText):
    `push` returns what may be sent now, holding back a tail that may yet become a stop
    string (or half of a character); once a stop string appears the text ends before it and
    `stopped` is set. Each push reads only the text's end: what the push changed, and the
    longest stop string's length before it."""

    def __init__(self, text, stops):
        self._text, self._stops = text, stops
        self._back = max([len(s) for s in stops] + [1])
        self.sent, self.stopped, self._cut = 0, False, None

    @property
    def ids(self):
        return self._text.ids

    @property
    def text(self):
        return self._cut if self.stopped else self._text.text

    def push(self, token_id):
        self._text.push(token_id)
        end = len(self._text)
        # Text before `stable` is as the last push left it, without a stop string: one can
        # only end after it. `lo` also reaches back to what is unsent and to a stop's length.
        lo = max(0, min(self._text.stable, self.sent, end) - self._back)
        tail = self._text.text_from(lo)  # text[lo:]
        cuts = [i for i in (tail.find(s) for s in self._stops) if i >= 0]
        if cuts:
            self._cut, self.stopped = self._text.text[: lo + min(cuts)], True
            return self._send(tail, lo, lo + min(cuts))
        hold = max([_overlap(tail, s) for s in self._stops] + [1 if tail.endswith(REPLACEMENT) else 0])
        return self._send(tail, lo, end - hold)

    def flush(self):
        if self.stopped:
            return self._send(self._cut, 0, len(self._cut))
        lo = min(self.sent, len(self._text))
        return self._send(self._text.text_from(lo), lo, len(self._text))

    def _send(self, tail, lo, upto):
        """text[sent:upto] (tail: text[lo:], lo <= sent)."""
        delta = tail[self.sent - lo : upto - lo] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

    def kept_tokens(self, prompt_len, offsets):
        """How many new tokens start before the text's end (the rest fell after a stop string)."""
        if not self.stopped:
            return len(self.ids)
        return sum(1 for o in offsets if o < prompt_len + len(self._cut))


def _overlap(text, stop):
    """The longest end of `text` that begins `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
