"""The exception tree. The domain raises these; only the edge maps them to HTTP.

::

    RollbusError
    ├── MalformedRequest          400  the request does not decode or makes no sense
    │   ├── ContextTooLong        400  the prompt alone exceeds the trajectory length
    │   └── IdempotencyKeyReused  400  an Idempotency-Key repeated with a different body
    ├── Unauthorized              401  missing or wrong api key / admin token
    ├── SessionNotFound           404
    ├── SessionClosed             409  finalized or aborted
    ├── Conflict                  409  e.g. a reward after materialization
    │   ├── OwnershipLost         409  another writer appended to this session
    │   └── SessionOwned          409  another edge holds the session's lease (Retry-After)
    ├── PayloadTooLarge           413
    ├── CapacityExceeded          429  too many open sessions or requests
    ├── EngineError               502  the engine answered nonsense or failed
    │   ├── EngineRefused         400  the engine refused the input (its HTTP 400, e.g. too long)
    │   ├── EngineUnavailable     503  refused, unhealthy
    │   └── EngineTimeout         504
    ├── LogUnavailable            503  JetStream did not acknowledge
    ├── SinkUnavailable           503  a record sink (TransferQueue) did not take a write
    └── FoldError                      an event that does not fit the state (a bug or a corrupt log)
        └── OutOfOrderEvent            an event whose sequence is not the next one
"""

from __future__ import annotations


class RollbusError(Exception):
    """Base of every rollbus error."""

    status: int = 500
    code: str = "internal_error"
    retry_after: float | None = None  # seconds; answered as a Retry-After header when set

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MalformedRequest(RollbusError):
    status = 400
    code = "invalid_request_error"


class ContextTooLong(MalformedRequest):
    code = "context_length_exceeded"


class IdempotencyKeyReused(MalformedRequest):
    code = "idempotency_key_reused"


class Unauthorized(RollbusError):
    status = 401
    code = "authentication_error"


class SessionNotFound(RollbusError):
    status = 404
    code = "not_found_error"


class SessionClosed(RollbusError):
    status = 409
    code = "session_closed"


class Conflict(RollbusError):
    status = 409
    code = "conflict"


class OwnershipLost(Conflict):
    code = "ownership_lost"


class SessionOwned(Conflict):
    """Another live edge holds the session's lease; it can be taken over once the lease lapses."""

    code = "session_owned_elsewhere"

    def __init__(self, message: str, *, retry_after: float, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.retry_after = max(0.0, retry_after)


class PayloadTooLarge(RollbusError):
    status = 413
    code = "request_too_large"


class CapacityExceeded(RollbusError):
    status = 429
    code = "rate_limit_error"


class EngineError(RollbusError):
    status = 502
    code = "engine_error"


class EngineRefused(EngineError):
    """The engine refused the request's input (SGLang or vLLM answered 400, e.g. a prompt longer than
    the model's context): the agent's request cannot succeed as it is, so it is answered 400 (not a
    5xx, which the SDKs would retry). ``message`` carries the engine's own words, bounded."""

    status = 400
    code = "invalid_request_error"


class EngineUnavailable(EngineError):
    status = 503
    code = "engine_unavailable"


class EngineTimeout(EngineError):
    status = 504
    code = "engine_timeout"


class LogUnavailable(RollbusError):
    status = 503
    code = "log_unavailable"


class SinkUnavailable(RollbusError):
    status = 503
    code = "sink_unavailable"


class FoldError(RollbusError):
    code = "fold_error"


class OutOfOrderEvent(FoldError):
    code = "out_of_order_event"
