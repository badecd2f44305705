"""make_engine: one factory for every engine kind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from edge.engines import Engine, SGLangEngine, make_engine


async def test_sglang_kind_builds_the_http_client() -> None:
    engine = make_engine("sglang", ["http://127.0.0.1:30000/"], timeout=10.0)
    assert isinstance(engine, SGLangEngine) and isinstance(engine, Engine)
    assert engine.urls == ("http://127.0.0.1:30000",)
    await engine.aclose()


@pytest.mark.parametrize(
    ("kind", "urls", "message"),
    [
        ("vllm", ["http://x:1"], "not available yet"),
        ("tgi", [], "unknown engine kind 'tgi'"),
        ("sglang", [], "at least one URL"),
        ("local", ["http://x:1"], "takes no URLs"),
    ],
)
def test_kinds_that_cannot_be_built(kind: str, urls: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine(kind, urls)


def test_importing_the_engines_leaves_torch_alone() -> None:
    code = "import sys, edge.engines; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
