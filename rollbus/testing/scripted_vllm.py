"""A scripted server speaking vLLM's token-in/token-out APIs (shared behaviour: :mod:`rollbus.testing.scripted`).

* ``POST /inference/v1/generate`` (``vllm/entrypoints/serve/disagg``): ``token_ids`` and
  ``sampling_params`` in; ``choices[0].token_ids``, ``logprobs.content[i].logprob``
  and ``finish_reason`` out; streamed as SSE deltas, then a usage event when
  ``stream_options.include_usage``, then ``[DONE]``. ``generate_route=False`` answers
  404 there, like a server started without the scale-out endpoints.
* ``POST /v1/completions`` with a token-id ``prompt``, ``return_token_ids`` and
  ``logprobs``: ``choices[0].token_ids`` and ``logprobs.token_logprobs``.
* ``POST /abort_requests`` ``{"request_ids": [...]}`` (vLLM's ``--tokens-only`` mode).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from rollbus.testing.scripted import Checker, Plan, Responder, ScriptedReply, ScriptedServer


class ScriptedVLLMServer(ScriptedServer):
    protocol = "vllm"

    def __init__(
        self,
        replies: Iterable[ScriptedReply] | None = None,
        responder: Responder | None = None,
        chunk_size: int = 4,
        *,
        generate_route: bool = True,
        checker: Checker | None = None,
    ) -> None:
        self.generate_route = generate_route
        super().__init__(replies, responder, chunk_size, checker=checker)

    def _routes(self) -> list[Route]:
        return [Route("/inference/v1/generate", self._tokens, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/abort_requests", self._abort, methods=["POST"])]

    async def _tokens(self, request: Request) -> Response:
        if not self.generate_route:
            return PlainTextResponse('{"detail":"Not Found"}', 404)
        return await self._generate(request)

    def _input_ids(self, body: dict[str, Any]) -> list[int]:
        return list(body.get("token_ids") or body.get("prompt") or ())

    def _sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        return body["sampling_params"] if "token_ids" in body else body

    def _limits(self, body: dict[str, Any]) -> tuple[int | None, list[int]]:
        sampling = self._sampling(body)
        return sampling.get("max_tokens"), list(sampling.get("stop_token_ids") or ())

    def _event(self, body: dict[str, Any], plan: Plan, reply: ScriptedReply, span: tuple[int, int],
               final: bool) -> dict[str, Any]:
        start, end = span
        entries = plan.entries[start:] if final else plan.entries[start:end]
        wants_logprobs = self._sampling(body).get("logprobs") is not None
        choice: dict[str, Any] = {"index": 0, "finish_reason": plan.finish if final else None,
                                  "token_ids": plan.ids[start:end]}
        rid = body.get("request_id") or "scripted"
        if "token_ids" in body:
            choice["logprobs"] = _chat_logprobs(entries) if wants_logprobs else None
            return {"request_id": f"generate-tokens-{rid}", "choices": [choice]}
        logprobs = _completion_logprobs(entries) if wants_logprobs else None
        choice |= {"text": "", "stop_reason": None, "logprobs": logprobs}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": 0, "model": "scripted",
                "choices": [choice]}

    def _strip(self, event: dict[str, Any], *, streamed: bool) -> None:
        del event["choices"][0]["token_ids"]

    def _constraint(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self._sampling(body).get("structured_outputs")

    def _error(self, message: str | None = None, status: int = 500) -> dict[str, Any]:
        kind = "BadRequestError" if status == 400 else "InternalServerError"
        return {"error": {"message": message or "scripted engine error", "type": kind, "param": None, "code": status}}

    def _stream_end(self, body: dict[str, Any], plan: Plan) -> bytes:
        end = b"data: [DONE]\n\n"
        if not (body.get("stream_options") or {}).get("include_usage"):
            return end
        prompt = len(self._input_ids(body))
        usage = {"prompt_tokens": prompt, "completion_tokens": len(plan.ids), "total_tokens": prompt + len(plan.ids)}
        return b"data: " + msgspec.json.encode({"choices": [], "usage": usage}) + b"\n\n" + end

    async def _abort(self, request: Request) -> Response:
        body = await request.json()
        self.aborted.extend(str(rid) for rid in body.get("request_ids") or ())
        return Response(status_code=200)


def _chat_logprobs(entries: list[tuple[float, int]]) -> dict[str, Any]:
    """``ChatCompletionLogProbs`` as ``/inference/v1/generate`` writes it (tokens as ``token_id:N``)."""
    content = [{"token": f"token_id:{token}", "logprob": lp, "bytes": None,
                "top_logprobs": [{"token": f"token_id:{token}", "logprob": lp, "bytes": None}]}
               for lp, token in entries]
    return {"content": content}


def _completion_logprobs(entries: list[tuple[float, int]]) -> dict[str, Any]:
    tokens = [f"token_id:{token}" for _, token in entries]
    return {"text_offset": [0] * len(entries), "token_logprobs": [lp for lp, _ in entries], "tokens": tokens,
            "top_logprobs": [{name: lp} for name, (lp, _) in zip(tokens, entries, strict=True)]}


__all__ = ["ScriptedVLLMServer"]
