"""Small ChatML chat templates that are not prefix-stable, modelled on the official templates of three model
families, and a local tokenizer directory (Qwen3's tokenizer) with one of them: what continuous-tokens mode
is tested with (tests/unit/test_continuous_tokens.py, tests/e2e/test_continuous_tokens.py).

- :data:`STRIPS_REASONING` (Qwen3, DeepSeek-R1): an assistant turn's ``<think>`` block only after the
  last user message; earlier turns lose it once a user speaks again.
- :data:`DROPS_ANALYSIS` (gpt-oss harmony): the analysis channel only in the conversation's last message;
  every earlier assistant turn keeps its final channel alone.
- :data:`MARKS_LAST_USER`: the last user message is marked (`` [latest]``); it loses the mark once another
  user message follows.
- :data:`NUMBERS_USERS`: each user message says its number; prefix-stable in itself, but what it writes for
  new messages depends on the conversation before them, so it cannot be served at all.
"""

from __future__ import annotations

import json
from pathlib import Path

from edge.tokens.tokenizer import load_tokenizer

_TEMPLATE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' + (messages[0].content + '\\n\\n' if has_system else '') + '# Tools\\n<tools>\\n'
        + (tools | map('tojson') | join('\\n')) + '\\n</tools><|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\\n' + @USER@ + '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none and (@KEEP@) -%}
            {{- @REASONING@ -}}
        {%- endif -%}
        {{- message.content or '' -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function -%}
            {%- set arguments = fn.arguments if fn.arguments is string else fn.arguments | tojson -%}
            {%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + arguments + '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""
_THINK = "'<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n'"
_ANALYSIS = ("'<|channel|>analysis<|message|>' + message.reasoning_content + '<|end|><|start|>assistant"
             "<|channel|>final<|message|>'")


def _template(*, user: str = "message.content", keep: str = "true", reasoning: str = _THINK) -> str:
    return _TEMPLATE.replace("@USER@", user).replace("@KEEP@", keep).replace("@REASONING@", reasoning).strip()


PREFIX_STABLE = _template()
STRIPS_REASONING = _template(keep="loop.index0 > ns.last_user")
DROPS_ANALYSIS = _template(keep="loop.last", reasoning=_ANALYSIS)
MARKS_LAST_USER = _template(user="message.content + (' [latest]' if loop.index0 == ns.last_user else '')")
NUMBERS_USERS = _template(user="'(message ' ~ loop.index ~ ') ' + message.content")


def tokenizer_dir(directory: Path, source: str) -> str:
    """A local tokenizer directory in ``directory``: Qwen3's tokenizer with chat template ``source``; its
    path, for ``--tokenizer``."""
    directory.mkdir(parents=True, exist_ok=True)
    saved = load_tokenizer("builtin:qwen3").save(directory)
    config = json.loads((saved / "tokenizer_config.json").read_text())
    (saved / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source}))
    return str(saved)
