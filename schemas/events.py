"""The event catalog: everything that happens to a session, as immutable past-tense facts.

Every event carries the session id, its per-session sequence number (1, 2, 3, ...), the
time it was decided (from an injected clock) and the schema version it was written
with. Events are frozen ``msgspec`` structs tagged by ``type``; the log stores them as
MessagePack, grouped into *envelopes* (see :mod:`schemas.envelope`).

Token ids travel as packed little-endian ``uint32`` bytes and log probs as packed
``float32`` bytes (:mod:`schemas.tokens`), never as lists of Python numbers.

See ``docs/events.md`` for the catalog with subjects.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

SCHEMA_VERSION = 2  # 2: a request body is stored as parts (schemas/bodies.py); 1 kept it whole


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call the model made, as parsed from its sampled text."""

    id: str
    name: str
    arguments: str  # the JSON text of the arguments, as the model wrote it


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Session-level sampling defaults; a request's own values win, within limits."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every event. ``seq`` is the per-session sequence number, starting at 1."""

    session_id: str
    seq: int
    time: float
    v: int = SCHEMA_VERSION


class SessionOpened(Event, tag="session_opened", kw_only=True):
    uid: str
    session_index: int
    agent_name: str = ""
    metadata: dict[str, Any] = {}
    sampling: SamplingDefaults = SamplingDefaults()
    api_key_digest: str  # sha256 hex of the session's api key; the key itself is never logged
    max_trajectory_length: int
    tokenizer: str
    tool_format: str
    edge_id: str = ""
    # --reasoning-format, and the template's mode (edge.tokens.fidelity.choose_mode). UNSET (absent from the
    # encoded event, so the events written before them encode as they were): "think" and "prefix-stable",
    # the only ones then; read them through ``reasoning`` and ``template``.
    reasoning_format: str | msgspec.UnsetType = msgspec.UNSET
    template_mode: str | msgspec.UnsetType = msgspec.UNSET
    # The image processor's name (``builtin:qwen2.5-vl`` or its directory) when the edge has one. UNSET (absent
    # from the encoded event, so the events written before it encode as they were): none, images refused.
    processor: str | msgspec.UnsetType = msgspec.UNSET

    @property
    def reasoning(self) -> str:
        """How the edge read reasoning out of the replies: ``think`` or ``sglang:NAME``."""
        return "think" if self.reasoning_format is msgspec.UNSET else self.reasoning_format

    @property
    def template(self) -> str:
        """``prefix-stable`` or ``continuous tokens``."""
        return "prefix-stable" if self.template_mode is msgspec.UNSET else self.template_mode


class BodyPart(msgspec.Struct, frozen=True, array_like=True):
    """A run of a request body: bytes of its own (``data``), or ``length`` bytes from ``start`` of
    the body of an earlier request of the same session (``request_no`` > 0). See schemas/bodies.py."""

    data: bytes = b""
    request_no: int = 0  # 0: the bytes are ``data``
    start: int = 0
    length: int = 0


class RequestReceived(Event, tag="request_received", kw_only=True):
    """The raw wire request, kept byte-exact for audit (and to recognize a retried request).

    The body is the concatenation of its ``parts``: what the session's earlier requests already
    stored (agents resend their history) is a reference, so a session's log grows with what is new.
    """

    request_no: int
    wire: str  # "openai" | "anthropic" | "responses"
    parts: tuple[BodyPart, ...]
    body_size: int  # bytes of the whole body
    idempotency_key: str | None = None
    body_digest: str  # body_digest(body): sha256 hex of the whole body


def body_digest(body: bytes) -> str:
    """The digest that says two requests carry the same body: sha256 hex of the raw bytes."""
    return hashlib.sha256(body).hexdigest()


FORK_CAUSES = ("sibling", "sub_agent", "history_rewritten", "history_compacted", "reasoning_dropped",
               "tools_changed", "system_changed", "tool_calls_as_text", "new_conversation", "unknown")
"""Why a chain started (:class:`ForkPoint`); ``edge.forks`` says how each is told from the others."""


class ForkPoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where a new chain comes from: its parent chain, how much of the parent it shares, and why it
    did not continue it (one of :data:`FORK_CAUSES`)."""

    cause: str
    parent: int | None = None  # the chain sharing the longest message prefix; None: no chain is its parent
    message_index: int = 0  # the request's messages[:message_index] are the parent's history too
    token_offset: int = 0  # the new chain's prompt repeats the parent's first token_offset tokens


class ImageRef(msgspec.Struct, frozen=True, kw_only=True):
    """An image in an event's token ids: its bytes are in the log's object store under
    ``schemas.blobs.object_name(session_id, bytes.fromhex(digest))``, stored before the event."""

    digest: str  # sha256 hex of the image bytes
    media_type: str  # "image/png", "image/jpeg", "image/webp", "image/gif"
    width: int
    height: int
    offset: int  # index, in this event's token ids, of the image's first image pad token
    tokens: int  # how many image pad tokens it has


class ChainStarted(Event, tag="chain_started", kw_only=True):
    """A request that extends no chain starts one; its rendered prompt is the chain's prompt."""

    chain: int
    request_no: int
    prompt_ids: bytes
    prefix_digest: str  # digest of the request's message history (tools included)
    n_messages: int
    chat_turns: int  # user + assistant messages in the prompt
    # Its parent and the cause of the fork. UNSET (absent from the encoded event, so the events written
    # before the field re-encode byte for byte): not recorded (a log written before forks were).
    fork: ForkPoint | msgspec.UnsetType = msgspec.UNSET
    # The images in ``prompt_ids``, in order (offsets into it). UNSET (absent from the encoded event, so the
    # events written before the field re-encode byte for byte): none.
    images: tuple[ImageRef, ...] | msgspec.UnsetType = msgspec.UNSET


class ContextAppended(Event, tag="context_appended", kw_only=True):
    """Continuation tokens (new messages rendered incrementally), mask 0."""

    chain: int
    request_no: int
    token_ids: bytes
    prefix_digest: str
    n_messages: int  # message history length after the append
    chat_turns: int  # user + assistant messages in the appended messages
    # The request re-sent the chain's replies other than sampled (this cause: "reasoning_dropped" or
    # "tool_calls_as_text") and the session's continue_reserialized_turns continued the chain with its logged
    # tokens instead of forking. UNSET (absent from the encoded event): the request extended the chain as is.
    reserialized: str | msgspec.UnsetType = msgspec.UNSET
    # The images in ``token_ids``, in order (offsets into it). UNSET (absent from the encoded event): none.
    images: tuple[ImageRef, ...] | msgspec.UnsetType = msgspec.UNSET


class TokensGenerated(Event, tag="tokens_generated", kw_only=True):
    """A coalesced chunk of sampled tokens, mask 1, exactly as the engine produced them."""

    chain: int
    request_no: int
    token_ids: bytes
    logprobs: bytes | None = None


class TurnCompleted(Event, tag="turn_completed", kw_only=True):
    chain: int
    request_no: int
    finish_reason: str  # the engine's: "stop" | "length" | "abort"
    text: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tip_digest: str  # digest of the message history including this assistant reply
    n_messages: int
    weight_version: str | None = None
    # Sampled under a constraint (edge.tokens.constraint): its label, e.g. "tool:required", "tool:get_weather",
    # "json_object", "json_schema:<name>"; its log probs are the constrained distribution's. UNSET (absent from
    # the encoded event, so the events written before the field re-encode byte for byte): sampled free.
    constrained: str | msgspec.UnsetType = msgspec.UNSET


class EngineFailed(Event, tag="engine_failed", kw_only=True):
    """An engine call that produced nothing usable; nothing was committed to the chain."""

    request_no: int
    chain: int | None  # None: the request would have started a new chain
    error: str  # the error class, e.g. "EngineTimeout"
    message: str


class RewardInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A task's ``reward_info``, typed (:func:`reward.intake.reward_info_of`). On the wire
    (``POST .../reward_info {"reward_info": {"reward": 1.0, "acc": 1.0, "finished": true}}``) and in
    the log (:class:`RewardReported`: ``reward`` apart, every other key in ``extra`` as posted) it
    stays one flat map; ``reward`` and ``finished`` are rollbus's, every other key is free-form."""

    reward: float | None = None  # None: the task reported extra info only
    finished: bool | None = None  # the episode's completion, as the task said it (None: not said)
    extra: dict[str, Any] = {}  # reward extra info: every other posted key, free-form by contract

    @property
    def unfinished(self) -> bool:
        """The task said the episode did not finish (``finished: false``; absent means unknown)."""
        return self.finished is False


class RewardReported(Event, tag="reward_reported", kw_only=True):
    """A reward posted to the session (``reward`` absent: the task reported extra info only); ``extra``
    holds every other posted key, ``finished`` included, as posted (typed: :class:`RewardInfo`)."""

    reward: float | None = None
    extra: dict[str, Any] = {}
    source: str = "task"


class ChainClosed(Event, tag="chain_closed", kw_only=True):
    chain: int
    reason: str  # e.g. "max_trajectory_length"
    request_no: int | None = None


class SessionFinalized(Event, tag="session_finalized", kw_only=True):
    reason: str = "finalized"


class SessionAborted(Event, tag="session_aborted", kw_only=True):
    reason: str


class TurnAbandoned(Event, tag="turn_abandoned", kw_only=True):
    """A turn given up before it was committed (its client disconnected mid-stream): the
    engine request was aborted and nothing reached the chain, which is left as it was."""

    request_no: int
    chain: int | None  # None: the request would have started a new chain
    reason: str  # "client_disconnected"
    tokens_sampled: int  # tokens the engine had produced when the turn was given up


class TurnRolledBack(Event, tag="turn_rolled_back", kw_only=True):
    """The chain's last assistant turn was rewritten by the agent: its sampled tokens leave the
    chain (which ends again at that turn's generation prompt); the rewritten message follows as
    context (mask 0) in the ``context_appended`` after this event."""

    chain: int
    request_no: int  # the request that rewrote it
    turn_request_no: int  # the request whose turn is rolled back
    tokens_dropped: int  # sampled tokens removed from the chain


class SessionQuarantined(Event, tag="session_quarantined", kw_only=True):
    """The materializer set an ended session aside: it cannot be materialized (its log does not fold,
    its records cannot be derived, the sinks cannot hold them, or its write failed on its own). None
    of its records are in the sinks; its prompt counts it as a failed session. Appended by the
    materializer after the session ended (the edge writes nothing more to it but a late reward), at
    most once a session; ``rollbus materialize --from-log`` still tries it again."""

    stage: str  # "unreadable" | "underivable" | "invalid" | "parquet" | "write": see materializer.quarantine
    reason: str  # what could not be done, one line, bounded


AnyEvent = (
    SessionOpened
    | RequestReceived
    | ChainStarted
    | ContextAppended
    | TokensGenerated
    | TurnCompleted
    | EngineFailed
    | RewardReported
    | ChainClosed
    | SessionFinalized
    | SessionAborted
    | TurnAbandoned
    | TurnRolledBack
    | SessionQuarantined
)

# The last token of a subject, per event type: ``rollbus.<session_id>.<kind>``.
SUBJECT_KINDS: dict[type[Event], str] = {
    SessionOpened: "opened",
    RequestReceived: "request",
    ChainStarted: "chain",
    ContextAppended: "context",
    TokensGenerated: "tokens",
    TurnCompleted: "turn",
    EngineFailed: "failed",
    RewardReported: "reward",
    ChainClosed: "closed",
    SessionFinalized: "finalized",
    SessionAborted: "aborted",
    TurnAbandoned: "abandoned",
    TurnRolledBack: "rolledback",
    SessionQuarantined: "quarantined",
}
