"""The adapter's configuration, read from verl's resolved config and checked up front.

Where verl puts it (``actor_rollout_ref.rollout`` is ``R``)::

    R.custom.agent_framework:
      gateway_count: 1            # edges, each a Ray actor serving HTTP on its own port
      num_workers: 0              # runner worker actors (0: runners run on the adapter's own loop)
      agent_runners:              # at least one; a sample's agent_name picks one (else default_agent)
        <name>:
          runner_fqn: pkg.module.ClassOrFunction
          runner_kwargs: {}       # a class is built with them; a function gets them as keywords
          tool_config_path: null  # passed to the runner as tool_config_path
          dispatch_mode: inline_async   # or ray_task: one Ray task per session, never retried
          max_concurrent_sessions: 0    # 0: unlimited
          trajectory_selection: all     # or longest
      default_agent: null         # null: the only runner, or the one named "default"
      log_dir: null               # per session: trajectory + events as JSON lines, under step_<global_steps>/
      use_reward_loop_worker: false
      mask_unfinished_episode: false
      enable_last_assistant_rollback: true
      prompt_status_rule: any_success   # or all_success (verl's own: failure when any session failed)
      data_dir: rollbus-data      # embedded NATS store and Parquet records
      nats_url: null              # null: an embedded nats-server in data_dir
      actor_num_cpus: 0           # Ray CPUs each edge, runner worker and ray_task reserves
      session_timeout: 3600       # seconds a runner may take before its session is aborted
      log_namespace: null         # a log of its own on a shared nats-server (stream, subjects, buckets)
      engine: local               # without verl's llm_client (rollbus rollout): local, sglang or vllm
      engine_urls: []             # sglang / vllm servers
      engine_model: null          # the local engine's model (tiny-qwen2, smollm2, a path)
      processor: null             # the edges' image processor (null: the model directory's, if it has one)
    R.n, R.val_kwargs.{n,temperature,top_p,top_k,do_sample}, R.temperature, R.top_p, R.top_k,
    R.multi_turn.format (the tool parser), R.prompt_length, R.response_length, R.calculate_log_probs
    actor_rollout_ref.model.path      the tokenizer and chat template (a local Hugging Face directory), and the
                                      image processor when it holds a preprocessor_config.json

Each section is a typed struct below, its constraints in its types, read by
:func:`schemas.settings.read`: every problem at once, each named by its full dotted key, in
one :class:`ConfigError` (one line, the problems separated by ``; ``). Unknown keys: the
``agent_framework`` section is rollbus's own, so a key that is not one of its fields is
refused. verl's sections that rollbus reads keys of (``actor_rollout_ref.model``,
``actor_rollout_ref.rollout``, its ``val_kwargs`` and ``multi_turn``) hold many keys
rollbus does not read; a key there is refused when it is not a field of verl's own
dataclass for the section (``RolloutConfig``, ...), so ``rollout.nn: 2`` is named rather
than running with n = 1. Without verl installed those sections' other keys are not checked
(only the keys rollbus reads are). The rest of verl's config is verl's to check.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from schemas.errors import ConfigError
from schemas.metadata import StatusRule, TrajectorySelection
from schemas.settings import read

CUSTOM_KEY = "actor_rollout_ref.rollout.custom.agent_framework"

log = logging.getLogger(__name__)

DispatchMode = Literal["inline_async", "ray_task"]
Engine = Literal["local", "sglang", "vllm"]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1)]  # -1 (off) or >= 1: 0 is refused after conversion
QualifiedName = Annotated[str, Meta(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$",
                                    description="a class or function named as module.attr")]


# ---------------------------------------------------------------------- rollbus's own section


class RunnerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``agent_framework.agent_runners.<name>``."""

    runner_fqn: QualifiedName
    runner_kwargs: dict[str, Any] = {}
    tool_config_path: str | None = None
    dispatch_mode: DispatchMode = "inline_async"
    max_concurrent_sessions: NonNegativeInt = 0  # 0: unlimited
    trajectory_selection: TrajectorySelection = "all"


class RunnerConfig(RunnerSettings, frozen=True, kw_only=True):
    """A runner's settings and its name (its key under ``agent_runners``)."""

    name: str


class AgentFrameworkSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``actor_rollout_ref.rollout.custom.agent_framework``: the adapter's own section."""

    agent_runners: Annotated[dict[str, RunnerSettings],
                             Meta(min_length=1, description="a mapping of at least one runner name to its settings")]
    default_agent: str | None = None  # None: the only runner, or the one named "default"
    gateway_count: PositiveInt = 1
    num_workers: NonNegativeInt = 0
    log_dir: str | None = None
    use_reward_loop_worker: bool = False
    mask_unfinished_episode: bool = False
    enable_last_assistant_rollback: bool = True
    prompt_status_rule: StatusRule = "any_success"
    data_dir: str = "rollbus-data"
    nats_url: str | None = None
    actor_num_cpus: Annotated[float, Meta(ge=0)] = 0.0
    session_timeout: Annotated[float, Meta(gt=0)] = 3600.0  # seconds
    log_namespace: str | None = None
    engine: Engine = "local"
    engine_urls: tuple[str, ...] = ()
    engine_model: str | None = None
    # the image processor of the edges (null: the model directory's own when it holds a preprocessor_config.json,
    # as a vision-language model's does; "": none, images refused)
    processor: str | None = None


# ---------------------------------------------------------------------- verl's keys that rollbus reads
# ``verl_config``: verl's dataclass for the section; a key that is none of its fields is unknown.


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """verl's sampling keys, of ``rollout`` (training) and of ``rollout.val_kwargs`` (validation)."""

    verl_config: ClassVar[str] = "verl.workers.config.rollout.SamplingConfig"

    n: PositiveInt = 1
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Probability = 1.0
    top_k: TopK = -1
    do_sample: bool = True


class MultiTurnKeys(msgspec.Struct, frozen=True, kw_only=True):
    verl_config: ClassVar[str] = "verl.workers.config.rollout.MultiTurnConfig"

    format: str = "hermes"  # the tool parser


class CustomKeys(msgspec.Struct, frozen=True, kw_only=True):
    """``rollout.custom``: verl's free-form map; other frameworks' keys may sit beside ours."""

    agent_framework: AgentFrameworkSettings


class RolloutKeys(Sampling, frozen=True, kw_only=True):
    verl_config: ClassVar[str] = "verl.workers.config.rollout.RolloutConfig"

    prompt_length: PositiveInt = 512
    response_length: PositiveInt = 512
    calculate_log_probs: bool = True  # verl's default is false; rollbus records log probs unless told not to
    val_kwargs: Sampling = msgspec.field(default_factory=Sampling)
    multi_turn: MultiTurnKeys = msgspec.field(default_factory=MultiTurnKeys)
    custom: CustomKeys


class ModelKeys(msgspec.Struct, frozen=True, kw_only=True):
    verl_config: ClassVar[str] = "verl.workers.config.model.HFModelConfig"

    path: str | None = None
    tokenizer_path: str | None = None  # verl's: the tokenizer's own directory, else path's


class ActorRolloutRefKeys(msgspec.Struct, frozen=True, kw_only=True):
    model: ModelKeys = msgspec.field(default_factory=ModelKeys)
    rollout: RolloutKeys


class TransferQueueKeys(msgspec.Struct, frozen=True, kw_only=True):
    enable: bool | None = None


class VerlKeys(msgspec.Struct, frozen=True, kw_only=True):
    """The keys of verl's whole config that rollbus reads."""

    actor_rollout_ref: ActorRolloutRefKeys
    transfer_queue: TransferQueueKeys = msgspec.field(default_factory=TransferQueueKeys)


# ---------------------------------------------------------------------- what the adapter runs with


class AgentFrameworkConfig(AgentFrameworkSettings, frozen=True, kw_only=True):
    """The ``agent_framework`` section, its runners named and its default resolved, and verl's keys it reads."""

    agent_runners: dict[str, RunnerConfig]
    default_agent: str
    tokenizer: str  # a local Hugging Face directory, or builtin:NAME (standalone use)
    tool_format: str = "hermes"
    train: Sampling
    val: Sampling
    prompt_length: int = 512
    response_length: int = 512
    calculate_log_probs: bool = True

    @property
    def max_trajectory_length(self) -> int:
        return self.prompt_length + self.response_length

    def runner_for(self, agent_name: str | None) -> RunnerConfig:
        name = agent_name or self.default_agent
        runner = self.agent_runners.get(name)
        if runner is None:
            raise ConfigError(f"agent_name {name!r} names no runner in {CUSTOM_KEY}.agent_runners "
                              f"(known: {', '.join(sorted(self.agent_runners))})")
        return runner


def load_config(config: Any) -> AgentFrameworkConfig:
    """The adapter's configuration from verl's whole (resolved) config; raises :class:`ConfigError`."""
    config = _plain(config)
    if not isinstance(config, Mapping):
        raise ConfigError(f"the config must be a mapping (verl's DictConfig), got {type(config).__name__}")
    rollout = _get(config, "actor_rollout_ref.rollout")
    if not isinstance(rollout, Mapping):
        raise ConfigError("actor_rollout_ref.rollout is missing")
    if not isinstance(_get(rollout, "custom.agent_framework"), Mapping):
        raise ConfigError(f"{CUSTOM_KEY} is missing: it must hold at least agent_runners")
    keys, problems = read(config, VerlKeys, extra_keys=_verl_fields)
    if keys is None:
        raise ConfigError("; ".join(problems))
    r = keys.actor_rollout_ref.rollout
    section = r.custom.agent_framework
    problems = [*_checks(keys), *_namespace(section.log_namespace)]
    default_agent = _default_agent(section, problems)
    tokenizer = _tokenizer(keys.actor_rollout_ref.model, problems)
    if problems:
        raise ConfigError("; ".join(problems))
    return AgentFrameworkConfig(**{
        **msgspec.structs.asdict(section),
        "agent_runners": {name: RunnerConfig(name=name, **msgspec.structs.asdict(runner))
                          for name, runner in section.agent_runners.items()},
        "default_agent": default_agent, "tokenizer": tokenizer, "tool_format": r.multi_turn.format,
        "train": Sampling(**{name: getattr(r, name) for name in Sampling.__struct_fields__}), "val": r.val_kwargs,
        "prompt_length": r.prompt_length, "response_length": r.response_length,
        "calculate_log_probs": r.calculate_log_probs,
        "processor": _processor(section.processor, keys.actor_rollout_ref.model),
    })


# ---------------------------------------------------------------------- checks beyond one value's type


def _checks(keys: VerlKeys) -> list[str]:
    problems = []
    if keys.transfer_queue.enable is False:
        problems.append("transfer_queue.enable is false: the adapter delivers records only through TransferQueue")
    rollout = keys.actor_rollout_ref.rollout
    for prefix, sampling in (("actor_rollout_ref.rollout", rollout),
                             ("actor_rollout_ref.rollout.val_kwargs", rollout.val_kwargs)):
        if sampling.top_k == 0:
            problems.append(f"{prefix}.top_k must be -1 (off) or >= 1, got 0")
    return problems


def _default_agent(section: AgentFrameworkSettings, problems: list[str]) -> str:
    runners, name = section.agent_runners, section.default_agent
    if name is None:
        if len(runners) == 1:
            return next(iter(runners))
        if "default" in runners:
            return "default"
        problems.append(f"{CUSTOM_KEY}.default_agent must name one of {', '.join(sorted(runners))} "
                        "(several runners and none named 'default')")
    elif name not in runners:
        problems.append(f"{CUSTOM_KEY}.default_agent {name!r} is not in {CUSTOM_KEY}.agent_runners")
    return name or ""


def _tokenizer(model: ModelKeys, problems: list[str]) -> str:
    path = model.tokenizer_path or model.path
    if not path:
        problems.append("actor_rollout_ref.model.path must name the model's local Hugging Face directory")
        return ""
    if path.startswith("builtin:"):
        return path
    directory = Path(path).expanduser()
    if not (directory / "tokenizer.json").is_file() or not (directory / "tokenizer_config.json").is_file():
        problems.append(f"actor_rollout_ref.model.path {path!r} is not a local directory with tokenizer.json "
                        "and tokenizer_config.json (nothing is downloaded: copy the model there first)")
    return str(directory)


def _processor(given: str | None, model: ModelKeys) -> str:
    """The edges' image processor: the one given, else the model directory when it holds a processor (a
    vision-language model: verl builds its processor from there too), else none."""
    if given is not None:
        return given
    path = model.path
    if not path or path.startswith("builtin:"):
        return ""
    directory = Path(path).expanduser()
    return str(directory) if (directory / "preprocessor_config.json").is_file() else ""


def _namespace(name: str | None) -> list[str]:
    if name is None:
        return []
    from schemas.log import LogConfig

    try:
        LogConfig.namespaced(name)
    except ValueError as exc:
        return [f"{CUSTOM_KEY}.log_namespace: {exc}"]
    return []


# ---------------------------------------------------------------------- verl's config as plain data


def _verl_fields(section: type[msgspec.Struct]) -> Collection[str] | None:
    """The keys a verl section may hold beside those rollbus reads: its dataclass's fields
    (``None``, any key, where the section has none or verl is not installed)."""
    name: str | None = getattr(section, "verl_config", None)
    return None if name is None else _dataclass_fields(name)


@functools.cache
def _dataclass_fields(qualified_name: str) -> frozenset[str] | None:
    if importlib.util.find_spec("verl") is None:
        return None
    module, _, name = qualified_name.rpartition(".")
    try:  # imported only when a section holds a key rollbus does not read (verl imports torch: seconds)
        return frozenset(field.name for field in dataclasses.fields(getattr(importlib.import_module(module), name)))
    except (ImportError, AttributeError, TypeError) as exc:  # another verl: its keys unchecked, not refused
        log.warning("cannot check keys against verl's %s (%s): keys rollbus does not read are not checked",
                    qualified_name, exc)
        return None


def _plain(value: Any) -> Any:
    """An OmegaConf node (or anything mapping-like) as plain Python containers."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # standalone use without omegaconf: plain dicts already
        return value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _get(node: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
