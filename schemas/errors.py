"""The exception tree. The domain raises these; only the edge maps them to HTTP.

::

    RollbusError
    ├── MalformedRequest          the request does not decode or makes no sense
    │   ├── ContextTooLong        the prompt alone exceeds the trajectory length
    │   └── IdempotencyKeyReused  an Idempotency-Key repeated with a different body
    ├── Unauthorized              missing or wrong api key / admin token
    ├── SessionNotFound
    ├── ResponseNotFound          a stored response (Responses API) the session does not hold
    ├── SessionClosed             finalized or aborted
    ├── Conflict                  e.g. a reward after materialization
    │   ├── OwnershipLost         another writer appended to this session
    │   ├── SessionOwned          another edge holds the session's lease (``retry_after``)
    │   └── RevisionConflict      a KV key was written since it was read (a lost compare-and-set)
    ├── PayloadTooLarge
    ├── CapacityExceeded          too many open sessions or requests (``retry_after`` when known)
    ├── EngineError               the engine answered nonsense or failed
    │   ├── EngineRefused         the engine refused the input (its HTTP 400, e.g. too long)
    │   ├── EngineUnavailable     refused, unhealthy
    │   └── EngineTimeout
    ├── LogUnavailable            JetStream did not answer or acknowledge (reading or writing; ``retry_after``)
    ├── SinkUnavailable           a record sink (TransferQueue) did not take a write
    └── FoldError                 an event that does not fit the state (a bug or a corrupt log)
        └── OutOfOrderEvent       an event whose sequence is not the next one

The classes carry no HTTP status and no wire error type: those are the edge's, in one table
keyed by class (:data:`edge.http_errors.ERRORS`, which also lists each one's status). What
an error carries is domain data: its message, the request field it is about (``param``) and,
for those that know one, how many seconds until a retry may succeed (``retry_after``).
"""

from __future__ import annotations

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


class Unauthorized(RollbusError):
    """A missing or wrong api key or admin token."""


class SessionNotFound(RollbusError):
    """No such session."""


class ResponseNotFound(RollbusError):
    """A response id (the Responses API's ``previous_response_id``, ``GET .../responses/{id}``) that
    names no response the session stored: unknown, another session's, or not stored."""


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


class EngineTimeout(EngineError):
    """The engine did not answer in time."""


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
