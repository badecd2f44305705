"""Holding scripted replies to the constraint a request carries, with llguidance (as an engine would).

:func:`grammar_checker` builds the ``checker`` of the scripted servers (:mod:`rollbus.testing.scripted`):
it reads SGLang's ``json_schema`` / ``ebnf`` / ``regex`` and vLLM's ``structured_outputs``
(``json`` / ``grammar`` / ``regex``) and answers why a reply's tokens are outside them (None: inside).
A reply must end the grammar (its end-of-turn token included) to be admitted.
"""

from __future__ import annotations

import json
from typing import Any

from edge.engines.grammar import GrammarTokenizer
from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.scripted import Checker


def grammar_of(constraint: dict[str, Any]) -> str:
    """The constraint parameters (either engine's) as one llguidance grammar."""
    import llguidance

    schema = constraint.get("json_schema", constraint.get("json"))
    if schema is not None:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(text)
    if "regex" in constraint:
        return llguidance.LLMatcher.grammar_from_regex(constraint["regex"])
    return constraint.get("ebnf", constraint.get("grammar", ""))


def grammar_checker(tokenizer: Tokenizer, vocab_size: int | None = None) -> Checker:
    """A checker over ``tokenizer``'s vocabulary (``vocab_size``: the model's, when larger)."""
    grammar = GrammarTokenizer(tokenizer.to_json(), vocab_size or tokenizer.vocab_size, tokenizer.stop_token_ids)

    def check(constraint: dict[str, Any], token_ids: list[int]) -> str | None:
        matcher = grammar.matcher(grammar_of(constraint))
        if not matcher.accepts(token_ids):
            return "a token the grammar does not admit"
        return None if matcher.accepts_end(token_ids) else "the reply ends before the grammar does"

    return check


__all__ = ["grammar_checker", "grammar_of"]
