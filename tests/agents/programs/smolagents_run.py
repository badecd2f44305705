"""smolagents' ToolCallingAgent over its OpenAI model, with one tool, as its guide shows it.

Run in its own virtualenv: ``python smolagents_run.py TASK``; the OpenAI client takes
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment. The agent finishes by calling its
``final_answer`` tool, and sends ``tool_choice: "required"`` on every step. Prints the final answer
and the tools called, as JSON.
"""

import json
import sys

from smolagents import OpenAIModel, ToolCallingAgent, tool

called: list[str] = []


@tool
def echo(text: str) -> str:
    """Echo the text back.

    Args:
        text: the text to echo.
    """
    called.append(text)
    return f"echo: {text}"


def main(task: str) -> str:
    agent = ToolCallingAgent(tools=[echo], model=OpenAIModel(model_id="gpt-4.1"), max_steps=4)
    return str(agent.run(task))


if __name__ == "__main__":
    output = main(sys.argv[1])
    print(json.dumps({"output": output, "called": called}))
