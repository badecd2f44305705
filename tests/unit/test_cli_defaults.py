"""Each flag of ``rollbus up`` / ``edge`` / ``projector`` / ``materializer`` defaults to its settings field's
default: one source (StackOptions, whose edge fields default to EdgeSettings'; MaterializerOptions and what it
holds; Retention), and every flag is accounted for here, so a new one is too."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from edge.settings import EdgeSettings
from materializer.options import MaterializerOptions
from materializer.padding import Padding
from rollbus.cli import MATERIALIZER_METRICS_PORT, PROJECTOR_METRICS_PORT, build_parser
from schemas.records import RecordOptions
from stack.options import EDGE_FIELDS, StackOptions
from stack.provision import Retention
from stack.runtime import model_defaults

STACK, MATERIALIZER, EDGE = StackOptions(), MaterializerOptions(), EdgeSettings()
PADDING = Padding(prompt_length=1, response_length=1)

# flag (its dest) -> the default it must have, read from the settings struct
FIELDS: dict[str, Callable[[], object]] = {
    **{dest: (lambda name=name: getattr(STACK, name)) for dest, name in [
        ("data_dir", "data_dir"), ("nats", "nats_url"), ("replicas", "replicas"), ("host", "host"), ("port", "port"),
        ("engine", "engine"), ("model", "model"), ("engine_timeout", "engine_timeout"),
        ("engine_deadline", "engine_deadline"), ("health_interval", "health_interval"),
        ("reasoning_format", "reasoning_format"), ("max_trajectory_length", "max_trajectory_length"),
        ("admin_token", "admin_token"), ("edge_id", "edge_id"), ("lease_ttl", "lease_ttl_s"),
        ("idle_timeout", "idle_timeout_s"), ("send_timeout", "send_timeout"), ("body_min_rate", "body_min_rate"),
        ("metrics_host", "metrics_host"), ("fsync", "fsync"),
        ("image_max_count", "max_images"), ("image_max_bytes", "max_image_bytes"),
        ("image_max_pixels", "max_image_pixels"), ("image_max_side", "max_image_side"),
        ("image_fetch_timeout", "image_fetch_timeout_s")]},
    "engine_url": lambda: list(STACK.engine_urls),
    "image_fetch_allow": lambda: list(STACK.image_fetch_allow),
    **{dest: (lambda name=name: getattr(MATERIALIZER, name)) for dest, name in [
        ("transfer_queue", "transfer_queue"), ("ray_address", "ray_address"), ("tq_partition", "tq_partition"),
        ("rollout_n", "rollout_n"), ("batch_size", "max_batch"), ("batch_delay", "max_delay"),
        ("ack_wait", "ack_wait"), ("reward_scorer", "reward_scorer")]},
    "mask_unfinished_episode": lambda: RecordOptions().mask_unfinished_episode,
    "trajectory_selection": lambda: RecordOptions().trajectory_selection,
    "pad_token_id": lambda: PADDING.pad_token_id,
    "overflow": lambda: PADDING.overflow,
    "retention_max_age": lambda: Retention().max_age_s,
    "retention_max_bytes": lambda: Retention().max_bytes,
}
# flags whose default is not one field's, and why
NOT_A_FIELD = {
    "tokenizer": "None: the local model's, else StackOptions' (stack.runtime.model_defaults, checked below)",
    "tool_format": "None: the local model's, else StackOptions' (checked below)",
    "processor": "None: the local model's, else StackOptions' none (stack.runtime.model_processor, checked below)",
    "prompt_length": "None with response_length: no padding (MaterializerOptions.padding None)",
    "response_length": "None with prompt_length: no padding",
    "log_level": "Python logging's level, no stack setting",
    "metrics_port": "each consumer's own port (checked below); StackOptions' None is the edge's (it serves its own)",
}


def _actions(command: str) -> list[argparse.Action]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["up", "edge", "projector", "materializer"])
def test_each_flags_default_is_its_settings_fields_default(command, monkeypatch):
    monkeypatch.delenv("ROLLBUS_ADMIN_TOKEN", raising=False)
    for action in _actions(command):
        assert action.dest in FIELDS or action.dest in NOT_A_FIELD, f"{action.option_strings}: no settings field"
        if action.dest in FIELDS:
            assert action.default == FIELDS[action.dest](), action.option_strings
            if action.default not in (None, "", False, []) and action.help and "[" in action.help:
                assert action.help.endswith("]"), action.option_strings  # the default, shown in its help


def test_the_derived_defaults_agree_with_the_structs():
    assert model_defaults(STACK.engine, None, None, None) == (STACK.tokenizer, STACK.tool_format)
    assert model_defaults("sglang", None, None, None) == (EDGE.tokenizer, EDGE.tool_format)
    for command, port in (("projector", PROJECTOR_METRICS_PORT), ("materializer", MATERIALIZER_METRICS_PORT)):
        assert next(a for a in _actions(command) if a.dest == "metrics_port").default == port


def test_the_stacks_edge_settings_default_to_the_edges_own():
    shared = [name for name in EDGE_FIELDS if name != "edge_id"]  # the stack's "" is <hostname>:<port>
    assert len(shared) >= 17
    for name in shared:
        assert getattr(STACK, name) == getattr(EDGE, name), name


def test_help_shows_the_structs_defaults():
    shown = {a.dest: a.help for a in _actions("up")}
    assert shown["port"].endswith(f"[{STACK.port}]") and shown["engine_deadline"].endswith("[1800]")
    assert shown["body_min_rate"].endswith("[64KiB]") and shown["batch_size"].endswith(f"[{MATERIALIZER.max_batch}]")


def test_the_processor_is_the_local_models_unless_given():
    from stack.runtime import model_processor

    assert model_processor(STACK.engine, STACK.model, None) == STACK.processor == ""
    assert model_processor("local", "tiny-qwen2-vl", None) == "builtin:qwen2.5-vl"
    assert model_processor("sglang", None, None) == "" and model_processor("sglang", None, "/p") == "/p"


def test_the_images_line_names_the_processor_the_limits_and_the_hosts():
    from rollbus.cli import image_summary

    assert image_summary(StackOptions(processor="builtin:qwen2.5-vl")) == (
        "builtin:qwen2.5-vl (up to 16 a request, 10MiB and 16777216 pixels each; URLs fetched from: none (data URLs "
        "and base64 only))")
    assert image_summary(StackOptions(processor="/p", image_fetch_allow=("a.example", "b.example"))).endswith(
        "URLs fetched from: a.example, b.example)")
