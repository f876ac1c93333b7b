"""Text out of token ids for `serve`: continuations decoded in context, stop strings, and
the character offsets of OpenAI's legacy logprobs. Torch-free."""

_CONTEXT = 8  # prompt tokens decoded with a continuation: enough for a piece's leading space


def continuation_text(decode, context_ids, new_ids):
    """The text `new_ids` add after `context_ids`. Decoded together, because a sentencepiece
    piece's leading space (▁word) shows only after other text; byte-level BPE is the same
    either way."""
    context = list(context_ids[-_CONTEXT:])
    before = decode(context)
    whole = decode(context + list(new_ids))
    return whole[len(before) :] if whole.startswith(before) else decode(new_ids)


def text_offsets(decode, prompt_ids, new_ids):
    """Each token's first character in decode(prompt) + continuation_text(prompt, new), as
    OpenAI's text_offset; a token that ends inside a character gets that character's offset."""
    offsets = [len(decode(prompt_ids[:i])) for i in range(len(prompt_ids))]
    base = len(decode(prompt_ids))
    return offsets + [base + len(continuation_text(decode, prompt_ids, new_ids[:j])) for j in range(len(new_ids))]


class StopText:
    """A continuation's text as tokens arrive: `push` returns what may be sent now, holding
    back a tail that may yet become a stop string (or half of a character); once a stop
    string appears the text ends before it and `stopped` is set."""

    def __init__(self, decode_new, stops):
        self._decode_new = decode_new  # new ids -> their text
        self._stops = stops
        self.ids, self.text, self.sent, self.stopped = [], "", 0, False

    def push(self, token_id):
        self.ids.append(token_id)
        self.text = self._decode_new(self.ids)
        cuts = [i for i in (self.text.find(s) for s in self._stops) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[: min(cuts)], True
            return self._send(len(self.text))
        hold = max([_overlap(self.text, s) for s in self._stops] + [1 if self.text.endswith("\ufffd") else 0])
        return self._send(len(self.text) - hold)

    def flush(self):
        return self._send(len(self.text))

    def _send(self, upto):
        delta = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta

    def kept_tokens(self, prompt_len, offsets):
        """How many new tokens start before the text's end (the rest fell after a stop string)."""
        end = prompt_len + len(self.text)
        return sum(1 for o in offsets if o < end) if self.stopped else len(self.ids)


def _overlap(text, stop):
    """The longest end of `text` that begins `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
