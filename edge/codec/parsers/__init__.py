"""Tool-call parsers by ``--tool-format`` (``multi_turn.format``) name.

=====================================  ==========================================  ===================
name                                   reads                                       matching template
=====================================  ==========================================  ===================
``hermes`` (``qwen``, ``qwen25``,      ``<tool_call>\\n{"name", "arguments"}\\n``    ``builtin:qwen2.5``,
``qwen2_5``)                           ``</tool_call>``                            ``builtin:qwen3``
``qwen3_coder``                        ``<tool_call>\\n<function=NAME>\\n``          ``builtin:qwen3-coder``
                                       ``<parameter=KEY>\\nVALUE\\n</parameter>...``
``llama3`` (``llama3_json``)           ``{"name", "parameters"}``, optionally       Llama 3.1+ templates
                                       after ``<|python_tag|>``, ``;``-separated
``smollm2``                            ``<tool_call>[{"name", "arguments"}, ...]``   ``builtin:smollm2``
                                       ``</tool_call>`` (a JSON list)
``none``                               nothing: all text is content                any
``sglang:NAME``                        SGLang's detector ``NAME`` (needs sglang)   the model's own
=====================================  ==========================================  ===================

A name that no built-in parser claims is looked up among SGLang's parsers when
``sglang`` is importable, so ``--tool-format kimi_k2`` works on a machine with SGLang.
Built-in names always mean the built-in parser (the same behaviour with or without
SGLang); ``sglang:NAME`` asks for SGLang's even then.
"""

from __future__ import annotations

from collections.abc import Callable

from edge.codec.parsers.base import PlainParser, ToolParser
from edge.codec.parsers.hermes import HermesParser
from edge.codec.parsers.llama3 import Llama3JsonParser
from edge.codec.parsers.qwen3_coder import Qwen3CoderParser
from edge.codec.parsers.sglang_adapter import PREFIX as SGLANG_PREFIX
from edge.codec.parsers.sglang_adapter import SGLangParser, sglang_parser_names
from edge.codec.parsers.smollm2 import SmolLM2Parser

BUILTIN: dict[str, Callable[[], ToolParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "qwen25": HermesParser,
    "qwen2_5": HermesParser,
    "qwen3_coder": Qwen3CoderParser,
    "llama3": Llama3JsonParser,
    "llama3_json": Llama3JsonParser,
    "smollm2": SmolLM2Parser,
    "none": PlainParser,
}

__all__ = ["BUILTIN", "Llama3JsonParser", "Qwen3CoderParser", "SGLangParser", "SmolLM2Parser", "make_parser",
           "sglang_parser_names"]


def make_parser(name: str) -> ToolParser:
    """The parser for ``name``; :class:`ValueError` naming the choices when there is none."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if name.startswith(SGLANG_PREFIX):
        return SGLangParser(name.removeprefix(SGLANG_PREFIX))
    if name in sglang_parser_names():
        return SGLangParser(name)
    sglang = "sglang's parsers as sglang:NAME" if sglang_parser_names() else "sglang is not installed"
    raise ValueError(f"unknown tool format {name!r}; expected one of {sorted(BUILTIN)} ({sglang})")
