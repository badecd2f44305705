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
    R.n, R.val_kwargs.{n,temperature,top_p,top_k,do_sample}, R.temperature, R.top_p, R.top_k,
    R.multi_turn.format (the tool parser), R.prompt_length, R.response_length, R.calculate_log_probs
    actor_rollout_ref.model.path      the tokenizer and chat template (a local Hugging Face directory)

Every problem is a :class:`ConfigError` whose message names the full key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from schemas.errors import ConfigError
from schemas.metadata import StatusRule, TrajectorySelection

CUSTOM_KEY = "actor_rollout_ref.rollout.custom.agent_framework"

DispatchMode = Literal["inline_async", "ray_task"]


class RunnerConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    runner_fqn: str
    runner_kwargs: dict[str, Any] = {}
    tool_config_path: str | None = None
    dispatch_mode: DispatchMode = "inline_async"
    max_concurrent_sessions: int = 0
    trajectory_selection: TrajectorySelection = "all"


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    n: int
    temperature: float
    top_p: float
    top_k: int
    do_sample: bool = True


class AgentFrameworkConfig(msgspec.Struct, frozen=True, kw_only=True):
    agent_runners: dict[str, RunnerConfig]
    default_agent: str
    tokenizer: str  # a local Hugging Face directory, or builtin:NAME (standalone use)
    tool_format: str = "hermes"
    train: Sampling
    val: Sampling
    prompt_length: int = 512
    response_length: int = 512
    calculate_log_probs: bool = True
    gateway_count: int = 1
    num_workers: int = 0
    log_dir: str | None = None
    use_reward_loop_worker: bool = False
    mask_unfinished_episode: bool = False
    enable_last_assistant_rollback: bool = True
    prompt_status_rule: StatusRule = "any_success"
    data_dir: str = "rollbus-data"
    nats_url: str | None = None
    actor_num_cpus: float = 0.0
    session_timeout: float = 3600.0
    log_namespace: str | None = None
    engine: str = "local"
    engine_urls: tuple[str, ...] = ()
    engine_model: str | None = None

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


def _typed(value: Any, kind: type | tuple[type, ...], key: str, *, default: Any = None) -> Any:
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ConfigError(f"{key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int):
        return float(value)
    if not isinstance(value, kinds):
        raise ConfigError(f"{key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _positive(value: int, key: str, *, allow_zero: bool = False) -> int:
    if value < (0 if allow_zero else 1):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '>= 1'}, got {value}")
    return value


def _choice(value: Any, choices: tuple[str, ...], key: str, default: str) -> str:
    value = default if value is None else value
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _runner(name: str, raw: Any) -> RunnerConfig:
    key = f"{CUSTOM_KEY}.agent_runners.{name}"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key} must be a mapping with runner_fqn, got {raw!r}")
    unknown = set(raw) - set(RunnerConfig.__struct_fields__) - {"name"}
    if unknown:
        raise ConfigError(f"{key}: unknown keys {', '.join(sorted(unknown))}")
    fqn = _typed(raw.get("runner_fqn"), str, f"{key}.runner_fqn")
    if not fqn or "." not in fqn:
        raise ConfigError(f"{key}.runner_fqn must name a class or function as module.attr, got {fqn!r}")
    kwargs = _typed(raw.get("runner_kwargs"), dict, f"{key}.runner_kwargs", default={})
    return RunnerConfig(
        name=name, runner_fqn=fqn, runner_kwargs={str(k): v for k, v in kwargs.items()},
        tool_config_path=_typed(raw.get("tool_config_path"), str, f"{key}.tool_config_path"),
        dispatch_mode=_choice(raw.get("dispatch_mode"), ("inline_async", "ray_task"), f"{key}.dispatch_mode",
                              "inline_async"),  # type: ignore[arg-type]
        max_concurrent_sessions=_positive(_typed(raw.get("max_concurrent_sessions"), int,
                                                 f"{key}.max_concurrent_sessions", default=0),
                                          f"{key}.max_concurrent_sessions", allow_zero=True),
        trajectory_selection=_choice(raw.get("trajectory_selection"), ("all", "longest"),
                                     f"{key}.trajectory_selection", "all"),  # type: ignore[arg-type]
    )


def _sampling(node: Any, prefix: str, *, n_default: int = 1) -> Sampling:
    n = _positive(_typed(_get(node, "n"), int, f"{prefix}.n", default=n_default), f"{prefix}.n")
    temperature = _typed(_get(node, "temperature"), float, f"{prefix}.temperature", default=1.0)
    top_p = _typed(_get(node, "top_p"), float, f"{prefix}.top_p", default=1.0)
    top_k = _typed(_get(node, "top_k"), int, f"{prefix}.top_k", default=-1)
    if temperature < 0:
        raise ConfigError(f"{prefix}.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{prefix}.top_p must be in (0, 1], got {top_p}")
    if top_k < -1 or top_k == 0:
        raise ConfigError(f"{prefix}.top_k must be -1 (off) or >= 1, got {top_k}")
    do_sample = _typed(_get(node, "do_sample"), bool, f"{prefix}.do_sample", default=True)
    return Sampling(n=n, temperature=temperature, top_p=top_p, top_k=top_k, do_sample=do_sample)


def _tokenizer(config: Any) -> str:
    path = _get(config, "actor_rollout_ref.model.tokenizer_path") or _get(config, "actor_rollout_ref.model.path")
    if not isinstance(path, str) or not path:
        raise ConfigError("actor_rollout_ref.model.path must name the model's local Hugging Face directory")
    if path.startswith("builtin:"):
        return path
    directory = Path(path).expanduser()
    if not (directory / "tokenizer.json").is_file() or not (directory / "tokenizer_config.json").is_file():
        raise ConfigError(f"actor_rollout_ref.model.path {path!r} is not a local directory with tokenizer.json "
                          "and tokenizer_config.json (nothing is downloaded: copy the model there first)")
    return str(directory)


def _default_agent(raw: Any, runners: dict[str, RunnerConfig]) -> str:
    name = _typed(raw, str, f"{CUSTOM_KEY}.default_agent")
    if name is None:
        if len(runners) == 1:
            return next(iter(runners))
        if "default" in runners:
            return "default"
        raise ConfigError(f"{CUSTOM_KEY}.default_agent must name one of {', '.join(sorted(runners))} "
                          "(several runners and none named 'default')")
    if name not in runners:
        raise ConfigError(f"{CUSTOM_KEY}.default_agent {name!r} is not in {CUSTOM_KEY}.agent_runners")
    return name


_KNOWN = {"gateway_count", "num_workers", "agent_runners", "default_agent", "log_dir", "use_reward_loop_worker",
          "mask_unfinished_episode", "enable_last_assistant_rollback", "prompt_status_rule", "data_dir", "nats_url",
          "actor_num_cpus", "session_timeout", "log_namespace", "engine", "engine_urls", "engine_model"}


def load_config(config: Any) -> AgentFrameworkConfig:
    """The adapter's configuration from verl's whole (resolved) config; raises :class:`ConfigError`."""
    config = _plain(config)
    if not isinstance(config, Mapping):
        raise ConfigError(f"the config must be a mapping (verl's DictConfig), got {type(config).__name__}")
    rollout = _get(config, "actor_rollout_ref.rollout")
    if not isinstance(rollout, Mapping):
        raise ConfigError("actor_rollout_ref.rollout is missing")
    custom = _get(rollout, "custom.agent_framework")
    if not isinstance(custom, Mapping):
        raise ConfigError(f"{CUSTOM_KEY} is missing: it must hold at least agent_runners")
    unknown = set(custom) - _KNOWN
    if unknown:
        raise ConfigError(f"{CUSTOM_KEY}: unknown keys {', '.join(sorted(unknown))}")
    raw_runners = custom.get("agent_runners")
    if not isinstance(raw_runners, Mapping) or not raw_runners:
        raise ConfigError(f"{CUSTOM_KEY}.agent_runners must map at least one runner name to its settings")
    runners = {str(name): _runner(str(name), raw) for name, raw in raw_runners.items()}
    p = "actor_rollout_ref.rollout"
    enable_tq = _get(config, "transfer_queue.enable")
    if enable_tq is False:
        raise ConfigError("transfer_queue.enable is false: the adapter delivers records only through TransferQueue")

    def flag(name: str, default: bool) -> bool:
        return bool(_typed(custom.get(name), bool, f"{CUSTOM_KEY}.{name}", default=default))

    return AgentFrameworkConfig(
        agent_runners=runners,
        default_agent=_default_agent(custom.get("default_agent"), runners),
        tokenizer=_tokenizer(config),
        tool_format=_typed(_get(rollout, "multi_turn.format"), str, f"{p}.multi_turn.format", default="hermes"),
        train=_sampling(rollout, p),
        val=_sampling(_get(rollout, "val_kwargs") or {}, f"{p}.val_kwargs"),
        prompt_length=_positive(_typed(rollout.get("prompt_length"), int, f"{p}.prompt_length", default=512),
                                f"{p}.prompt_length"),
        response_length=_positive(_typed(rollout.get("response_length"), int, f"{p}.response_length",
                                         default=512), f"{p}.response_length"),
        calculate_log_probs=bool(_typed(rollout.get("calculate_log_probs"), bool, f"{p}.calculate_log_probs",
                                        default=True)),
        gateway_count=_positive(_typed(custom.get("gateway_count"), int, f"{CUSTOM_KEY}.gateway_count", default=1),
                                f"{CUSTOM_KEY}.gateway_count"),
        num_workers=_positive(_typed(custom.get("num_workers"), int, f"{CUSTOM_KEY}.num_workers", default=0),
                              f"{CUSTOM_KEY}.num_workers", allow_zero=True),
        log_dir=_typed(custom.get("log_dir"), str, f"{CUSTOM_KEY}.log_dir"),
        use_reward_loop_worker=flag("use_reward_loop_worker", False),
        mask_unfinished_episode=flag("mask_unfinished_episode", False),
        enable_last_assistant_rollback=flag("enable_last_assistant_rollback", True),
        prompt_status_rule=_choice(custom.get("prompt_status_rule"), ("any_success", "all_success"),
                                   f"{CUSTOM_KEY}.prompt_status_rule", "any_success"),  # type: ignore[arg-type]
        data_dir=_typed(custom.get("data_dir"), str, f"{CUSTOM_KEY}.data_dir", default="rollbus-data"),
        nats_url=_typed(custom.get("nats_url"), str, f"{CUSTOM_KEY}.nats_url"),
        actor_num_cpus=_typed(custom.get("actor_num_cpus"), (int, float), f"{CUSTOM_KEY}.actor_num_cpus", default=0.0),
        session_timeout=_positive_float(custom.get("session_timeout"), f"{CUSTOM_KEY}.session_timeout", 3600.0),
        log_namespace=_namespace(custom.get("log_namespace")),
        engine=_choice(custom.get("engine"), ("local", "sglang", "vllm"), f"{CUSTOM_KEY}.engine", "local"),
        engine_urls=tuple(_typed(u, str, f"{CUSTOM_KEY}.engine_urls[]")
                          for u in _typed(custom.get("engine_urls"), list, f"{CUSTOM_KEY}.engine_urls", default=[])),
        engine_model=_typed(custom.get("engine_model"), str, f"{CUSTOM_KEY}.engine_model"),
    )


def _positive_float(value: Any, key: str, default: float) -> float:
    number = _typed(value, (int, float), key, default=default)
    if not number > 0:
        raise ConfigError(f"{key} must be > 0 seconds, got {number}")
    return float(number)


def _namespace(value: Any) -> str | None:
    key = f"{CUSTOM_KEY}.log_namespace"
    name = _typed(value, str, key)
    if name is not None:
        from schemas.log import LogConfig

        try:
            LogConfig.namespaced(name)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from exc
    return name
