"""What the materializer runs with: one struct, its defaults the ones ``rollbus up`` and ``rollbus
materializer`` show (their flags take their defaults from it). Apart from the service so that the CLI
reads them without importing Parquet and the log consumer."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.metadata import RecordOptions


class Padding(msgspec.Struct, frozen=True, kw_only=True):
    """Parquet rows padded to fixed lengths (:mod:`materializer.padding`)."""

    prompt_length: int
    response_length: int
    pad_token_id: int = 0
    overflow: Literal["truncate", "error"] = "truncate"

    def __post_init__(self) -> None:
        if self.prompt_length < 1 or self.response_length < 1:
            raise ValueError("padded lengths must be positive")


class MaterializerOptions(msgspec.Struct, frozen=True, kw_only=True):
    records: RecordOptions = RecordOptions()
    rollout_n: int = 1  # sessions per prompt when a session's metadata has no "rollout_n"
    padding: Padding | None = None  # Parquet rows padded to fixed lengths
    transfer_queue: bool = False
    ray_address: str | None = None  # join this Ray cluster's TransferQueue; None: host one
    tq_partition: str = "train"  # for the prompts whose sessions name none (metadata "tq_partition")
    tq_storage_units: int = 2
    reward_scorer: str | None = None  # module:attr
    # TransferQueue costs ~20 ms a call whatever its size: a burst of ended sessions (the end of a
    # rollout step) goes out in few large puts; a quiet edge's batch leaves after max_delay.
    max_batch: int = 1024
    max_delay: float = 0.5
    ack_wait: float = 30.0
    retry_delay: float = 0.5  # the first backoff after a batch that failed whole and transiently
    max_retry_delay: float = 30.0
    durable: str = "rollbus-materializer"
