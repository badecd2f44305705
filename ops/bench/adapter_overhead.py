"""The verl adapter's overhead against driving the rollbus stack directly, measured in the same run.

N sessions (N/4 prompts x ``rollout.n`` = 4) of a scripted task of T turns run, on the same
scripted SGLang engine (``ScriptedEngineServer`` in a process of its own, answering a tool
call for turns 1..T-1 and the final answer at turn T), through the same agent
(:func:`ops.bench.adapter_runner.eight_turns`: the official ``openai`` AsyncOpenAI SDK to the
session's ``base_url``, a tool result after every tool call, then a reward posted to
``reward_url``), at most ``--concurrency`` sessions in flight, two ways:

- **direct** (the baseline): ``rollbus up`` (a :class:`stack.runtime.Stack` with edge,
  projector and materializer, engine ``sglang``, the materializer joining this process's
  TransferQueue) in a process of its own; each session is opened on the edge's admin API
  (``POST /sessions`` with its uid, session index and ``{"rollout_n": 4}``), run, and
  finalized, the three under the concurrency bound; timed until every prompt's terminal
  status is in TransferQueue (polled as the adapter polls it, every 0.2 s);
- **adapter**: :class:`agent_framework.AgentFrameworkRolloutAdapter` built from a verl-shaped
  config (one edge and the consumers as Ray actors, an embedded nats-server, the runner
  inline on the adapter's loop with ``max_concurrent_sessions`` = ``--concurrency``),
  ``generate_sequences_and_wait`` of a verl-shaped batch, which returns once every prompt's
  terminal status is in TransferQueue.

This process hosts Ray and TransferQueue first, as verl's trainer does (on 2 cores Ray gets
4 logical CPUs: TransferQueue's storage units each take one, and with too few ``tq.init``
waits forever). Both stacks, each with its own embedded nats-server, stay up for the whole
run and take their turns; startup (Ray, TransferQueue, the engine, the stacks, started side
by side where they can be, and a small warm-up batch through each) and shutdown are timed
apart and printed, not counted. Every round runs both modes, the order swapped every round;
each run's sessions are new prompts, checked after it (every session that succeeded has its
trajectory in TransferQueue, every prompt its terminal status) and cleared from
TransferQueue. A session whose agent fails (e.g. a 409 from the edge) is aborted, counted in
the ``failed`` column and the failure reasons below the table, and is not a rollout.

Reports per round and as medians: wall seconds, the tail (seconds from the last session's end
to the last terminal status), failed sessions, rollouts/s, the adapter's overhead per session,
``(adapter wall - direct wall) / N`` in ms, and the ratio adapter rollouts/s / direct
rollouts/s (the median of the rounds' own ratios, as the other benches). On 2 cores the agent
process (the SDK costs several ms of CPU a turn) is the busiest one and every process competes
for the same cores, so this measures the CPU the adapter's path adds end to end; this VM's
speed drifts by up to 2x over minutes, so single rounds move by +-15% and more: compare
medians over several runs. The layouts differ as deployed: ``rollbus up`` is one process (at
the default niceness); the adapter's edge and consumers are two Ray actor processes, which
Ray runs at niceness 15 (``RAY_worker_niceness``).

    python ops/bench/adapter_overhead.py [--sessions 256] [--turns 8] [--concurrency 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
import msgspec

from agent_framework.session import SessionHandle
from materializer.prompts import TERMINAL
from materializer.transfer_queue import RAY_HOSTED, ray, tq  # Ray imported with the environment the sink sets
from ops.bench.adapter_runner import SYSTEM, close_clients, eight_turns

ROOT = Path(__file__).resolve().parents[2]

RUNNER_FQN = "ops.bench.adapter_runner.eight_turns"
ROLLOUT_N = 4
PROMPT_LENGTH, RESPONSE_LENGTH = 1024, 2048
STORAGE_UNITS = 2
PARTITION = "train"  # where both materializers put a training prompt's records and status
POLL = 0.2  # seconds between TransferQueue listings while waiting (the adapter's wait_terminal poll)
WARMUP_PROMPTS = 2


def prompt_messages(uid: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {uid[:8]}: the handler in src/app/main.py returns HTTP 500 on an "
                                        "empty JSON body. Find where the body is parsed and make it return 400."}]


class Child:
    """A process of this benchmark's, its output in a log file; stopped with SIGTERM, then killed."""

    def __init__(self, name: str, cmd: list[str], log: Path, *, stdin: Any = None,
                 stdout: Any = None) -> None:
        self.name = name
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=stdin, stdout=stdout or self._out, stderr=self._out)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); its log {self.log}:\n"
                               f"{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


def launch_engine(turns: int, tmp: Path) -> Child:
    return Child("scripted engine", [sys.executable, "-m", "ops.bench.adapter_runner", "--turns", str(turns)],
                 tmp / "engine.log", stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def served_url(engine: Child) -> str:
    assert engine.proc.stdout is not None
    url = engine.proc.stdout.readline().decode().strip()  # printed once it serves
    if not url.startswith("http"):
        engine.check()
        raise RuntimeError(f"the scripted engine printed {url!r}")
    return url


def launch_direct(engine_url: str, token: str, tmp: Path) -> Child:
    """``rollbus up`` with the sglang engine, its materializer joining this process's TransferQueue."""
    cmd = [sys.executable, "-m", "rollbus.cli", "up", "--data-dir", str(tmp / "direct"), "--host", "127.0.0.1",
           "--port", "0", "--engine", "sglang", "--engine-url", engine_url, "--admin-token", token,
           "--max-trajectory-length", str(PROMPT_LENGTH + RESPONSE_LENGTH), "--idle-timeout", "7200",
           "--transfer-queue", "--ray-address", ray.get_runtime_context().gcs_address, "--tq-partition", PARTITION,
           "--log-level", "WARNING"]
    return Child("rollbus up", cmd, tmp / "direct.log")


def direct_url(stack: Child, tmp: Path) -> str:
    state = tmp / "direct" / "edge.json"  # written once the stack has started
    deadline = time.monotonic() + 120
    while not state.exists():
        stack.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"rollbus up did not start in 120 s; its log:\n{stack.log.read_text()[-3000:]}")
        time.sleep(0.05)
    return str(msgspec.json.decode(state.read_bytes())["url"])


def adapter_config(engine_url: str, concurrency: int, tmp: Path) -> dict[str, Any]:
    return {"actor_rollout_ref": {"model": {"path": "builtin:qwen2.5"}, "rollout": {
        "n": ROLLOUT_N, "prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH,
        "custom": {"agent_framework": {
            "gateway_count": 1, "engine": "sglang", "engine_urls": [engine_url],
            "agent_runners": {"bench": {"runner_fqn": RUNNER_FQN, "max_concurrent_sessions": concurrency}},
            "data_dir": str(tmp / "adapter"), "log_namespace": "afbench"}}}},
        "transfer_queue": {"enable": True}}


def rollout_batch(uids: list[str], turns: int) -> Any:
    """A batch as verl's dataloader hands it to generate_sequences."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    batch = TensorDict({
        "uid": NonTensorStack.from_list(uids),
        "raw_prompt": NonTensorStack.from_list([prompt_messages(u) for u in uids]),
        "tools_kwargs": NonTensorStack.from_list([{"turns": turns} for _ in uids]),
        "data_source": NonTensorStack.from_list(["bench"] * len(uids)),
        "index": torch.arange(len(uids)),
    }, batch_size=[len(uids)])
    batch["global_steps"] = NonTensorData(1)
    return batch


async def wait_terminal(uids: list[str]) -> None:
    """Until every prompt's key has a terminal status (as the adapter's ``wait_terminal`` polls, except that
    a key not there yet is waited for: nobody tagged it ``running`` first, the materializer creates it)."""
    waiting = set(uids)
    while waiting:
        listed = (await tq.async_kv_list(partition_id=PARTITION) or {}).get(PARTITION, {})
        waiting = {u for u in waiting if listed.get(u, {}).get("status") not in TERMINAL}
        if waiting:
            await asyncio.sleep(POLL)


class Outcome:
    """One mode's run: its wall seconds, the tail of them after the last session ended, the failed sessions."""

    def __init__(self, wall: float, tail: float, failed: dict[tuple[str, int], str]) -> None:
        self.wall = wall
        self.tail = tail
        self.failed = failed


class Direct:
    """Sessions opened, run and finalized straight on the edge's admin API (a failed one aborted, as the
    adapter does)."""

    def __init__(self, url: str, token: str, turns: int, concurrency: int) -> None:
        self.url = url
        self.turns = turns
        self.concurrency = concurrency
        self.peak = 0
        self._active = 0
        self._headers = {"Authorization": f"Bearer {token}"}
        self._admin: httpx.AsyncClient | None = None
        self._sampling = {"max_tokens": RESPONSE_LENGTH, "temperature": 1.0, "top_p": 1.0}  # as the adapter's

    async def run(self, uids: list[str]) -> Outcome:
        if self._admin is None:  # like the adapter's edge pool
            self._admin = httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=256,
                                                                              keepalive_expiry=2.0))
        limit = asyncio.Semaphore(self.concurrency)
        started = time.perf_counter()
        errors = await asyncio.gather(*(self._session(limit, uid, i) for uid in uids for i in range(ROLLOUT_N)))
        ended = time.perf_counter()
        await wait_terminal(uids)
        wall = time.perf_counter() - started
        keys = [(uid, i) for uid in uids for i in range(ROLLOUT_N)]
        return Outcome(wall, time.perf_counter() - ended,
                       {key: error for key, error in zip(keys, errors, strict=True) if error})

    async def _session(self, limit: asyncio.Semaphore, uid: str, index: int) -> str:
        """"" when the session ended with a trajectory, else what went wrong."""
        assert self._admin is not None
        async with limit:
            self._active += 1
            self.peak = max(self.peak, self._active)
            try:
                spec = {"uid": uid, "session_index": index, "metadata": {"rollout_n": ROLLOUT_N},
                        "sampling": self._sampling}
                opened = await self._admin.post(f"{self.url}/sessions", json=spec, headers=self._headers)
                if opened.status_code != 201:
                    raise RuntimeError(f"direct: POST /sessions: {opened.status_code} {opened.text[:300]}")
                body = opened.json()
                session = SessionHandle(session_id=body["session_id"], base_url=body["base_url"],
                                        anthropic_base_url=body["anthropic_base_url"], reward_url=body["reward_url"],
                                        api_key=body["api_key"])
                try:
                    await eight_turns(session=session, raw_prompt=prompt_messages(uid), sample_index=index,
                                      tools_kwargs={"turns": self.turns}, uid=uid)
                except Exception as exc:
                    reason = f"runner_error: {type(exc).__name__}: {exc}"
                    await self._admin.post(f"{self.url}/sessions/{session.session_id}/abort",
                                           json={"reason": reason[:1000]}, headers=self._headers)
                    return reason
                ended = await self._admin.post(f"{self.url}/sessions/{session.session_id}/finalize",
                                               headers=self._headers)
                ended.raise_for_status()
                return "" if ended.json().get("trajectories", 0) else "finalized without a trajectory"
            finally:
                self._active -= 1

    async def aclose(self) -> None:
        if self._admin is not None:
            await self._admin.aclose()
        await close_clients()


def run_adapter(adapter: Any, uids: list[str], turns: int) -> Outcome:
    batch = rollout_batch(uids, turns)  # built untimed: verl's dataloader's work
    started = time.perf_counter()
    result = adapter.generate_sequences_and_wait(batch, timeout=900)
    wall = time.perf_counter() - started
    return Outcome(wall, wall - result.seconds,
                   {(s.uid, s.session_index): s.error for s in result.sessions if not s.succeeded})


def check_and_clear(uids: list[str], outcome: Outcome, mode: str) -> None:
    """Every session that succeeded has its trajectory in TransferQueue, and every prompt its status
    (``finished`` unless all its sessions failed: the any_success rule); then they are cleared (untimed)."""
    listed = tq.kv_list(partition_id=PARTITION).get(PARTITION, {})
    expected = {f"{u}_{i}_0" for u in uids for i in range(ROLLOUT_N) if (u, i) not in outcome.failed}
    missing = expected - set(listed)
    wrong = {u: listed.get(u, {}).get("status") for u in uids}
    wrong = {u: status for u, status in wrong.items()
             if status != ("failure" if all((u, i) in outcome.failed for i in range(ROLLOUT_N)) else "finished")}
    if missing or wrong:
        raise RuntimeError(f"{mode}: {len(missing)} trajectories missing in TransferQueue, "
                           f"{len(wrong)} prompts with another status than expected: {list(wrong.items())[:3]}")
    mine = set(uids)
    tq.kv_clear(keys=[k for k in listed if k.split("_")[0] in mine], partition_id=PARTITION)


Run = dict[str, float]


def measure(args: argparse.Namespace, tmp: Path) -> tuple[list[dict[str, Run]], dict[str, float], dict[str, Any]]:
    timings: dict[str, float] = {}
    info: dict[str, Any] = {}
    errors: dict[str, dict[str, list[tuple[str, int]]]] = {}
    info["errors"] = errors
    shutdown: dict[str, float] = {}
    info["shutdown"] = shutdown

    def note(mode: str, outcome: Outcome) -> Outcome:
        for key, error in outcome.failed.items():
            errors.setdefault(mode, {}).setdefault(re.sub(r"[0-9a-f]{32}", "<id>", error)[:200], []).append(key)
        return outcome

    children: list[Child] = []
    adapter: Any = None
    loop = asyncio.new_event_loop()  # the direct runs' loop (a plain asyncio loop, as the adapter's own)
    direct: Direct | None = None
    try:
        started = time.perf_counter()
        children.append(engine := launch_engine(args.turns, tmp))  # starts while Ray does
        # TransferQueue's storage units each hold a CPU: with fewer, tq.init() waits forever.
        ray.init(num_cpus=STORAGE_UNITS + 2, include_dashboard=False, log_to_driver=False,
                 namespace="rollbus-bench", _node_ip_address="127.0.0.1", **RAY_HOSTED)
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": STORAGE_UNITS}}})
        timings["ray + transferqueue"] = time.perf_counter() - started
        url = served_url(engine)
        timings["engine (alongside)"] = time.perf_counter() - started

        from agent_framework import AgentFrameworkRolloutAdapter

        started = time.perf_counter()
        token = uuid.uuid4().hex
        children.append(stack := launch_direct(url, token, tmp))  # starts while the adapter does
        adapter = AgentFrameworkRolloutAdapter.create(config=adapter_config(url, args.concurrency, tmp))
        timings["adapter"] = time.perf_counter() - started
        direct = Direct(direct_url(stack, tmp), token, args.turns, args.concurrency)
        timings["direct stack (alongside)"] = time.perf_counter() - started

        warm = [str(uuid.uuid4()) for _ in range(WARMUP_PROMPTS)]  # lazy imports, first connections, caches
        started = time.perf_counter()
        check_and_clear(warm, note("direct", loop.run_until_complete(direct.run(warm))), "direct warm-up")
        timings["direct warm-up"] = time.perf_counter() - started
        warm = [str(uuid.uuid4()) for _ in range(WARMUP_PROMPTS)]
        started = time.perf_counter()
        check_and_clear(warm, note("adapter", run_adapter(adapter, warm, args.turns)), "adapter warm-up")
        timings["adapter warm-up"] = time.perf_counter() - started

        rounds: list[dict[str, Run]] = []
        prompts = args.sessions // ROLLOUT_N
        for index in range(args.rounds):
            runs: dict[str, Run] = {}
            for mode in ("direct", "adapter") if index % 2 == 0 else ("adapter", "direct"):
                uids = [str(uuid.uuid4()) for _ in range(prompts)]
                for child in children:
                    child.check()
                outcome = (loop.run_until_complete(direct.run(uids)) if mode == "direct"
                           else run_adapter(adapter, uids, args.turns))
                check_and_clear(uids, note(mode, outcome), mode)
                runs[mode] = {"wall": outcome.wall, "tail": outcome.tail, "failed": len(outcome.failed),
                              "rate": (prompts * ROLLOUT_N - len(outcome.failed)) / outcome.wall,
                              "first": float(not runs)}
            rounds.append(runs)
            print(f"  round {index + 1}: direct {runs['direct']['wall']:.2f} s, "
                  f"adapter {runs['adapter']['wall']:.2f} s", flush=True)
        info["adapter metrics"] = dict(adapter.metrics)
        info["adapter peak"] = adapter.peak_concurrency
        info["direct peak"] = direct.peak
        return rounds, timings, info
    finally:
        steps: list[tuple[str, Any]] = [("adapter close", adapter.close)] if adapter is not None else []
        if direct is not None:
            steps.append(("", lambda: loop.run_until_complete(direct.aclose())))
        steps += [("", loop.close), *((f"{child.name} stop", child.stop) for child in reversed(children)),
                  ("tq.close + ray.shutdown", tq.close), ("tq.close + ray.shutdown", ray.shutdown)]
        for name, step in steps:  # each attempted, whatever the one before did
            started = time.perf_counter()
            try:
                step()
            except Exception as exc:
                print(f"shutdown: {exc!r}", file=sys.stderr)
            if name:
                shutdown[name] = shutdown.get(name, 0.0) + time.perf_counter() - started


def report(args: argparse.Namespace, rounds: list[dict[str, Run]], timings: dict[str, float],
           info: dict[str, Any]) -> None:
    n = args.sessions // ROLLOUT_N * ROLLOUT_N
    print(f"{'round':>5} {'first':>8} {'direct s':>9} {'adapter s':>10} {'tail d/a s':>11} {'failed d/a':>11} "
          f"{'direct r/s':>11} {'adapter r/s':>12} {'overhead ms/session':>20} {'adapter/direct':>15}")
    rows = []
    for index, runs in enumerate(rounds):
        d, a = runs["direct"], runs["adapter"]
        row = {"direct s": d["wall"], "adapter s": a["wall"], "tail d": d["tail"], "tail a": a["tail"],
               "failed d": d["failed"], "failed a": a["failed"], "direct r/s": d["rate"], "adapter r/s": a["rate"],
               "overhead": 1e3 * (a["wall"] - d["wall"]) / n, "ratio": a["rate"] / d["rate"]}
        rows.append(row)
        print(_row(f"{index + 1:>5} {'direct' if d['first'] else 'adapter':>8}", row))
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(_row(f"{'median':>14}", median))
    print(f"\nadapter / direct rollouts/s = {median['ratio']:.2f}x (median of the rounds' own ratios); "
          f"adapter overhead = {median['overhead']:.2f} ms per session ({median['overhead'] / args.turns:.2f} ms "
          "per turn)")
    print("rollouts/s: sessions that ended with a trajectory, per wall second; tail: seconds from the last "
          "session's end to the last prompt's terminal status in TransferQueue")
    print(f"peak sessions in flight: direct {info['direct peak']}, adapter {info['adapter peak']}; "
          f"adapter metrics {info['adapter metrics']}")
    for mode, reasons in info["errors"].items():
        for reason, keys in sorted(reasons.items(), key=lambda item: -len(item[1])):
            print(f"{mode}: {len(keys)} sessions failed (warm-up included): {reason}")
    print("startup (not timed above): " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    print("shutdown: " + ", ".join(f"{k} {v:.1f} s" for k, v in info["shutdown"].items()))


def _row(head: str, row: dict[str, float]) -> str:
    return (f"{head} {row['direct s']:>9.2f} {row['adapter s']:>10.2f} {row['tail d']:>5.2f}/{row['tail a']:<5.2f} "
            f"{row['failed d']:>5g}/{row['failed a']:<5g} {row['direct r/s']:>11.1f} {row['adapter r/s']:>12.1f} "
            f"{row['overhead']:>20.2f} {row['ratio']:>14.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=256,
                        help=f"sessions per mode and round ({ROLLOUT_N} per prompt)")
    parser.add_argument("--turns", type=int, default=8, help="model turns per session (the last one answers)")
    parser.add_argument("--concurrency", type=int, default=64, help="sessions in flight at most")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.sessions < ROLLOUT_N or args.turns < 1 or args.concurrency < 1 or args.rounds < 1:
        parser.error(f"--sessions must be >= {ROLLOUT_N}, --turns, --concurrency and --rounds >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # A failed session is logged by the adapter with its traceback; here they are counted and summed up instead.
    logging.getLogger("agent_framework.adapter").setLevel(logging.CRITICAL)
    cores = len(os.sched_getaffinity(0))
    print(f"{args.sessions // ROLLOUT_N * ROLLOUT_N} sessions ({args.sessions // ROLLOUT_N} prompts x n={ROLLOUT_N}) "
          f"x {args.turns} turns, concurrency {args.concurrency}, {args.rounds} rounds, {cores} cores; "
          "scripted SGLang engine; agent: openai AsyncOpenAI SDK", flush=True)
    with tempfile.TemporaryDirectory(prefix="adapter-bench-") as tmp:
        rounds, timings, info = measure(args, Path(tmp))
    report(args, rounds, timings, info)


if __name__ == "__main__":
    main()
