"""serve's text before incremental decoding (trainer/serve/text.py before
data/incremental_decode.py): every prefix decoded again for each token. bench_serve_decode.py
times it against the new code; tests/test_incremental_decode.py takes it as the reference."""


def old_continuation_text(decode, context_ids, new_ids):
    context = list(context_ids[-8:])
    before = decode(context)
    whole = decode(context + list(new_ids))
    return whole[len(before) :] if whole.startswith(before) else decode(new_ids)


def old_text_offsets(decode, prompt_ids, new_ids):
    offsets = [len(decode(prompt_ids[:i])) for i in range(len(prompt_ids))]
    base = len(decode(prompt_ids))
    return offsets + [base + len(old_continuation_text(decode, prompt_ids, new_ids[:j])) for j in range(len(new_ids))]


class OldStopText:
    def __init__(self, decode_new, stops):
        self._decode_new = decode_new
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
        end = prompt_len + len(self.text)
        return sum(1 for o in offsets if o < end) if self.stopped else len(self.ids)


def _overlap(text, stop):
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
