"""The local engine under a constraint (llguidance): the tiny random Qwen2, which never writes a tool
call by itself, is made to call a named tool with schema-valid arguments, and its log probs are
those of the constrained distribution."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import jsonschema
import pytest

from edge.chat.conversation import NamedTool, OutputFormat, ToolSpec
from edge.engines import GenerateRequest, SamplingParams
from edge.engines.grammar import GrammarTokenizer, constrain
from edge.engines.local import LocalEngine, build_tiny_qwen2
from edge.tokens.constraint import MARKERS, derive_constraint
from edge.tokens.parsers.hermes import HermesParser
from edge.tokens.tokenizer import Tokenizer, load_tokenizer
from schemas.errors import EngineRefused

torch = pytest.importorskip("torch")

PROMPT = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = (ToolSpec(name="get_weather", parameters=ARGS), ToolSpec(name="search", parameters={"type": "object"}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:qwen2.5")


@pytest.fixture(scope="module")
async def engine(tokenizer: Tokenizer) -> AsyncIterator[LocalEngine]:
    local = LocalEngine(seed=0, tokenizer=tokenizer, decode=tokenizer.decode)
    yield local
    await local.aclose()


def forced(tokenizer: Tokenizer, request_id: str, **sampling: object) -> GenerateRequest:
    markers = frozenset(m for m in MARKERS if tokenizer.is_added_token(m))
    constraint = derive_constraint("hermes", TOOLS, NamedTool(name="get_weather"), parallel=False,
                                   token_markers=markers)
    return GenerateRequest(request_id=request_id, input_ids=PROMPT, constraint=constraint,
                           sampling=SamplingParams(max_new_tokens=96, stop_token_ids=tokenizer.stop_token_ids,
                                                   **sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize(("request_id", "temperature"), [("ab:1", 1.0), ("ab:2", 1.0), ("ab:3", 0.0)])
async def test_the_random_model_is_made_to_call_the_named_tool(engine, tokenizer, request_id, temperature):
    request = forced(tokenizer, request_id, temperature=temperature)
    result = await engine.generate(request)
    assert result.finish_reason == "stop" and result.token_ids[-1] in tokenizer.stop_token_ids
    text = tokenizer.decode(result.token_ids[:-1])
    parsed = HermesParser().parse(text, lambda i: f"c{i}", TOOLS)
    (call,) = parsed.tool_calls
    assert call.name == "get_weather" and parsed.content == ""
    jsonschema.validate(json.loads(call.arguments), ARGS)
    # Unconstrained, the same request writes noise, not a call.
    free = await engine.generate(GenerateRequest(request_id=request_id, input_ids=PROMPT, sampling=request.sampling))
    assert not HermesParser().parse(tokenizer.decode(free.token_ids), lambda i: f"c{i}", TOOLS).tool_calls


async def test_log_probs_are_the_constrained_distributions(engine, tokenizer):
    request = forced(tokenizer, "ab:9", temperature=1.0)
    result = await engine.generate(request)
    model = build_tiny_qwen2(seed=0).eval()
    ids = torch.tensor([PROMPT + list(result.token_ids)])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(PROMPT) - 1: -1].float()
    grammar = GrammarTokenizer(tokenizer.to_json(), 151936, tokenizer.stop_token_ids)
    matcher = grammar.matcher(request.constraint.grammar)  # type: ignore[union-attr]
    for step, token in enumerate(result.token_ids):
        masked = constrain(logits[step], matcher.allowed())
        want = float(torch.log_softmax(masked, -1)[token])
        assert result.logprobs[step] == pytest.approx(want, abs=1e-4)
        assert want > float(torch.log_softmax(logits[step], -1)[token])  # mass renormalized over fewer tokens
        matcher.consume(token)


async def test_a_json_format_is_json_valid_for_its_schema(engine, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    constraint = derive_constraint("hermes", (), "none", output_format=OutputFormat(type="json_schema", schema=schema))
    request = GenerateRequest(request_id="ab:4", input_ids=PROMPT, constraint=constraint,
                              sampling=SamplingParams(max_new_tokens=32, stop_token_ids=tokenizer.stop_token_ids))
    result = await engine.generate(request)
    jsonschema.validate(json.loads(tokenizer.decode(result.token_ids[:-1])), schema)


async def test_without_a_tokenizer_a_constraint_is_refused(tokenizer):
    local = LocalEngine(seed=0)
    try:
        with pytest.raises(EngineRefused, match="llguidance"):
            await local.generate(forced(tokenizer, "ab:5"))
    finally:
        await local.aclose()
