"""make_engine: one factory for every engine kind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge.engines import Engine, SGLangEngine, VerlEngine, VLLMEngine, local_model, make_engine


@pytest.mark.parametrize(("kind", "cls"), [("sglang", SGLangEngine), ("vllm", VLLMEngine)])
async def test_http_kinds_build_their_clients(kind: str, cls: type) -> None:
    engine = make_engine(kind, ["http://127.0.0.1:30000/", "http://127.0.0.1:30001"], timeout=10.0)
    assert isinstance(engine, cls) and isinstance(engine, Engine)
    assert engine.urls == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    await engine.aclose()


def test_verl_kind_wraps_an_in_process_client() -> None:
    class Client:
        async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict) -> None: ...

    engine = make_engine("verl", client=Client())
    assert isinstance(engine, VerlEngine) and isinstance(engine, Engine)


@pytest.mark.parametrize(
    ("kind", "urls", "message"),
    [
        ("tgi", [], "unknown engine kind 'tgi'"),
        ("sglang", [], "at least one URL"),
        ("vllm", [], "at least one URL"),
        ("local", ["http://x:1"], "takes no URLs"),
        ("verl", [], "LLMServerClient"),
    ],
)
def test_kinds_that_cannot_be_built(kind: str, urls: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(kind, urls)


def test_named_local_models_name_their_tokenizer_and_tool_format() -> None:
    assert local_model(None) == local_model("tiny-qwen2")
    assert (local_model(None).tokenizer, local_model(None).tool_format) == ("builtin:qwen2.5", "hermes")
    assert (local_model("smollm2").tokenizer, local_model("smollm2").tool_format) == ("builtin:smollm2", "smollm2")
    assert local_model("/models/x.gguf") is None


def test_importing_the_engines_leaves_torch_alone() -> None:
    code = "import sys, edge.engines; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
