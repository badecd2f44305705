"""``python_function``: write a small Python function; hidden unit tests decide.

Data: ``function`` (its name), ``tests`` (assert statements, a list, or one string run as
a single test), ``signature`` and ``description`` (for the prompt), ``file`` (where the
agent saves it, ``solution.py``). The tests are not shown to the agent.

Scoring runs in the sandbox, after the agent stopped: when the final answer itself holds
``def <function>(`` (code submitted directly, Markdown fences allowed) it is written to
``file`` first; otherwise ``file`` is graded as the agent left it. A grader process
(``python -I``) loads ``file`` and runs each test in a fresh namespace over the module's
names. **Reward 1.0 iff every test passes, else 0.0**; extra info ``acc`` (the same) and
``pass_rate`` (the fraction passed). A grader killed at its limits, or a module that does
not load, passes nothing.

The grader prints its result behind a nonce it reads from stdin before the solution is
imported, so a solution that prints a fake result does not count; code that inspects the
grader's own frames could still cheat (it runs in the same interpreter).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from agent_framework.builtin.agents import Episode
from agent_framework.builtin.config import TaskSpec
from agent_framework.builtin.sandbox import Sandbox
from agent_framework.builtin.tasks.base import Score, Task, register_task, task_data

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)
GRADER = """\
import importlib.util, json, sys


def main():
    nonce, tests, path = sys.stdin.readline().strip(), json.loads(sys.stdin.readline()), sys.argv[1]
    try:
        spec = importlib.util.spec_from_file_location("solution", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as exc:
        print(nonce + json.dumps({"passed": 0, "error": repr(exc)}), flush=True)
        return
    passed = 0
    for test in tests:
        try:
            exec(test, dict(vars(module)))
            passed += 1
        except BaseException:
            pass
    print(nonce + json.dumps({"passed": passed}), flush=True)


main()
"""


class PythonFunctionData(msgspec.Struct, frozen=True, kw_only=True):
    function: str
    tests: list[str] | str
    signature: str = ""
    description: str = ""
    file: str = "solution.py"

    @property
    def cases(self) -> list[str]:
        return [self.tests] if isinstance(self.tests, str) else list(self.tests)


def _prompt(signature: str, description: str, file: str) -> str:
    return (f"Write a Python function `{signature}`: {description}\n"
            f"Save it in `{file}` in your working directory (str_replace_editor's create), check it with the "
            f"python tool, then call submit.")


def submitted_code(answer: str | None, function: str) -> str | None:
    """The code in a final answer that defines ``function``, else None."""
    if not answer or not re.search(rf"\bdef\s+{re.escape(function)}\s*\(", answer):
        return None
    fenced = _FENCE.search(answer)
    return fenced.group(1) if fenced else answer


@register_task("python_function")
class PythonFunction(Task):
    default_tools = ("python", "str_replace_editor", "shell", "submit")
    dataset = "python_function.jsonl"

    def __init__(self, spec: TaskSpec) -> None:
        super().__init__(spec)
        self.data = task_data(spec, PythonFunctionData)

    def prompt(self) -> str:
        return _prompt(self.data.signature or f"{self.data.function}(...)", self.data.description, self.data.file)

    @classmethod
    def example(cls, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        task = {"name": "python_function", "function": record["function"], "tests": record["tests"]}
        return _prompt(record["signature"], record["description"], "solution.py"), {"task": task}

    async def score(self, sandbox: Sandbox, episode: Episode) -> Score:
        code = submitted_code(episode.answer, self.data.function)
        if code is not None:
            await sandbox.write_file(self.data.file, code)
        cases = self.data.cases
        passed = await self._passed(sandbox, cases)
        rate = passed / len(cases) if cases else 0.0
        reward = float(bool(cases) and passed == len(cases))
        return Score(reward=reward, extra={"acc": reward, "pass_rate": rate})

    async def _passed(self, sandbox: Sandbox, cases: list[str]) -> int:
        nonce = secrets.token_hex(16)
        stdin = f"{nonce}\n{json.dumps(cases)}\n"
        result = await sandbox.run([sandbox.python, "-I", "-c", GRADER, self.data.file], stdin=stdin)
        reports = [line[len(nonce):] for line in result.stdout.splitlines() if line.startswith(nonce)]
        if len(reports) != 1:  # none: the grader died; more: something else wrote one
            return 0
        passed = json.loads(reports[0]).get("passed")
        return passed if isinstance(passed, int) and 0 <= passed <= len(cases) else 0
