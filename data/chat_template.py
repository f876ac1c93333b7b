"""A model's chat template, rendered exactly as ``transformers``' ``apply_chat_template`` renders it.

Torch-free and transformers-free: ``preprocess`` workers render conversations with only
jinja2 and ``tokenizers``. The Jinja environment is transformers' own
(``transformers/utils/chat_template_utils.py``, ``_compile_jinja_template``): a sandbox
with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, its ``tojson``
filter (no HTML escaping), ``raise_exception``, ``strftime_now``, and the
``{% generation %}`` marker that records which characters the assistant generates. The
variables are transformers' too: ``messages`` (keys whose value is null dropped, reasoning
fields aliased), ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the named
special tokens of the tokenizer's configs (``bos_token``, ``eos_token``, ...). Nothing else is
passed, so a template that prints a date without being given one (Llama 3.1's "Today Date")
renders its own default, as ``apply_chat_template`` does.

The template is, first match wins: ``preprocess --chat-template FILE``; ``chat_template.jinja``
beside the tokenizer (transformers 5 saves it there, and it wins over the config's, as when
transformers loads the directory); ``tokenizer_config.json``'s ``chat_template`` (a string,
or a list of ``{name, template}`` of which "default" is taken).
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from data.errors import DataError
from data.hf_tokenizer import CHAT_TEMPLATE_FILE

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template passes to the template.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _directory(hf_path: str | Path) -> Path:
    path = Path(hf_path)
    return path if path.is_dir() else path.parent


def _json_file(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); fix it or remove it") from None
    return data if isinstance(data, dict) else {}


def _template_of_config(config_path: Path):
    template = _json_file(config_path).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DataError(
                f"{config_path} has named chat templates ({', '.join(map(str, named))}) but no 'default'; "
                "pass the one to use with --chat-template FILE"
            )
        template = named["default"]
    return template if isinstance(template, str) and template else None


def read_chat_template(hf_path: str | Path, override: str | Path | None = None) -> str:
    """The template text (see the module docstring for which), or a one-line DataError."""
    if override is not None:
        path = Path(override)
        if not path.is_file():
            raise DataError(f"--chat-template {path} is not a file; pass a Jinja chat template file")
        return path.read_text(encoding="utf-8")
    folder = _directory(hf_path)
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _template_of_config(folder / "tokenizer_config.json")
    if template is None:
        raise DataError(
            f"{hf_path} has no chat template (no {CHAT_TEMPLATE_FILE}, no chat_template in tokenizer_config.json); "
            "conversations need one: pass --chat-template FILE"
        )
    return template


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def template_variables(hf_path: str | Path) -> dict[str, str]:
    """The named special tokens the configs set, as apply_chat_template passes them
    (special_tokens_map.json's entries win over tokenizer_config.json's)."""
    folder = _directory(hf_path)
    merged = {**_json_file(folder / "tokenizer_config.json"), **_json_file(folder / "special_tokens_map.json")}
    variables = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = merged.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            variables[name] = value
    return variables


def model_eos_ids(hf_path: str | Path) -> list[int]:
    """``eos_token_id`` of config.json and generation_config.json (an int or a list): the
    tokens that end a turn in chat models whose eos_token ends only documents (Llama 3's
    <|eot_id|>, Qwen's <|im_end|>)."""
    folder = _directory(hf_path)
    ids = []
    for name in ("config.json", "generation_config.json"):
        value = _json_file(folder / name).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids


def has_generation_markers(template: str) -> bool:
    """transformers' own test for return_assistant_tokens_mask."""
    return re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None


def _normalized(messages: list[dict]) -> list[dict]:
    """transformers' _normalize_chat_messages and _alias_reasoning_fields: null keys dropped
    (datasets fills a key one message lacks with null), reasoning copied under its names."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: list[dict], variables: dict, add_generation_prompt: bool = False):
    """(text, generation spans): the rendering and the [start, end) character spans inside
    ``{% generation %}`` blocks. Raises jinja2's errors (the caller names the row)."""
    compiled = _compiled(template)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with compiled.environment.activate_tracker(blocks, spans):
        for block in compiled.generate(
            messages=_normalized(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        ):
            blocks.append(block)
    return "".join(blocks), spans


@lru_cache(maxsize=8)
def _compiled(template: str):
    """transformers' _cached_compile_jinja_template, line for line where it matters."""
    import jinja2
    import jinja2.ext
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class AssistantTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._tracking = ContextVar("assistant_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context, caller):
            rv = caller()
            if (tracking := self._tracking.get()) is not None:
                rendered_blocks, generation_indices = tracking
                start = len("".join(rendered_blocks))
                generation_indices.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, rendered_blocks, generation_indices):
            token = self._tracking.set((rendered_blocks, generation_indices))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # Dunder attributes would reach CPython internals from an untrusted template.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def compile_or_refuse(template: str, where: str) -> None:
    """A template that does not even parse is refused before any row is read."""
    import jinja2

    try:
        _compiled(template)
    except jinja2.TemplateError as e:
        raise DataError(
            f"the chat template of {where} does not parse: {e}; fix it or pass --chat-template FILE"
        ) from None
