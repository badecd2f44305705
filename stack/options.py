"""What ``rollbus up`` / ``edge`` / ``projector`` / ``materializer`` run with: :class:`StackOptions`, one
struct whose field defaults are the commands' defaults (their flags read them from here, so that no default
is written twice). Apart from :mod:`stack.runtime` so that the CLI reads them without importing the stack."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from edge.settings import LAG_INTERVAL_S, SEND_TIMEOUT_S, EdgeSettings
from materializer.options import MaterializerOptions
from schemas.log import COMPONENTS, LogConfig
from stack.nats_server import Fsync

if TYPE_CHECKING:  # (an annotation only: importing it loads the NATS client)
    from stack.provision import Retention

EDGE = EdgeSettings()  # the edge's defaults


class StackOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What a stack runs with. The edge's own settings are fields of the same names as
    :class:`~edge.settings.EdgeSettings`' and default to its (``EDGE``); :meth:`edge_settings` hands them over
    by name. ``rollbus up`` / ``edge`` / ``projector`` / ``materializer`` take their flags' defaults from these
    fields (``rollbus.cli``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("rollbus-data")
    nats_url: str | None = None  # None: start an embedded nats-server in <data_dir>/nats
    engine: str = "local"
    engine_urls: tuple[str, ...] = ()
    model: str | None = None  # the local engine's model: None (tiny-qwen2), "smollm2", or a path
    engine_timeout: float = 300.0  # HTTP engines: seconds to wait for the reply, or its next byte or streamed event
    engine_deadline: float = 1800.0  # HTTP engines: seconds one engine call may take, its whole reply
    health_interval: float = 5.0  # HTTP engines: seconds between /health probes of each server
    tokenizer: str = EDGE.tokenizer
    tool_format: str = EDGE.tool_format
    reasoning_format: str = EDGE.reasoning_format
    admin_token: str = EDGE.admin_token
    max_trajectory_length: int = EDGE.max_trajectory_length
    components: tuple[str, ...] = COMPONENTS
    log: LogConfig = LogConfig()
    edge_id: str = ""  # "": <hostname>:<port>, so an edge restarted on its port takes its sessions back at once
    lease_ttl_s: float = EDGE.lease_ttl_s
    idle_timeout_s: float = EDGE.idle_timeout_s
    disconnect_grace_s: float = EDGE.disconnect_grace_s
    body_min_rate: float = EDGE.body_min_rate  # bytes a second a request body must arrive at
    send_timeout: float = SEND_TIMEOUT_S  # seconds a client may take none of its reply before it is disconnected
    rollback_rewritten_turns: bool = EDGE.rollback_rewritten_turns
    processor: str = EDGE.processor  # images: "" refuses them; builtin:qwen2.5-vl or a local HF processor dir
    max_images: int = EDGE.max_images
    max_image_bytes: int = EDGE.max_image_bytes
    max_image_pixels: int = EDGE.max_image_pixels
    max_image_side: int = EDGE.max_image_side
    image_fetch_allow: tuple[str, ...] = EDGE.image_fetch_allow
    image_fetch_timeout_s: float = EDGE.image_fetch_timeout_s
    materializer: MaterializerOptions = MaterializerOptions()
    metrics_host: str = "127.0.0.1"  # a projector or materializer run alone: where it serves /metrics
    metrics_port: int | None = None  # None: no /metrics (the edge serves its own); 0: any free port
    lag_interval: float = LAG_INTERVAL_S  # seconds between samples of the consumers' lag
    retention: Retention | None = None  # the log's limits, applied at start; None: a new log's defaults, kept
    replicas: int | None = None  # cluster nodes per stream and bucket, applied at start; None: 1 or as they are
    fsync: Fsync = "default"  # the embedded nats-server's sync_interval ("always": every write, before its ack)

    def edge_settings(self, *, public_url: str, edge_id: str) -> EdgeSettings:
        """The edge's settings: every field the two structs share, by name, and where agents reach the edge
        (``public_url``) and its id (``edge_id``, this one's when set)."""
        shared = {name: getattr(self, name) for name in EDGE_FIELDS}
        return EdgeSettings(**{**shared, "public_url": public_url, "edge_id": self.edge_id or edge_id})


EDGE_FIELDS = tuple(name for name in StackOptions.__struct_fields__ if name in EdgeSettings.__struct_fields__)
