"""``rollbus replay``: a session rebuilt from the log alone; ``--verify`` checks what was materialized.

::

    rollbus replay SESSION_ID             its chains: turns, token counts, masks, images, reward
    rollbus replay SESSION_ID --json      the same with every token id, mask and log prob
    rollbus replay SESSION_ID --request N the raw body of its request N, byte for byte as the agent sent it
    rollbus replay --verify SESSION_ID    re-derive its records, compare digests with its marker,
                                          rebuild every raw request body and check it against its sha256, and
                                          fetch every image back from the object store and check its sha256
    rollbus replay --verify --all         the same for every session of the log, in one pass

Exit status: 0 (no difference), 1 (differences, each printed), 2 (no such session, no NATS).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import msgspec
from nats.js.client import JetStreamContext

from eventlog.pieces import PieceStore, open_pieces
from eventlog.reader import read_session
from materializer.records import derive_records
from materializer.verify import (
    Difference,
    body_differences,
    compare,
    image_differences,
    load_markers,
    read_marker,
    session_images,
)
from rollbus.progress import PLAIN_EVERY_S, Progress, rate_text, summary
from rollbus.tools import EXIT_DIFFERENT, EXIT_ERROR, EXIT_OK, run_tool
from schemas.bodies import rebuild
from schemas.errors import SessionNotFound
from schemas.events import AnyEvent
from schemas.log import LogConfig
from schemas.records import MaterializedMarker, record_digest
from session.fold import SessionState, fold
from session.summary import summarize
from session.views import ChainView, chain_tokens, chain_views
from session_projector.replay import Replayed, ReplayStats, replay_all, replay_one


def run(args: argparse.Namespace) -> int:
    if args.all and not args.verify:
        print("rollbus replay: --all goes with --verify", file=sys.stderr)
        return EXIT_ERROR
    if bool(args.session_id) == bool(args.all):
        print("rollbus replay: name one SESSION_ID, or --verify --all", file=sys.stderr)
        return EXIT_ERROR
    if args.request is not None and (args.verify or args.json):
        print("rollbus replay: --request goes alone with a SESSION_ID", file=sys.stderr)
        return EXIT_ERROR
    return asyncio.run(run_tool(args, replay_main))


async def replay_main(js: JetStreamContext, cfg: LogConfig, args: argparse.Namespace) -> int:
    if args.all:
        return await verify_all(js, cfg, as_json=args.json)
    try:
        if args.verify:
            return await verify_one(js, cfg, await replay_one(js, cfg, args.session_id, check_bodies=True),
                                    as_json=args.json)
        session_log = await read_session(js, cfg, args.session_id)
    except SessionNotFound:
        print(f"rollbus replay: no session {args.session_id} in the log", file=sys.stderr)
        return EXIT_ERROR
    if getattr(args, "request", None) is not None:
        return _print_body(session_log.events, args.session_id, args.request)
    state = fold(session_log.events)
    assert state is not None  # read_session never returns an empty log
    info = {"events": len(session_log.events), "last_stream_seq": session_log.last_stream_seq}
    print(replay_json(state, info) if args.json else replay_table(state, info))
    return EXIT_OK


# --- showing one session ------------------------------------------------------------------

def _print_body(events: Sequence[AnyEvent], session_id: str, request_no: int) -> int:
    bodies = rebuild(events)
    if request_no not in bodies:
        print(f"rollbus replay: session {session_id} has no request {request_no} "
              f"(it has {len(bodies)})", file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.buffer.write(bodies.body(request_no))
    sys.stdout.buffer.flush()
    return EXIT_OK


def replay_json(state: SessionState, info: dict[str, int]) -> str:
    chains = []
    for view, chain in zip(chain_views(state), state.chains, strict=True):
        images = {"images": msgspec.to_builtins(chain.images)} if chain.images else {}  # (offsets: prompt + response)
        chains.append({**msgspec.to_builtins(view), **chain_tokens(chain), **images})
    body = {"session": msgspec.to_builtins(summarize(state)), **info, "chains": chains, "records": _records(state)}
    return msgspec.json.encode(body).decode()


def _records(state: SessionState) -> list[dict[str, object]]:
    if state.status != "finalized":
        return []
    return [{"key": r.key, "digest": record_digest(r), "reward": r.reward, "response_len": r.response_len,
             "materialization_reason": r.materialization_reason} for r in derive_records(state)]


def replay_table(state: SessionState, info: dict[str, int]) -> str:
    summary = summarize(state)
    reward = "-" if summary.reward is None else f"{summary.reward:g}"
    extra = f" {msgspec.json.encode(summary.reward_info).decode()}" if summary.reward_info else ""
    closed = f" ({state.close_reason})" if state.close_reason and state.close_reason != state.status else ""
    lines = [f"session {state.session_id}  uid {state.uid}  index {state.session_index}  "
             f"agent {state.agent_name or '-'}  {state.status}{closed}  reward {reward}{extra}",
             f"log: {info['events']} events, last at stream seq {info['last_stream_seq']}; "
             f"requests {summary.requests}, turns {summary.turns}, chains {len(state.chains)}"]
    for view, chain in zip(chain_views(state), state.chains, strict=True):
        lines += ["", *_chain_lines(view, state.status)]
        lines += [f"  image at token {i.offset} ({i.tokens} tokens): {i.media_type} {i.width}x{i.height} "
                  f"sha256 {i.digest[:16]}" for i in chain.images]
    records = _records(state)
    if records:
        lines += ["", "records (as the materializer derives them):"]
        lines += [f"  {r['key']}  digest {str(r['digest'])[:16]}  reward {r['reward']:g} on the last of "
                  f"{r['response_len']} response tokens" for r in records]
    elif state.status == "open":
        lines += ["", "open: no records until the session is finalized"]
    return "\n".join(lines)


def _chain_status(view: ChainView, session_status: str) -> str:
    """As the viewer says it: a chain still open when its session ended became a trajectory with the session."""
    if view.materialization_reason:
        return f"closed ({view.materialization_reason})"
    return "open" if session_status == "open" else f"ended with the session ({session_status})"


def _chain_lines(view: ChainView, session_status: str) -> list[str]:
    turns = f"{len(view.turns)} turn{'' if len(view.turns) == 1 else 's'}"
    lines = [f"chain {view.index}  {_chain_status(view, session_status)}  prompt {view.prompt_len}  response "
             f"{view.response_len} (sampled {view.sampled_len}, context {view.response_len - view.sampled_len})  "
             f"log probs {'yes' if view.has_logprobs else 'no'}  {turns}",
             f"  {'turn':>4} {'req':>4} {'context':>7} {'sampled':>7}  {'finish':<7} reply"]
    for number, turn in enumerate(view.turns, 1):
        reply = turn.text.replace("\n", "\\n")
        reply = reply if len(reply) <= 48 else reply[:47] + "…"
        calls = f"  [tools: {', '.join(turn.tool_calls)}]" if turn.tool_calls else ""
        lines.append(f"  {number:>4} {turn.request_no:>4} {turn.context_tokens:>7} {turn.sampled_tokens:>7}  "
                     f"{turn.finish_reason:<7} {reply}{calls}")
    runs = " ".join(f"{value}x{length}" for value, length in view.mask_runs) or "-"
    lines.append(f"  mask (response): {runs}")
    return lines


# --- verifying ----------------------------------------------------------------------------

def _print_differences(differences: list[Difference]) -> None:
    for d in differences:
        print(f"DIFF {d.session_id} {d.kind} {d.key or '-'} {d.detail}".rstrip())


def verdict(replayed: Replayed, marker: MaterializedMarker | None,
            images: list[Difference] | None = None) -> list[Difference]:
    """What differs for one replayed session: the same for ``--verify SID`` and ``--verify --all``
    (``images``: its images' differences, :class:`_Images`)."""
    differences = body_differences(replayed.session_id, replayed.bad_bodies)
    if replayed.state is None:
        return [*differences, Difference(session_id=replayed.session_id, kind="unreadable",
                                         detail=replayed.error or "")]
    return differences + compare(replayed.state, marker) + (images or [])


class _Images:
    """Each image of a session fetched back from the log's object store and checked against its digest (the store
    bound once, at the first session that has images)."""

    def __init__(self, js: JetStreamContext, cfg: LogConfig) -> None:
        self._js, self._cfg = js, cfg
        self._store: PieceStore | None = None
        self._opened = False

    async def differences(self, replayed: Replayed) -> list[Difference]:
        images = session_images(replayed.state) if replayed.state is not None else {}
        if not images:
            return []
        if not self._opened:
            self._store, self._opened = await open_pieces(self._js, self._cfg), True
        store = self._store
        stored = {digest: await store.get(replayed.session_id, bytes.fromhex(digest)) if store is not None else None
                  for digest in images}
        return image_differences(replayed.session_id, images, stored)


async def verify_one(js: JetStreamContext, cfg: LogConfig, replayed: Replayed, *, as_json: bool) -> int:
    marker = await read_marker(js, cfg, replayed.session_id)
    differences = verdict(replayed, marker, await _Images(js, cfg).differences(replayed))
    if as_json:
        print(msgspec.json.encode({"sessions": 1, "differences": differences}).decode())
    else:
        _print_differences(differences)
        held = f"{len(marker.digests)} records in its marker" if marker is not None else "no marker"
        state = replayed.state
        what = f"unreadable, {held}" if state is None else f"{state.status}, {held}, {state.requests} request bodies"
        print(f"verified {replayed.session_id} ({what}): {len(differences)} differences")
    return EXIT_DIFFERENT if differences else EXIT_OK


class _Tally(msgspec.Struct, kw_only=True):
    sessions: int = 0
    finalized: int = 0
    records: int = 0
    open: int = 0
    aborted: int = 0
    unreadable: int = 0


class _Verdict(msgspec.Struct, frozen=True):
    kind: str  # a _Tally counter: finalized, open, aborted or unreadable
    records: int  # in its marker (finalized sessions)
    differences: tuple[Difference, ...]


class _Verdicts:
    """Every session's verdict, in stream order, and their tally; a session replayed again (its log went on
    after its end: :attr:`Replayed.amends`) has its verdict replaced."""

    def __init__(self, markers: dict[str, MaterializedMarker]) -> None:
        self.markers = markers
        self.tally = _Tally()
        self.differences = 0
        self._by_session: dict[str, _Verdict] = {}

    def add(self, replayed: Replayed, images: list[Difference] | None = None) -> None:
        marker = self.markers.get(replayed.session_id)
        state = replayed.state
        kind = "unreadable" if state is None else state.status
        records = len(marker.digests) if marker is not None and kind == "finalized" else 0
        new = _Verdict(kind, records, tuple(verdict(replayed, marker, images)))
        old = self._by_session.get(replayed.session_id)
        self._count(old, -1)
        self._count(new, 1)
        self._by_session[replayed.session_id] = new

    def _count(self, v: _Verdict | None, sign: int) -> None:
        if v is None:
            return
        self.tally.sessions += sign
        setattr(self.tally, v.kind, getattr(self.tally, v.kind) + sign)
        self.tally.records += sign * v.records
        self.differences += sign * len(v.differences)

    def seen(self) -> set[str]:
        return set(self._by_session)

    def all_differences(self) -> list[Difference]:
        return [d for v in self._by_session.values() for d in v.differences]


async def verify_all(js: JetStreamContext, cfg: LogConfig, *, as_json: bool, progress_s: float = PLAIN_EVERY_S
                     ) -> int:
    """One pass over the log, every session judged as ``--verify SID`` judges it (:func:`verdict`); progress
    on stderr (a bar on a terminal, else a line every ``progress_s`` and one at the end), then the summary
    table there."""
    verdicts = _Verdicts(await load_markers(js, cfg))
    images = _Images(js, cfg)
    stats = ReplayStats()
    progress = Progress("verify", unit="envelopes", every_s=progress_s, line=lambda: _progress_line(stats, verdicts))
    with progress:
        async for replayed in replay_all(js, cfg, stats, check_bodies=True):
            verdicts.add(replayed, await images.differences(replayed))
            progress.update(stats.envelopes, total=stats.last_stream_seq,
                            detail=f"{verdicts.tally.sessions} sessions, {verdicts.differences} differences")
    differences = verdicts.all_differences()
    differences += [Difference(session_id=sid, kind="orphan_marker", detail="no such session in the log")
                    for sid in sorted(verdicts.markers.keys() - verdicts.seen())]
    tally = verdicts.tally
    _report(tally, differences, as_json=as_json)
    summary("verify", [("envelopes read", str(stats.envelopes)), ("sessions", str(tally.sessions)),
                       ("finalized checked", str(tally.finalized)), ("records in markers", str(tally.records)),
                       ("open", str(tally.open)), ("aborted", str(tally.aborted)),
                       ("unreadable", str(tally.unreadable)), ("read again whole", str(stats.amended)),
                       ("differences", str(len(differences))),
                       ("rate", rate_text(stats.envelopes, progress.elapsed_s, "envelopes"))])
    return EXIT_DIFFERENT if differences else EXIT_OK


def _progress_line(stats: ReplayStats, verdicts: _Verdicts) -> str:
    tally = verdicts.tally
    return (f"verify: {stats.envelopes} envelopes read (the log ends at {stats.last_stream_seq}), "
            f"{tally.sessions} sessions, {tally.finalized} finalized checked, {verdicts.differences} differences")


def _report(tally: _Tally, differences: list[Difference], *, as_json: bool) -> None:
    if as_json:
        print(msgspec.json.encode({**msgspec.to_builtins(tally), "differences": differences}).decode())
        return
    _print_differences(differences)
    print(f"verified {tally.finalized} finalized sessions ({tally.records} records in their markers); "
          f"{tally.open} open and {tally.aborted} aborted not materialized; {tally.unreadable} unreadable; "
          f"{len(differences)} differences")
