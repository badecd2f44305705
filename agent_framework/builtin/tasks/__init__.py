"""The built-in tasks; importing this package registers them."""

from agent_framework.builtin.tasks import arithmetic, python_function
from agent_framework.builtin.tasks.base import Score, Task

__all__ = ["Score", "Task", "arithmetic", "python_function"]
