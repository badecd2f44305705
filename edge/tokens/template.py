"""Chat templates: Hugging Face-style Jinja templates, compiled once, rendered in a sandbox.

The environment matches what ``transformers`` gives a chat template (without importing
it): ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``raise_exception`` global, and a ``tojson`` filter that is plain ``json.dumps`` with
``ensure_ascii=False`` (Jinja's own filter escapes ``<``, ``>``, ``&`` and ``'``, which
would change what the model sees). Rendering is deterministic: no ``strftime_now``.

A template that does not compile is a configuration error (:class:`ValueError`); one
that refuses a conversation while rendering (say, an unknown role) raises
:class:`ChatTemplateError`, a :class:`MalformedRequest`.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any, NoReturn

import jinja2
import msgspec
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edge.chat.cache import BoundedCache
from schemas.errors import ChatTemplateError

_TEMPLATES_PACKAGE = "edge.tokens"
_TEMPLATES_DIR = "templates"


_TOJSON_CACHE: BoundedCache[tuple[bytes, bool, int | None, tuple[str, str] | None, bool], str] = BoundedCache(
    max_items=4096)
_key_encoder = msgspec.json.Encoder()


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's ``tojson``. Tool schemas are dumped on every new chain's render, so dicts and lists are
    cached by their compact encoding (a JSON value decoded from a request: no NaN, one spelling)."""
    if not isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    try:
        key = (_key_encoder.encode(value), ensure_ascii, indent, separators, sort_keys)
    except (TypeError, msgspec.EncodeError):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    text = _TOJSON_CACHE.get(key)
    if text is None:
        text = _TOJSON_CACHE.put(key, json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                                                 separators=separators, sort_keys=sort_keys), 2 * len(key[0]))
    return text


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


_ENV = _environment()


def builtin_template_source(name: str) -> str:
    """The source of a template shipped in ``edge/tokens/templates/`` (``"qwen2.5"``)."""
    path = resources.files(_TEMPLATES_PACKAGE).joinpath(_TEMPLATES_DIR, f"{name}.jinja")
    if not path.is_file():
        raise ValueError(f"no builtin chat template named {name!r}")
    return path.read_text(encoding="utf-8")


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token
        tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._defaults = {key: value for key, value in tokens.items() if value is not None}

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` (and ``tools``); extra keyword arguments reach the template."""
        context = {**self._defaults, **kwargs}
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. a template adding None to a str
            raise ChatTemplateError(f"chat template refused the conversation: {exc}") from exc
