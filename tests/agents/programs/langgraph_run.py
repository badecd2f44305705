"""LangGraph's prebuilt ReAct agent over langchain-openai's ChatOpenAI, with one tool.

Run in its own virtualenv: ``python langgraph_run.py responses|chat TASK``; ChatOpenAI takes
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the environment, ``use_responses_api`` is true for
``responses``. Prints the last message's text and the tools called, as JSON.
"""

import json
import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

called: list[str] = []


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    called.append(text)
    return f"echo: {text}"


def main(mode: str, task: str) -> str:
    model = ChatOpenAI(model="gpt-4.1", use_responses_api=mode == "responses")
    agent = create_react_agent(model, [echo])
    state = agent.invoke({"messages": [{"role": "user", "content": task}]})
    return state["messages"][-1].text


if __name__ == "__main__":
    output = main(sys.argv[1], sys.argv[2])
    print(json.dumps({"output": output, "called": called}))
