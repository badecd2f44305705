"""Writing Responses API answers: the response object, its output items, usage and ids
(:mod:`edge.wires.responses` decodes; :mod:`edge.wires.responses_stream` streams)."""

from __future__ import annotations

from typing import Any

import msgspec

from edge.chat.conversation import TurnOutcome
from edge.wires.adapter import TokenText
from edge.wires.reasoning_refs import ReasoningRefs
from schemas import wire_responses as w
from schemas.events import ToolCall

_encoder = msgspec.json.Encoder()
ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"


class ResponsesOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the answer echoes from the request, and how it is written."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    effort: str | None = None
    summary: str | None = None  # reasoning.summary asked for: the reasoning goes out as its summary too
    store: bool = True
    tool_choice: Any = "auto"
    tools: msgspec.Raw = msgspec.Raw(b"[]")
    truncation: str = "disabled"
    user: str | None = None
    metadata: dict[str, str] = {}
    service_tier: str | None = None
    namespaced: dict[str, tuple[str, str]] = {}
    encrypted: bool = False  # include reasoning.encrypted_content (a reference)
    logprobs: bool = False  # include message.output_text.logprobs


def response_id(session_id: str, request_no: int) -> str:
    return f"resp_{session_id}_{request_no}"


def item_ids(session_id: str, request_no: int) -> tuple[str, str, str]:
    """The ids of a response's reasoning item, message, and (with ``_<index>``) function calls."""
    short = f"{session_id[:12]}_{request_no}"
    return f"rs_{short}", f"msg_{short}", f"fc_{short}"


def reasoning_tokens(outcome: TurnOutcome, token_text: TokenText) -> int:
    """How many of the sampled tokens are reasoning: up to the one that closes ``</think>`` (all of
    them when it never closes)."""
    if not outcome.reasoning:
        return 0
    written = ""
    for count, text in enumerate(token_text(outcome.token_ids), 1):
        written += text
        if "</think>" in written[-len(text) - 8:]:
            return count
    return len(outcome.token_ids)


def usage(outcome: TurnOutcome, token_text: TokenText) -> w.Usage:
    return w.Usage(input_tokens=outcome.prompt_tokens, input_tokens_details=w.InputTokensDetails(),
                   output_tokens=outcome.completion_tokens,
                   output_tokens_details=w.OutputTokensDetails(reasoning_tokens=reasoning_tokens(outcome, token_text)),
                   total_tokens=outcome.prompt_tokens + outcome.completion_tokens)


def reasoning_item(session_id: str, request_no: int, text: str, options: ResponsesOptions, refs: ReasoningRefs,
                   item_id: str, status: str = "completed") -> w.ReasoningOut:
    encrypted = refs.issue(session_id, request_no) if options.encrypted else None
    return w.ReasoningOut(id=item_id, summary=[w.SummaryText(text=text)] if options.summary and text else [],
                          content=[w.ReasoningText(text=text)] if text else [], encrypted_content=encrypted,
                          status=status)


def text_logprobs(outcome: TurnOutcome, options: ResponsesOptions, token_text: TokenText) -> list[Any]:
    if not options.logprobs or outcome.logprobs is None:
        return []
    return [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass")), "top_logprobs": []}
            for t, lp in zip(token_text(outcome.token_ids), outcome.logprobs, strict=True)]


def function_call(call: ToolCall, options: ResponsesOptions, item_id: str,
                  status: str = "completed") -> w.FunctionCallOut:
    namespace, name = options.namespaced.get(call.name, (None, call.name))
    return w.FunctionCallOut(type="function_call", id=item_id, call_id=call.id, name=name, arguments=call.arguments,
                             status=status, namespace=namespace)


def output_items(outcome: TurnOutcome, options: ResponsesOptions, refs: ReasoningRefs,
                 token_text: TokenText) -> list[Any]:
    status = "incomplete" if outcome.finish_reason == "length" else "completed"
    rs, msg, fc = item_ids(outcome.session_id, outcome.request_no)
    items: list[Any] = []
    if outcome.reasoning:
        items.append(reasoning_item(outcome.session_id, outcome.request_no, outcome.reasoning, options, refs, rs))
    if outcome.content or not outcome.tool_calls:
        text = w.OutputText(text=outcome.content, logprobs=text_logprobs(outcome, options, token_text))
        items.append(w.OutputMessage(id=msg, status=status, content=[text]))
    items += [function_call(call, options, f"{fc}_{i}") for i, call in enumerate(outcome.tool_calls)]
    return items


def response_object(session_id: str, request_no: int, created: int, options: ResponsesOptions, *,
                    status: str = "in_progress", output: list[Any] | None = None, usage: w.Usage | None = None,
                    error: w.ResponseError | None = None) -> w.ResponseObject:
    incomplete = w.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    return w.ResponseObject(
        id=response_id(session_id, request_no), created_at=created, status=status, error=error,
        incomplete_details=incomplete, instructions=options.instructions, max_output_tokens=options.max_output_tokens,
        model=options.model or "rollbus", output=output or [], parallel_tool_calls=options.parallel_tool_calls,
        previous_response_id=options.previous_response_id,
        reasoning=w.ReasoningEcho(effort=options.effort, summary=options.summary), store=options.store,
        temperature=options.temperature, tool_choice=options.tool_choice, tools=options.tools, top_p=options.top_p,
        truncation=options.truncation, usage=usage, user=options.user, metadata=options.metadata,
        service_tier=options.service_tier)


def finished(outcome: TurnOutcome, options: ResponsesOptions, refs: ReasoningRefs,
             token_text: TokenText) -> w.ResponseObject:
    """The response of a finished turn."""
    return response_object(outcome.session_id, outcome.request_no, outcome.created, options,
                           status="incomplete" if outcome.finish_reason == "length" else "completed",
                           output=output_items(outcome, options, refs, token_text), usage=usage(outcome, token_text))


def encode_response(outcome: TurnOutcome, options: ResponsesOptions, refs: ReasoningRefs,
                    token_text: TokenText) -> bytes:
    return _encoder.encode(finished(outcome, options, refs, token_text))
