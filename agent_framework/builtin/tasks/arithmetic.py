"""``arithmetic``: a word problem with an integer answer.

Data: ``answer`` (int, required), ``question`` (the prompt when the row brings none).
Reward 1.0 iff the final answer (``submit``'s, or the model's last text) parses to exactly
``answer``, else 0.0; extra info ``acc`` (the same). Parsing takes the answer's last
number: ``"42"``, ``"1,234"``, ``"-7"``, ``"The answer is 42."``, ``"42.0"`` parse;
``"42.5"`` does not (not an integer), nor does text without a number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import msgspec

from agent_framework.builtin.agents import Episode
from agent_framework.builtin.config import TaskSpec
from agent_framework.builtin.sandbox import Sandbox
from agent_framework.builtin.tasks.base import Score, Task, register_task, task_data

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class ArithmeticData(msgspec.Struct, frozen=True, kw_only=True):
    answer: int
    question: str = ""


def parse_integer(text: str | None) -> int | None:
    """The last number in ``text`` when it is an integer (thousands separators allowed), else None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    value = Decimal(found[-1].replace(",", ""))
    return int(value) if value == value.to_integral_value() else None


@register_task("arithmetic")
class Arithmetic(Task):
    default_tools = ("python", "submit")
    dataset = "arithmetic.jsonl"

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__(spec)
        self.data = task_data(spec, ArithmeticData)

    def prompt(self) -> str:
        return f"{self.data.question}\nCall submit with the answer as a plain integer."

    @classmethod
    def example(cls, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        prompt = f"{record['question']}\nCall submit with the answer as a plain integer."
        return prompt, {"task": "arithmetic", "answer": record["answer"]}

    async def score(self, sandbox: Sandbox, episode: Episode) -> Score:
        correct = parse_integer(episode.answer) == self.data.answer
        return Score(reward=float(correct), extra={"acc": float(correct)})
