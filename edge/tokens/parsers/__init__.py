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
``sglang:NAME``                        SGLang's detector ``NAME`` (44 of them:     the model's own
                                       ``kimi_k2``, ``deepseekv3``, ``glm45``, ...)
=====================================  ==========================================  ===================

Reasoning formats (``--reasoning-format``, :func:`make_reasoning`): ``think``, the built-in
``<think> … </think>`` (:mod:`edge.tokens.reasoning`), and ``sglang:NAME``, SGLang's reasoning
parser ``NAME`` (``qwen3``, ``deepseek-r1``, ``kimi_k2``, ``gpt-oss``, ...).

``sglang:`` names need the ``sglang`` extra (README, Install); a built-in name always means
the built-in parser. Which built-ins are kept beside SGLang's, and why: README, Tokenizer, chat
template and tool format.
"""

from __future__ import annotations

from collections.abc import Callable

from edge.tokens.parsers.base import PlainParser, ToolParser
from edge.tokens.parsers.hermes import HermesParser
from edge.tokens.parsers.llama3 import Llama3JsonParser
from edge.tokens.parsers.qwen3_coder import Qwen3CoderParser
from edge.tokens.parsers.sglang_adapter import PREFIX as SGLANG_PREFIX
from edge.tokens.parsers.sglang_adapter import SGLangParser, SGLangReasoning, reasoning_parser_names, tool_parser_names
from edge.tokens.parsers.smollm2 import SmolLM2Parser
from edge.tokens.reasoning import ReasoningFormat, ThinkReasoning

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

REASONING_BUILTIN: dict[str, Callable[..., ReasoningFormat]] = {"think": ThinkReasoning}

__all__ = ["BUILTIN", "REASONING_BUILTIN", "Llama3JsonParser", "Qwen3CoderParser", "SGLangParser", "SGLangReasoning",
           "SmolLM2Parser", "make_parser", "make_reasoning", "reasoning_parser_names", "tool_parser_names"]


def make_parser(name: str) -> ToolParser:
    """The parser for ``name``; :class:`ValueError` naming the choices (or why sglang does not import)."""
    if name in BUILTIN:
        return BUILTIN[name]()
    if name.startswith(SGLANG_PREFIX):
        return SGLangParser(name.removeprefix(SGLANG_PREFIX))
    raise ValueError(f"unknown tool format {name!r}; expected one of {sorted(BUILTIN)} or sglang:NAME "
                     "(SGLang's tool-call parser NAME)")


def make_reasoning(name: str, *, starts_open: bool = False) -> ReasoningFormat:
    """The reasoning format for ``name``; ``starts_open``: the generation prompt opened the reasoning."""
    if name in REASONING_BUILTIN:
        return REASONING_BUILTIN[name](starts_open=starts_open)
    if name.startswith(SGLANG_PREFIX):
        return SGLangReasoning(name.removeprefix(SGLANG_PREFIX), starts_open=starts_open)
    raise ValueError(f"unknown reasoning format {name!r}; expected one of {sorted(REASONING_BUILTIN)} or "
                     "sglang:NAME (SGLang's reasoning parser NAME)")
