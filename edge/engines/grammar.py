"""Constrained decoding for the local engine, with llguidance (``pip install 'rollbus[local]'``).

A :class:`~edge.engines.base.Constraint`'s ``grammar`` (llguidance's Lark dialect) is compiled
against the session's tokenizer into a matcher per request; before each token the matcher says
which tokens the grammar admits (:meth:`TokenMatcher.allowed`), the engine samples among them, and
the matcher consumes the token. When the grammar is complete only the end-of-turn tokens remain.

Why llguidance (measured on this machine, ``tests``-sized grammars: a forced Hermes call with a
schema'd ``arguments`` object, the Qwen2.5 and SmolLM2 tokenizers): one 7.7 MB wheel with no
dependencies (xgrammar also pulls triton and apache-tvm-ffi; outlines pulls outlines-core and more);
a grammar compiles in 2-4 ms (outlines-core builds a regex index per grammar, 613 ms on Qwen's
152k vocabulary), a mask costs 16 us a token (median; 72 us p90), and it takes the grammar this
derivation needs as one text: Lark rules with JSON schemas inline (``%json``) whose separators
match the chat templates', special tokens by name, unknown schema keywords ignored (``lenient``).
It is the library behind vLLM's ``guidance`` backend and SGLang's ``llguidance`` backend, which take
the same grammar text. The tokenizer is converted once per engine (about 1 s for Qwen's).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from schemas.errors import EngineError, EngineRefused

if TYPE_CHECKING:
    import torch

MISSING = "constrained decoding on the local engine needs llguidance (pip install 'rollbus[local]')"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise EngineRefused(f"local engine refused the request: {MISSING}") from None
    return llguidance


class GrammarTokenizer:
    """A tokenizer as llguidance sees it, built on first use (once) from its ``tokenizer.json`` text."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._json = tokenizer_json
        self._vocab_size = vocab_size
        self._stops = list(dict.fromkeys(stop_token_ids))
        self._built: Any = None
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        with self._lock:
            if self._built is None:
                llg = _llguidance()
                self._built = llg.LLTokenizer(self._json, n_vocab=self._vocab_size, eos_token=self._stops)
            return self._built

    def matcher(self, grammar: str) -> TokenMatcher:
        """A matcher for ``grammar``; a grammar llguidance refuses is refused (a 400, naming why)."""
        llg = _llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise EngineRefused(f"local engine refused the request: its constraint does not compile: "
                                f"{matcher.get_error()[:500]}")
        return TokenMatcher(matcher, self._vocab_size)


class TokenMatcher:
    """One request's grammar state."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A boolean mask over the vocabulary: the tokens the grammar admits next."""
        import torch

        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        self._check()
        return torch.from_numpy(bits[: self._vocab_size].astype(bool))

    def accepts(self, token_ids: Sequence[int]) -> bool:
        """Whether the grammar admits ``token_ids`` from here (the state is left as it was)."""
        return self._matcher.validate_tokens(list(token_ids)) == len(token_ids)

    def accepts_end(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` (admitted) leave the grammar complete (the state is left as it was)."""
        copy = self._matcher.deep_copy()
        copy.consume_tokens(list(token_ids))
        return bool(copy.is_stopped() or copy.is_accepting())

    def consume(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise EngineError(f"local engine: constrained decoding failed: {self._matcher.get_error()[:500]}")


def constrain(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the grammar does not admit at ``-inf`` (a new tensor)."""
    import torch

    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype))


__all__ = ["MISSING", "GrammarTokenizer", "TokenMatcher", "constrain"]
