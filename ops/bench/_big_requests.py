"""``edge_memory.py --big-requests``: the RSS of ``rollbus up`` before, at the peak of and after big requests.

``rollbus up`` runs as its own process (embedded nats-server, edge, projector, materializer), in front
of a scripted SGLang engine in this process. After a quiet moment its RSS is the baseline; then each of
``--requests`` sessions sends one chat request whose last message, a tool result, holds ``--mb`` MB of
text (``latin``: accented words, which the edge must tokenize, ~0.9 tokens a character, before it
finds that they cannot fit the chain; ``ascii``: words the edge refuses by their length alone), and
every session is finalized. The RSS is sampled every 50 ms throughout; "after" is the RSS at the end of
``--settle`` seconds; CPU is what the process used from the baseline to then. ``--compare`` runs it
twice in the same run, the second with ``ROLLBUS_HEAP_TRIM_MIB=0`` (malloc as glibc leaves it: no
fixed thresholds, no heap keeper).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from stack.heap import TRIM_ENV

MIB = 1024 * 1024
TARGET = 1.25  # after / before
ALPHABETS = {"latin": "äöüßéèàçñ", "ascii": "abcdefghijklmnopqrstuvwxyz"}
ADMIN = "bench"


def tool_result(size: int, alphabet: str, seed: int) -> str:
    """Words of ``alphabet`` (2-9 letters) that make ``size`` bytes of UTF-8."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(4000)]
    per_char = len(" ".join(vocabulary).encode()) / len(" ".join(vocabulary))
    text = " ".join(rng.choices(vocabulary, k=int(size / per_char) // 5 + 1))
    cut = text.encode()[:size]
    return cut.decode(errors="ignore")


def request_body(text: str) -> bytes:
    """An agent's turn after a tool call whose result is ``text``."""
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools to inspect the repository."},
        {"role": "user", "content": "Summarize the build log."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "build.log"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": text},
    ]
    return json.dumps({"model": "m", "max_tokens": 16, "messages": messages}, ensure_ascii=False).encode()


def cpu(pid: int) -> float:
    """Seconds of CPU the process has used, in all its threads (user and system)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """The highest RSS of ``pid``, sampled every 50 ms on a thread of its own."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Up:
    """``rollbus up`` as its own process, stopped with SIGTERM."""

    def __init__(self, data_dir: Path, engine_url: str, env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "rollbus.cli", "up", "--port", "0", "--data-dir", str(data_dir),
               "--admin-token", ADMIN, "--engine", "sglang", "--engine-url", engine_url, "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **env}, cwd=Path(__file__).resolve().parents[2])
        self.url = self.nats_url = ""
        lines = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            lines.append(line)
            if match := re.search(r"edge:\s+(http://\S+)", line):
                self.url = match.group(1)
            if match := re.search(r"nats:\s+(nats://\S+)", line):
                self.nats_url = match.group(1)
            if "Ctrl-C" in line:
                break
        if not self.url:
            raise SystemExit("rollbus up did not start:\n" + "".join(lines))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # its log, never left to fill a pipe

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class Result:
    def __init__(self, label: str, before: int, peak: int, after: int, cpu_s: float) -> None:
        self.label, self.before, self.peak, self.after, self.cpu_s = label, before, peak, after, cpu_s

    @property
    def ratio(self) -> float:
        return self.after / self.before

    def line(self) -> str:
        return (f"{self.label:<52} before {self.before / MIB:6.0f} MiB  peak {self.peak / MIB:6.0f} MiB  "
                f"after {self.after / MIB:6.0f} MiB  after/before {self.ratio:.2f}x  peak/before "
                f"{self.peak / self.before:.2f}x  CPU {self.cpu_s:.1f} s")


def run_once(label: str, env: dict[str, str], engine_url: str, bodies: list[bytes], settle: float) -> Result:
    with tempfile.TemporaryDirectory(prefix="rb-mem-") as data:
        up = Up(Path(data), engine_url, env)
        try:
            return _drive(label, up, bodies, settle)
        finally:
            up.stop()


def _drive(label: str, up: Up, bodies: list[bytes], settle: float) -> Result:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    pid = up.proc.pid
    with httpx.Client(timeout=600) as client:
        time.sleep(3.0)  # startup's last allocations
        before, cpu_before = rss(pid), cpu(pid)
        sampler = Sampler(pid)
        sessions = []
        for number, body in enumerate(bodies, 1):
            session = client.post(f"{up.url}/sessions", json={}, headers=admin).json()
            started = time.monotonic()
            reply = client.post(f"{session['base_url']}/chat/completions", content=body,
                                headers={"Authorization": f"Bearer {session['api_key']}",
                                         "Content-Type": "application/json"})
            finish = reply.json()["choices"][0]["finish_reason"] if reply.status_code == 200 else reply.text[:120]
            print(f"  request {number}: {len(body) / 1e6:.1f} MB -> {reply.status_code} {finish} in "
                  f"{time.monotonic() - started:.1f} s; RSS {rss(pid) / MIB:.0f} MiB", flush=True)
            sessions.append(session["session_id"])
        for session_id in sessions:
            done = client.post(f"{up.url}/sessions/{session_id}/finalize", headers=admin)
            assert done.status_code == 200, done.text
        time.sleep(settle)
        sampler.stop()
        return Result(label, before, sampler.peak, rss(pid), cpu(pid) - cpu_before)


def main(requests: int, mb: float, text: str, settle: float, compare: bool) -> int:
    tokenizer = load_tokenizer("builtin:qwen2.5")
    ids = [*tokenizer.encode("ok"), tokenizer.eos_token_id]
    size = int(mb * 1e6)
    bodies = [request_body(tool_result(size - i, ALPHABETS[text], seed=i)) for i in range(requests)]
    print(f"edge memory, big requests: {requests} chat requests, each a tool result of {mb:g} MB of {text} text, "
          f"to rollbus up (scripted engine); RSS of the rollbus up process, settle {settle:g} s", flush=True)

    def reply(input_ids: list[int], body: dict[str, object]) -> ScriptedReply:
        return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))

    runs = [("rollbus (fixed malloc thresholds, heap keeper)", {})]
    if compare:
        runs.append((f"malloc as glibc leaves it ({TRIM_ENV}=0)", {TRIM_ENV: "0"}))
    results = []
    with ScriptedEngineServer(responder=reply, keep_requests=0) as engine:
        for label, env in runs:
            print(label, flush=True)
            results.append(run_once(label, env, engine.url, bodies, settle))
    print()
    for result in results:
        print(result.line())
    ok = results[0].ratio <= TARGET
    print(f"after/before {results[0].ratio:.2f}x: {'within' if ok else 'OVER'} the target {TARGET}x")
    return 0 if ok else 1
