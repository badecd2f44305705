"""The exception tree: every exception rollbus defines is here, rooted at :class:`RollbusError`.

The domain raises these; only the edge maps them to HTTP. The first part is what a request can
meet (the edge answers each in its wire's shape); then what the parts meet inside (the edge's
codec, the log's NATS replies, the materializer), what the stack and the CLI tell the user, and
the verl side's (agent_framework). A class named ``(+ValueError)`` also derives from that
built-in, because callers catch it as one (a configuration error is a ``ValueError``)::

    RollbusError
    ├── MalformedRequest          the request does not decode or makes no sense
    │   ├── ContextTooLong        the prompt alone exceeds the trajectory length
    │   ├── IdempotencyKeyReused  an Idempotency-Key repeated with a different body
    │   ├── ChatTemplateError     the chat template refused to render these messages
    │   ├── TemplateNotIncremental  the chat template is not prefix-stable for these messages
    │   ├── Unconstrainable       a forced reply the session's tool format cannot be constrained to
    │   └── ImageRefused          an image that does not decode, of a format not taken, or with no processor
    ├── Unauthorized              missing or wrong api key / admin token
    ├── SessionNotFound
    ├── ResponseNotFound          a stored response (Responses API) the session does not hold
    ├── RouteNotFound             no route serves the path (Starlette's 404)
    ├── MethodNotAllowed          a route serves the path, not the method (Starlette's 405)
    ├── SessionClosed             finalized or aborted
    ├── Conflict                  e.g. a reward after materialization
    │   ├── OwnershipLost         another writer appended to this session
    │   ├── SessionOwned          another edge holds the session's lease (``retry_after``)
    │   └── RevisionConflict      a KV key was written since it was read (a lost compare-and-set)
    ├── PayloadTooLarge
    │   └── ImageTooLarge         an image over a limit (bytes, declared pixels or side, images per request)
    ├── CapacityExceeded          too many open sessions or requests (``retry_after`` when known)
    ├── EngineError               the engine answered nonsense or failed
    │   ├── EngineRefused         the engine refused the input (its HTTP 400, e.g. too long)
    │   ├── EngineUnavailable     refused, unhealthy
    │   │   └── Refused           nothing reached the server (connection refused, or connecting timed out)
    │   ├── EngineTimeout
    │   ├── Dropped               the server closed the connection before its reply was whole
    │   └── RouteMissing          vLLM has no /inference/v1/generate (the edge uses /v1/completions)
    ├── LogUnavailable            JetStream did not answer or acknowledge (reading or writing; ``retry_after``)
    ├── SinkUnavailable           a record sink (TransferQueue) did not take a write
    ├── FoldError                 an event that does not fit the state (a bug or a corrupt log)
    │   ├── OutOfOrderEvent       an event whose sequence is not the next one
    │   └── NotEnded              a ready signal for a session the log does not show ended (yet)
    │
    │   inside the edge's codec (caught where they are met; never answered)
    ├── NoRoom                    a text that cannot fit the tokens left (known before encoding it)
    ├── UnfaithfulTemplate        an assistant turn renders unlike a model's continuation (a startup probe)
    ├── CodecMismatch (+ValueError)  the template and tool format cannot record exact trajectories
    │
    │   the log's NATS replies (eventlog.acks), mapped to the errors above by eventlog.publisher
    ├── PublishRejected           JetStream answered with an API error (``error``)
    ├── NoResponders              no stream takes the subject
    ├── PublishRefused            the server refused the subject (a permissions violation)
    │
    │   records, the stack and the CLI
    ├── ScorerError               the reward scorer failed or answered nonsense
    ├── RecordTooLong             records longer than the padded lengths (``overflow="error"``)
    ├── UserError                 a mistake the user can fix: the CLI prints one line, exits 2
    │   └── StartupError          the stack cannot start (a busy port, a missing model)
    ├── EmbeddedNatsError         the embedded nats-server could not be found, started or made ready
    │   └── NatsServerNotFound
    ├── ProvisionError            a stream or bucket exists with settings provision may not change
    ├── ArchiveError (+ValueError)  a file that is not an archive this version reads
    ├── IncompleteLog             a bucket or a piece missing: the log cannot be exported whole
    │
    │   the verl side (agent_framework; re-exported by agent_framework and agent_framework.builtin)
    ├── ConfigError (+ValueError)        the adapter's configuration
    ├── RunnerLoadError (+ValueError)    an agent runner that cannot be loaded
    ├── BatchError (+ValueError)         a batch row without a field the adapter needs
    ├── TaskConfigError (+ValueError)    the built-in runner's task config or a row's tools_kwargs
    ├── ToolArgumentError (+ValueError)  a tool call's arguments that do not fit the tool
    ├── EdgeError (+RuntimeError)        an edge refused or could not take an admin call (``retriable``)
    ├── RewardPostError (+RuntimeError)  posting a reward failed
    ├── RolloutFailed (+RuntimeError)    every rollout of a batch failed
    └── SandboxError                     a sandbox could not do what was asked
        ├── SandboxUnavailable           it cannot confine as configured
        └── SandboxPathError (+ValueError)  a path outside the sandbox root

The classes carry no HTTP status and no wire error type: those are the edge's, in one table
keyed by class (:data:`edge.http_errors.ERRORS`, which also lists each one's status; a class
without a row answers as its nearest ancestor with one). What an error carries is domain data:
its message, the request field it is about (``param``) and, for those that know one, how many
seconds until a retry may succeed (``retry_after``).

One exception is defined elsewhere, on purpose: ``eventlog.publisher._Again``, the private
signal of one append attempt to its retry loop; it never leaves that class, and it is no error
(``tests/unit/test_error_tree.py`` holds the list of such exceptions).
"""

from __future__ import annotations

from typing import Protocol

# What a 503 for the log tells a client to wait before retrying: a three-node cluster that lost a node refuses
# writes for 2-7 s while it elects leaders (tests/cluster/test_open_during_node_kill.py), so an SDK's few
# retries (the openai SDK honours Retry-After up to 60 s) span it; a blip costs a client 2 s.
LOG_RETRY_AFTER_S = 2.0


class RollbusError(Exception):
    """Base of every rollbus error."""

    retry_after: float | None = None  # seconds until a retry may succeed, when the error knows

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedRequest(RollbusError):
    """The request does not decode or makes no sense."""


class ContextTooLong(MalformedRequest):
    """The prompt alone exceeds the trajectory length."""


class IdempotencyKeyReused(MalformedRequest):
    """An Idempotency-Key repeated with a different body."""


class ChatTemplateError(MalformedRequest):
    """The chat template does not compile, or refused to render these messages."""


class TemplateNotIncremental(MalformedRequest):
    """The chat template is not prefix-stable for these messages: increments would be wrong."""


class Unconstrainable(MalformedRequest):
    """The request forces a reply the session's tool format cannot be constrained to."""


class ImageRefused(MalformedRequest):
    """An image the gateway does not take: undecodable data, a format it does not read, a data URL that is
    not one, an image where no processor is configured. The message names the field (``param``) and why."""


class Unauthorized(RollbusError):
    """A missing or wrong api key or admin token."""


class SessionNotFound(RollbusError):
    """No such session."""


class ResponseNotFound(RollbusError):
    """A response id (the Responses API's ``previous_response_id``, ``GET .../responses/{id}``) that
    names no response the session stored: unknown, another session's, or not stored."""


class RouteNotFound(RollbusError):
    """No route serves the path (Starlette's 404), answered in the shape of the wire it belongs to."""


class MethodNotAllowed(RollbusError):
    """A route serves the path but not the method (Starlette's 405)."""


class SessionClosed(RollbusError):
    """The session is finalized or aborted."""


class Conflict(RollbusError):
    """The request conflicts with the session's state (e.g. a reward after materialization)."""


class OwnershipLost(Conflict):
    """Another writer appended to this session, or took its lease."""


class RevisionConflict(Conflict):
    """A KV key was written by someone else since it was read, or created first (a lost compare-and-set)."""


class SessionOwned(Conflict):
    """Another live edge holds the session's lease; it can be taken over once the lease lapses."""

    def __init__(self, message: str, *, retry_after: float, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = max(0.0, retry_after)


class PayloadTooLarge(RollbusError):
    """A body, or an event, over its size limit."""


class ImageTooLarge(PayloadTooLarge):
    """An image over one of its limits (``vision.images.ImageLimits``): its bytes, its declared pixels or
    side (refused from the header, before decoding: a decompression bomb), or too many images in a request.
    The message names the limit and its value."""


class CapacityExceeded(RollbusError):
    """Too many open sessions or requests."""

    def __init__(self, message: str, *, retry_after: float | None = None, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = None if retry_after is None else max(0.0, retry_after)


class EngineError(RollbusError):
    """The engine answered nonsense or failed."""


class EngineRefused(EngineError):
    """The engine refused the request's input (SGLang or vLLM answered 400, e.g. a prompt longer than
    the model's context): the agent's request cannot succeed as it is, so the edge answers it as the
    agent's mistake (not a 5xx, which the SDKs would retry). ``message`` carries the engine's own
    words, bounded."""


class EngineUnavailable(EngineError):
    """The engine refused the connection or is unhealthy."""


class Refused(EngineUnavailable):
    """The connection was refused or timed out while connecting: nothing reached the server."""


class EngineTimeout(EngineError):
    """The engine did not answer in time."""


class Dropped(EngineError):
    """The server closed the connection before its reply was whole (an HTTP protocol error: no
    status line, or a body cut short)."""


class RouteMissing(EngineError):
    """``/inference/v1/generate`` answered 404: nothing was generated, use completions instead."""


class LogUnavailable(RollbusError):
    """JetStream (the log, its KV buckets or object store) did not answer, acknowledge or hold still.

    It comes back by itself (a cluster elects a new leader within seconds of losing a node, a
    restarted server restores its streams): ``retry_after`` is :data:`LOG_RETRY_AFTER_S` unless set."""

    retry_after: float | None = LOG_RETRY_AFTER_S


class SinkUnavailable(RollbusError):
    """A record sink (TransferQueue) did not take a write."""


class FoldError(RollbusError):
    """An event that does not fit the state (a bug or a corrupt log)."""


class OutOfOrderEvent(FoldError):
    """An event whose sequence is not the next one."""


class NotEnded(FoldError):
    """A ready signal for a session the log does not show ended (yet)."""


# ---------------------------------------------------------------- inside the edge's codec


class NoRoom(RollbusError):
    """The text needs more tokens than the room left: known from its lower bound
    (:meth:`Tokenizer.min_tokens`), before it is encoded."""


class UnfaithfulTemplate(RollbusError):
    """Rendering an assistant turn does not continue the generation prompt as a model would."""


class CodecMismatch(RollbusError, ValueError):
    """The configured template and tool format cannot record exact trajectories."""


# ---------------------------------------------------------------- the log's NATS replies


class ApiErrorReply(Protocol):
    """JetStream's API error, as a publish's acknowledgement carries it (``eventlog.acks.ApiError``)."""

    @property
    def code(self) -> int: ...

    @property
    def err_code(self) -> int: ...

    @property
    def description(self) -> str: ...


class PublishRejected(RollbusError):
    """JetStream answered with an API error."""

    def __init__(self, error: ApiErrorReply) -> None:
        super().__init__(f"{error.code} {error.err_code}: {error.description}")
        self.error = error


class NoResponders(RollbusError):
    """Nothing listens on the subject: no stream takes it (JetStream down or not provisioned)."""


class PublishRefused(RollbusError):
    """The server refused this connection the publish's subject (or the reply subscription): a
    permissions violation, which no retry changes."""


# ---------------------------------------------------------------- records, the stack and the CLI


class ScorerError(RollbusError):
    """The reward scorer failed or answered nonsense; the session is retried later."""


class RecordTooLong(RollbusError):
    """Records longer than the padded lengths, under ``overflow="error"``."""


class UserError(RollbusError):
    """A mistake the user can fix; its message is one line that names the problem."""


class StartupError(UserError):
    """The stack cannot start for a reason the user can fix (a busy port, a missing model, an unwritable
    ``--data-dir``); its message is one line naming the problem and the flag."""


class EmbeddedNatsError(RollbusError):
    """The embedded server could not be found, started, or made ready."""


class NatsServerNotFound(EmbeddedNatsError):
    """No ``nats-server`` binary where we looked."""


class ProvisionError(RollbusError):
    """A stream or bucket exists with settings provision may not change."""


class ArchiveError(RollbusError, ValueError):
    """A file that is not an archive this version can read, or whose contents do not check out."""


class IncompleteLog(RollbusError):
    """A bucket of the log, or a piece an envelope references, is missing: it cannot be exported whole."""


# ---------------------------------------------------------------- the verl side (agent_framework)


class ConfigError(RollbusError, ValueError):
    """A configuration value the adapter cannot run with; the message names the key."""


class RunnerLoadError(RollbusError, ValueError):
    """The runner's ``runner_fqn`` does not import, or names nothing callable."""


class BatchError(RollbusError, ValueError):
    """A batch the adapter cannot run (a missing or malformed field); names the field and row."""


class TaskConfigError(RollbusError, ValueError):
    """A task config file or a row's tools_kwargs the runner cannot run with."""


class ToolArgumentError(RollbusError, ValueError):
    """Arguments that do not fit the tool's schema."""


class EdgeError(RollbusError, RuntimeError):
    """An edge refused or could not take an admin call (``retriable``: it may take it later, or another may)."""

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message)
        self.retriable = retriable


class RewardPostError(RollbusError, RuntimeError):
    """The session's reward endpoint did not take the reward."""


class RolloutFailed(RollbusError, RuntimeError):
    """Every rollout of a batch failed (raised by ``generate_sequences_and_wait``)."""


class SandboxError(RollbusError):
    """A sandbox could not do what was asked."""


class SandboxUnavailable(SandboxError):
    """The sandbox cannot confine as configured (e.g. no network namespace without root)."""


class SandboxPathError(SandboxError, ValueError):
    """A path that leaves the sandbox root."""
