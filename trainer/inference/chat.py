"""generate --chat: conversations rendered by the model's own chat template, and the ids a
reply stops at.

The template is Jinja text kept with the tokenizer: `chat_template.jinja` (transformers 5
saves it there, and reads it first) or tokenizer_config.json's `chat_template` (a string,
or a list of named templates of which "default" is the one used). It is rendered as
transformers' apply_chat_template renders it, so a model sees exactly the text it was
tuned on, then tokenized without the tokenizer's own specials (the template wrote them).
"""

import json
from pathlib import Path

from data.chat_template import read_chat_template, render, template_variables
from data.errors import DataError
from data.hf_tokenizer import CHAT_TEMPLATE_FILE, HFTokenizer
from trainer.errors import UsageError
from trainer.formats.hf.generation_config import id_list, model_generation_config

_SENTINEL = "\x00shardlm-reply\x00"  # a reply no template can mistake for its own text


def render_chat(template, messages, add_generation_prompt, special_tokens):
    """The text transformers' apply_chat_template(tokenize=False) gives for one conversation
    (data/chat_template.py renders it, as preprocess does)."""
    import jinja2

    try:
        return render(template, messages, special_tokens, add_generation_prompt)[0]
    except jinja2.exceptions.TemplateError as e:
        raise UsageError(f"the chat template refused the conversation: {e}") from None


def chat_template(files_dir):
    """The model's chat template, or a one-line refusal naming where it was looked for."""
    try:
        return read_chat_template(files_dir)
    except DataError:
        raise UsageError(
            f"{files_dir} has no chat template (no {CHAT_TEMPLATE_FILE}, no chat_template in tokenizer_config.json): "
            "--chat needs a chat model's tokenizer; drop --chat to continue plain text"
        ) from None


def special_tokens(files_dir):
    """The special tokens a template may name ({{ bos_token }}), as strings."""
    return template_variables(files_dir)


def stop_ids(tokenizer, files_dir, cfg):
    """Every id generation stops at: the tokenizer's eos, and the eos ids the model's
    config.json and generation_config.json name (trainer/formats/hf/generation_config.py)."""
    ids = [tokenizer.eos]
    if not isinstance(tokenizer, HFTokenizer):  # an HF config's ids mean nothing to another vocabulary
        return ids
    config = model_generation_config(files_dir, cfg)
    listed = id_list(config["eos_token_id"], files_dir) if config else []
    return ids + [i for i in listed if i not in ids]


def end_of_turn_id(template, specials, tokenizer):
    """The special token the template closes an assistant turn with (Llama 3's <|eot_id|>,
    ChatML's <|im_end|>), or None: a model tuned on the template ends its reply with it,
    whether or not its config lists it as an eos."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = render_chat(template, messages, False, specials)
    except UsageError:  # a template that insists on a system message, say: no guess then
        return None
    if _SENTINEL not in text:
        return None
    after = tokenizer.encode_rendered(text.split(_SENTINEL, 1)[1])
    return after[0] if after and after[0] in tokenizer.special_token_ids() else None


def check_messages(messages, where):
    """A conversation: a list of {"role": str, "content": str} (or {"messages": [...]})."""
    if isinstance(messages, dict) and "messages" in messages:
        messages = messages["messages"]
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: a conversation is a non-empty list of {{role, content}} messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UsageError(f'{where}: {json.dumps(m)[:80]} is not a message {{"role": str, "content": str}}')
    return messages


def read_conversations(path):
    """--messages FILE: a .jsonl file holds a conversation per line; a .json file one
    conversation or a list of them."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--messages {path}: cannot read it ({type(e).__name__}); pass a JSON or JSONL file") from None
    try:
        if path.suffix == ".jsonl":
            lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            return [check_messages(json.loads(line), f"{path}:{n}") for n, line in lines]
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--messages {path} is not valid JSON ({e}); fix it") from None
    if isinstance(data, list) and data and all(isinstance(c, (list, dict)) and not _is_message(c) for c in data):
        return [check_messages(c, f"{path}[{n}]") for n, c in enumerate(data)]
    return [check_messages(data, str(path))]


def _is_message(x):
    return isinstance(x, dict) and "role" in x
