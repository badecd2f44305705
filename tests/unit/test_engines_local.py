"""The local CPU engine: a tiny random Qwen2, decoded with a KV cache on a worker thread."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from edge.engines import Engine, GenerateChunk, GenerateRequest, GenerateResult, SamplingParams
from edge.engines.local import LocalEngine, build_tiny_qwen2, candidates
from schemas.errors import EngineRefused

torch = pytest.importorskip("torch")

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]


def request(max_new_tokens: int = 8, request_id: str = "00ff:0", **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        input_ids=PROMPT,
        sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


@pytest.fixture(scope="module")
async def engine() -> AsyncIterator[LocalEngine]:
    local = LocalEngine(seed=0, chunk_tokens=3)
    yield local
    await local.aclose()


@pytest.fixture(scope="module")
def model() -> object:
    return build_tiny_qwen2(seed=0).eval()


def full_logits(model: object, prompt: list[int], response: tuple[int, ...]) -> torch.Tensor:
    """Logits predicting each response token, from one forward pass without a cache."""
    ids = torch.tensor([prompt + list(response)])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()  # type: ignore[operator]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def test_satisfies_the_engine_protocol(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)


async def test_same_seed_and_request_id_replay_the_same_tokens(engine: LocalEngine) -> None:
    first = await engine.generate(request(16))
    again = await engine.generate(request(16))
    other = await engine.generate(request(16, request_id="00ff:1"))
    assert first == again
    assert first.token_ids != other.token_ids
    twin = LocalEngine(seed=0)
    assert await twin.generate(request(16)) == first
    await twin.aclose()


async def test_length_finish_with_one_finite_logprob_per_token(engine: LocalEngine) -> None:
    result = await engine.generate(request(7))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == len(result.logprobs or ()) == 7
    assert all(math.isfinite(lp) and lp <= 0 for lp in result.logprobs or ())
    assert all(0 <= token < engine.vocab_size for token in result.token_ids)


async def test_stops_on_a_stop_token_and_keeps_it(engine: LocalEngine) -> None:
    greedy = await engine.generate(request(6, temperature=0.0))
    top1 = await engine.generate(request(6, temperature=1.0, top_k=1, request_id="00ff:9"))
    assert top1.token_ids == greedy.token_ids  # top_k=1 is greedy whatever the seed
    assert top1.logprobs == (0.0,) * 6  # sampled from a one-token distribution
    stop = greedy.token_ids[2]
    stopped = await engine.generate(request(6, temperature=0.0, stop_token_ids=(stop,)))
    cut = greedy.token_ids.index(stop) + 1
    assert stopped.token_ids == greedy.token_ids[:cut]
    assert stopped.finish_reason == "stop"


async def test_logprobs_match_a_full_forward_pass_at_temperature_one(engine, model) -> None:
    result = await engine.generate(request(12, temperature=1.0))
    logits = full_logits(model, PROMPT, result.token_ids)
    expected = torch.log_softmax(logits, -1)[torch.arange(12), torch.tensor(result.token_ids)]
    assert torch.allclose(torch.tensor(result.logprobs), expected, atol=1e-4)


async def test_top_k_logprobs_are_renormalized_over_the_kept_tokens(engine, model) -> None:
    result = await engine.generate(request(6, temperature=0.5, top_k=5))
    logits = full_logits(model, PROMPT, result.token_ids) / 0.5
    for position, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs or (), strict=True)):
        kept = torch.topk(logits[position], 5)
        assert token in kept.indices.tolist()
        expected = torch.log_softmax(kept.values, -1)[kept.indices.tolist().index(token)]
        assert logprob == pytest.approx(float(expected), abs=1e-4)


def kept(z: torch.Tensor, top_k: int, top_p: float) -> list[int]:
    _, ids = candidates(z, top_k, top_p)
    return list(range(z.numel())) if ids is None else sorted(ids.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    z = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    assert kept(z, -1, 0.7) == [1, 3]
    assert kept(z, -1, 0.85) == [0, 1, 3]
    assert kept(z, -1, 0.1) == [1]
    assert kept(z, -1, 1.0) == [0, 1, 2, 3]
    assert kept(z, 1, 1.0) == [1]
    assert kept(z, 3, 0.6) == [1, 3]  # top-p over the renormalized top 3: 0.526, 0.316, 0.158


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.95])
def test_top_p_over_a_wide_vocabulary_matches_a_full_sort(top_p: float) -> None:
    z = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 0.3
    probs, order = torch.sort(torch.softmax(z, -1), descending=True)
    expected = order[(torch.cumsum(probs, 0) - probs) <= top_p]
    assert kept(z, -1, top_p) == sorted(expected.tolist())


async def test_stream_chunks_add_up_to_the_result(engine: LocalEngine) -> None:
    items = [item async for item in engine.stream(request(8))]
    chunks, final = items[:-1], items[-1]
    assert all(isinstance(chunk, GenerateChunk) for chunk in chunks)
    assert [len(chunk.token_ids) for chunk in chunks] == [3, 3, 2]
    assert isinstance(final, GenerateResult)
    assert tuple(t for chunk in chunks for t in chunk.token_ids) == final.token_ids
    assert tuple(lp for chunk in chunks for lp in chunk.logprobs or ()) == final.logprobs
    assert final == await engine.generate(request(8))


async def test_the_event_loop_keeps_running_while_decoding(engine: LocalEngine) -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await engine.generate(request(48))
    ticker.cancel()
    assert ticks >= 5


async def test_no_logprobs_when_not_asked(engine: LocalEngine) -> None:
    req = GenerateRequest(
        request_id="00ff:0", input_ids=PROMPT, sampling=SamplingParams(max_new_tokens=3), return_logprob=False
    )
    result = await engine.generate(req)
    assert result.logprobs is None and len(result.token_ids) == 3


async def test_rejects_what_it_cannot_honour(engine: LocalEngine) -> None:
    bad = GenerateRequest(request_id="00ff:0", input_ids=[engine.vocab_size], sampling=SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineRefused, match="vocabulary"):
        await engine.generate(bad)
    with pytest.raises(EngineRefused, match="decode"):
        await engine.generate(request(4, stop=("</tool_call>",)))
    too_long = GenerateRequest(request_id="00ff:0", input_ids=[1] * engine.context_length,
                               sampling=SamplingParams(max_new_tokens=2))
    with pytest.raises(EngineRefused, match=f"does not fit the model's context of {engine.context_length}"):
        await engine.generate(too_long)


async def test_stop_strings_with_a_decoder() -> None:
    engine = LocalEngine(decode=lambda ids: "ab" * len(ids))
    result = await engine.generate(request(10, stop=("ababab",)))
    await engine.aclose()
    assert result.finish_reason == "stop" and len(result.token_ids) == 3


async def test_loads_a_saved_model_directory(tmp_path: Path, engine: LocalEngine, model) -> None:
    model.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    loaded = LocalEngine(model=str(tmp_path))
    result = await loaded.generate(request(5, temperature=0.0))
    await loaded.aclose()
    expected = await engine.generate(request(5, temperature=0.0))
    assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)
    assert result.weight_version == str(tmp_path)


def test_model_paths_that_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF"):
        LocalEngine(model=str(tmp_path / "smollm2.gguf"))
    with pytest.raises(ValueError, match="not a local model directory"):
        LocalEngine(model=str(tmp_path / "missing"))
