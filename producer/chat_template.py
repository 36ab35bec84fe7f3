"""A model's chat template, rendered the one way every part of conveyor renders it.

The template is the model's own Jinja source (``chat_template`` in tokenizer_config.json,
or a ``chat_template.jinja`` file beside it), registered with the model so that workers and
producers that count prompt tokens (the gateway, bulk) render it alike. Rendering follows
transformers' ``apply_chat_template``: a sandboxed, immutable Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, ``raise_exception`` and
``strftime_now`` as globals, a ``tojson`` filter that keeps non-ASCII text, and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables. The rendered
text is then tokenized without adding special tokens: the template writes them itself.

A template is untrusted text from a checkpoint: the sandbox refuses attribute access to
Python internals, and an ``ImmutableSandboxedEnvironment`` cannot change the messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The special tokens transformers passes to a template, by their tokenizer_config.json names.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")
# The model hash's fields that carry a registered template.
CHAT_FIELDS = ("chat_template", "chat_special_tokens")
# Largest template source accepted (real ones are a few KB; Llama 3.1's is about 4 KB).
MAX_TEMPLATE_CHARS = 64 * 1024


class ChatTemplateError(ValueError):
    """The template refused the messages (its ``raise_exception``), or failed to render."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may name."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None,
                 now: Callable[[], datetime] = datetime.now) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("a chat template must be a non-empty string")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"chat template longer than {MAX_TEMPLATE_CHARS} characters")
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        # strftime_now reads this clock (Llama 3.1's template writes today's date).
        self.now = now
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any], template_file: str | None = None,
                              now: Callable[[], datetime] = datetime.now) -> ChatTemplate | None:
        """The template of a tokenizer_config.json (its ``chat_template``, else the text of a
        ``chat_template.jinja`` file), or None when the model has none."""
        source = config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError("the chat templates are named "
                                 f"{', '.join(sorted(map(str, named)))}: none is 'default'")
            source = named["default"]
        if source is None:
            source = template_file
        if not source:
            return None
        return cls(source, special_tokens_of(config), now)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path,
                       now: Callable[[], datetime] = datetime.now) -> ChatTemplate | None:
        """The folder's template, found where transformers finds it: ``chat_template.jinja``
        first, else tokenizer_config.json's; special tokens from tokenizer_config.json, and
        from special_tokens_map.json for those it does not name (older checkpoints)."""
        folder = Path(model_dir)
        config = _json_file(folder / "tokenizer_config.json")
        for name, value in _json_file(folder / "special_tokens_map.json").items():
            config.setdefault(name, value)
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            config = {**config, "chat_template": None}
            return cls.from_tokenizer_config(config, jinja_path.read_text(), now)
        return cls.from_tokenizer_config(config, None, now)

    def to_registration(self) -> dict[str, str]:
        """The model hash's fields that carry this template (producer.client.models reads them)."""
        return dict(zip(CHAT_FIELDS, (self.source, json.dumps(self.special_tokens,
                                                               sort_keys=True)), strict=True))

    @classmethod
    def from_registration(cls, info: Mapping[str, Any]) -> ChatTemplate | None:
        """The template a worker registered with its model (None: the model has none)."""
        source = info.get("chat_template")
        if not source:
            return None
        tokens = info.get("chat_special_tokens") or "{}"
        return cls(source, json.loads(tokens) if isinstance(tokens, str) else tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for ``messages``; ChatTemplateError when the template refuses them.
        ``extra``: a request's chat_template_kwargs, more variables for the template (their
        names never the renderer's own: producer.wire.messages.validate_template_kwargs).
        ``tools``: the functions offered (OpenAI's form, as transformers passes them)."""
        # OpenAI's "developer" role is its newer name for "system"; templates know only
        # the older one.
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m
                    for m in messages]
        try:
            # One mapping, not keywords: a variable may be called anything (even "self").
            return self._template.render({
                **(extra or {}), "messages": messages,
                "add_generation_prompt": add_generation_prompt, "tools": tools or None,
                "documents": None, "strftime_now": self._strftime_now,
                **self.special_tokens})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template refused the messages: "
                                    f"{exc}") from None
        except Exception as exc:  # noqa: BLE001 (untrusted code: any failure is the request's)
            # A template is code from a checkpoint run on a client's messages: whatever it
            # raises (OverflowError of the sandbox's range, RecursionError, ...) is this
            # request's error, never the thread's that renders it.
            raise ChatTemplateError(f"the model's chat template failed on these messages "
                                    f"({type(exc).__name__}: {str(exc)[:200]})") from None

    def _strftime_now(self, fmt: str) -> str:
        return self.now().strftime(fmt)


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens of a tokenizer_config.json as strings (an AddedToken entry is a
    map with its text under ``content``)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks the assistant's part for training
    masks in transformers): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols,
                                                    _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env
