"""``log_dir``: each ended session's event log and trajectories as files, for people to read.

Under ``<log_dir>/step_<global_steps>/``, per session:

- ``<session_id>.events.jsonl``: one event a line, as the log holds it, with token ids and
  log probs as JSON arrays and raw requests as text;
- ``<session_id>.json``: the session's summary (status, uid, index, agent, reward, chains)
  and its trajectories as the materializer derives them (key, prompt and response ids,
  response mask, log probs, reward, materialization reason).

A scorer-decided reward is the materializer's business: these files show the task's reward
(or 0 when none was posted).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from materializer.records import RecordOptions, derive_records
from schemas import tokens
from schemas.bodies import Bodies, rebuild
from schemas.events import AnyEvent, RequestReceived
from session.fold import fold
from session.summary import summarize

_IDS = ("token_ids", "prompt_ids")


def event_line(event: AnyEvent, bodies: Bodies | None = None) -> dict[str, Any]:
    """An event as a JSON-friendly mapping (a request with its whole body, rebuilt by ``bodies``)."""
    out: dict[str, Any] = msgspec.to_builtins(event)
    for name in _IDS:
        if isinstance(getattr(event, name, None), bytes):
            out[name] = tokens.unpack_ids(getattr(event, name)).tolist()
    if isinstance(getattr(event, "logprobs", None), bytes):
        out["logprobs"] = tokens.unpack_logprobs(event.logprobs).tolist()  # type: ignore[union-attr]
    if isinstance(event, RequestReceived) and bodies is not None:
        del out["parts"]
        out["body"] = bodies.body(event.request_no).decode("utf-8", "replace")
    return out


def session_document(events: list[AnyEvent]) -> dict[str, Any]:
    state = fold(events)
    if state is None:
        raise ValueError("a session without events")
    records = derive_records(state, RecordOptions()) if state.status == "finalized" else []
    return {
        "summary": msgspec.to_builtins(summarize(state)),
        "trajectories": [{
            "key": r.key, "prompt_ids": r.prompts.tolist(), "response_ids": r.responses.tolist(),
            "response_mask": r.response_mask.tolist(),
            "rollout_log_probs": None if r.rollout_log_probs is None else r.rollout_log_probs.tolist(),
            "reward": r.reward, "materialization_reason": r.materialization_reason, "num_turns": r.num_turns,
        } for r in records],
    }


def write_session(directory: Path, session_id: str, events: list[AnyEvent]) -> Path:
    """Write the two files (each atomically); returns the summary's path."""
    directory.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    bodies = rebuild(events)
    lines = b"".join(encoder.encode(event_line(e, bodies)) + b"\n" for e in events)
    _write(directory / f"{session_id}.events.jsonl", lines)
    path = directory / f"{session_id}.json"
    _write(path, msgspec.json.format(encoder.encode(session_document(events)), indent=1))
    return path


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
