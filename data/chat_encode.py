"""Conversations (SFT) and preference pairs (DPO) -> token ids and their targets.

A **conversation** (a row's ``messages``: a list of ``{role, content}``, roles system, user,
assistant) is one sequence: the ids of its full rendering by the chat template, exactly
``apply_chat_template(messages, tokenize=True)``'s (the rendering tokenized without the
tokenizer's own special tokens, and no eos appended: the template ends each turn).

Its **targets** (the tokens the loss is taken on):

* with ``{% generation %}`` markers in the template: exactly transformers'
  ``return_assistant_tokens_mask`` (every token overlapping a generation block's characters);
* without: for each assistant message, from the token holding the first character of its
  content as rendered (found in the rendering by searching forward after the previous
  message; as given, trimmed, or the answer after ``</think>`` for templates that drop old
  reasoning) through the first end-of-turn token after the content: the tokenizer's
  eos_token or an ``eos_token_id`` of config.json/generation_config.json (Llama 3's
  <|eot_id|>, Qwen's <|im_end|>). Not the role header before, not the whitespace after.
  Where no end-of-turn token follows before the next message, the target ends with the
  content's last token (the model then never learns to stop: prefer a template that ends
  turns with one).

A **preference pair** (``prompt``, ``chosen``, ``rejected``; TRL's format: lists of messages,
or plain strings) is two sequences, prompt+chosen and prompt+rejected, tokenized as TRL 1.16's
DPOTrainer does: conversational, the prompt rendered with ``add_generation_prompt=True`` and
each whole conversation rendered, the completion starting where the prompt's tokens and the
whole's diverge (the shorter of the two common prefixes); plain strings, eos_token appended
to chosen and rejected unless they end with it, each text tokenized with the tokenizer's
special tokens. The targets are the completion's tokens, so both sequences share their
prompt tokens.

A bad row raises ``RowError`` (what is wrong and the fix); the caller names the row.
"""

from __future__ import annotations

from data.chat_template import has_generation_markers, render
from data.hf_tokenizer import HFTokenizer

# "tool" is refused: tool results render under other headers (Llama's ipython, Qwen's
# user <tool_response>), and which of their tokens to train on is no rule we could state here.
ROLES = ("system", "user", "assistant")


class RowError(Exception):
    """One bad row: the message says what is wrong and how to fix it, without the row's name."""


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def _check_messages(messages, what: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError(f"has no {what} (null or empty); give it a non-empty list of {{role, content}} or drop the row")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"{what}[{k}] is not a {{role, content}} object; fix the row")
        role = message.get("role")
        if role not in ROLES:
            raise RowError(
                f"{what}[{k}] has role {role!r}; the roles are {', '.join(ROLES)} (tool messages are not supported): "
                "fix or drop the row"
            )
        if not isinstance(message.get("content"), str):
            raise RowError(f"{what}[{k}] ({role}) has no text content; give every message a string 'content'")
        if role == "assistant" and not message["content"].strip():
            raise RowError(f"{what}[{k}] is an empty assistant reply; fill it or drop the row")


def _content_candidates(message: dict) -> list[str]:
    content = message["content"]
    candidates = [content, content.strip()]
    if "</think>" in content:
        candidates.append(content.split("</think>")[-1].strip())
    return [c for c in candidates if c]


def _content_positions(messages: list[dict], text: str) -> list[tuple[int, int] | None]:
    """Each message's content as [start, end) in the rendering, searched in order; None where
    the template does not render it verbatim (or it is empty)."""
    cursor, positions = 0, []
    for message in messages:
        found = None
        for candidate in _content_candidates(message):
            at = text.find(candidate, cursor)
            if at >= 0:
                found = (at, at + len(candidate))
                break
        positions.append(found)
        if found:
            cursor = found[1]
    return positions


def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """transformers' apply_chat_template loop for assistant_masks: a token is in the mask
    when it overlaps a span (spans and offsets both in order, so one pass)."""
    mask = [0] * len(offsets)
    span = 0
    for i, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[i] = 1
    return mask


class ChatEncoder:
    """One tokenizer + template: renders and tokenizes rows (made once per worker)."""

    def __init__(self, tokenizer_json: str, template: str, variables: dict, model_eos_ids: list[int]):
        """``model_eos_ids``: config.json's and generation_config.json's eos_token_id; those that
        are special tokens end a turn, as the tokenizer's eos does."""
        self.tokenizer = HFTokenizer(tokenizer_json)
        self.template = template
        self.variables = dict(variables)
        specials = set(self.tokenizer.special_token_ids())
        self.end_of_turn = {self.tokenizer.eos} | {i for i in model_eos_ids if i in specials}
        self.markers = has_generation_markers(template)

    def _render(self, messages, add_generation_prompt: bool):
        try:
            return render(self.template, messages, self.variables, add_generation_prompt)
        except Exception as e:  # jinja's errors, and whatever a template's expression raises
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise RowError(
                f"the chat template failed to render it ({type(e).__name__}: {reason}); fix the row, "
                "or pass a template that renders it with --chat-template FILE"
            ) from None

    def rendered_ids(self, messages, add_generation_prompt: bool = False) -> list[int]:
        text, _ = self._render(messages, add_generation_prompt)
        return self.tokenizer.encoding(text, add_special_tokens=False).ids

    def conversation(self, messages) -> tuple[list[int], list[int]]:
        """(ids, targets) of one conversation (see the module docstring)."""
        _check_messages(messages, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise RowError("has no assistant turn, so nothing to train on; add the assistant's reply or drop the row")
        text, spans = self._render(messages, False)
        encoding = self.tokenizer.encoding(text, add_special_tokens=False)
        ids, offsets = encoding.ids, encoding.offsets
        if self.markers:
            targets = spans_to_mask(offsets, spans)
        else:
            targets = self._turn_targets(messages, text, ids, offsets)
        if not any(targets):
            raise RowError("renders no assistant tokens (the template drops them); fix the template or the row")
        return ids, targets

    def _turn_targets(self, messages, text, ids, offsets) -> list[int]:
        positions = _content_positions(messages, text)
        targets = [0] * len(ids)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if positions[k] is None:
                raise RowError(
                    f"the template does not render messages[{k}]'s content as given, so its tokens cannot be "
                    "found; pass a template with {% generation %} markers with --chat-template FILE"
                )
            start, end = positions[k]
            following = next((p[0] for p in positions[k + 1 :] if p is not None), len(text))
            first = next(i for i, (_, token_end) in enumerate(offsets) if token_end > start)
            last, stop = first, None
            for i in range(first, len(ids)):
                token_start = offsets[i][0]
                if token_start >= following:
                    break
                if token_start >= end and ids[i] in self.end_of_turn:
                    stop = i
                    break
                if token_start < end:
                    last = i
            stop = last if stop is None else stop
            targets[first : stop + 1] = [1] * (stop + 1 - first)
        return targets

    def preference_pair(self, prompt, chosen, rejected) -> tuple[list[int], list[int], int]:
        """(prompt+chosen ids, prompt+rejected ids, prompt length): TRL's DPO tokenization."""
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if value is None or len(value) == 0:
                raise RowError(
                    f"has an empty {name}; every pair needs a non-empty chosen and rejected, or drop the row"
                )
        kinds = {type(v).__name__ for v in (prompt, chosen, rejected)}
        if kinds == {"list"}:
            _check_messages(prompt, "prompt")
            _check_messages(chosen, "chosen")
            _check_messages(rejected, "rejected")
            prompt_ids = self.rendered_ids(prompt, add_generation_prompt=True)
            chosen_ids = self.rendered_ids(prompt + chosen)
            rejected_ids = self.rendered_ids(prompt + rejected)
        elif kinds == {"str"}:
            eos = self.tokenizer.tokens["eos"]
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
            prompt_ids, chosen_ids, rejected_ids = (
                self.tokenizer.encoding(t, add_special_tokens=True).ids
                for t in (prompt, prompt + chosen, prompt + rejected)
            )
        else:
            raise RowError(
                "mixes strings and message lists in prompt/chosen/rejected; make all three lists of messages "
                "(conversational) or all three strings"
            )
        prompt_length = min(
            common_prefix_length(prompt_ids, chosen_ids), common_prefix_length(prompt_ids, rejected_ids)
        )
        if prompt_length >= min(len(chosen_ids), len(rejected_ids)):
            raise RowError("has a chosen or rejected that adds no tokens after the prompt; fix or drop the row")
        return chosen_ids, rejected_ids, prompt_length
