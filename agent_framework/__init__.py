"""The verl side of rollbus: a rollout adapter verl loads unchanged, an edge pool, agent runners.

``actor_rollout_ref.rollout.agent.agent_loop_manager_class=agent_framework.AgentFrameworkRolloutAdapter``
(see :mod:`agent_framework.adapter`; configuration in :mod:`agent_framework.config`).
"""

from agent_framework.adapter import AgentFrameworkRolloutAdapter, BatchResult, SessionResult
from agent_framework.config import AgentFrameworkConfig, RunnerConfig, load_config
from agent_framework.session import SessionHandle
from schemas.errors import ConfigError, RolloutFailed

__all__ = [
    "AgentFrameworkConfig",
    "AgentFrameworkRolloutAdapter",
    "BatchResult",
    "ConfigError",
    "RolloutFailed",
    "RunnerConfig",
    "SessionHandle",
    "SessionResult",
    "load_config",
]
