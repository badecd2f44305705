"""The OpenAI Agents SDK as its README shows it: an Agent with one function tool, run on a task.

Run in the SDK's own virtualenv: ``python openai_agents_run.py responses|chat|chat-stream TASK``.
The client comes from the environment (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``): ``responses`` is
the SDK's default model (the Responses API), ``chat`` and ``chat-stream`` its chat-completions
model (``set_default_openai_api("chat_completions")``), run plainly or streamed. Prints the final
output and the tools called, as JSON.
"""

import asyncio
import json
import sys

from agents import Agent, Runner, function_tool, set_default_openai_api

called: list[str] = []


@function_tool
def echo(text: str) -> str:
    """Echo the text back."""
    called.append(text)
    return f"echo: {text}"


async def main(mode: str, task: str) -> str:
    if mode != "responses":
        set_default_openai_api("chat_completions")
    agent = Agent(name="Assistant", instructions="You are a helpful assistant.", tools=[echo])
    if mode == "chat-stream":
        result = Runner.run_streamed(agent, task)
        async for _event in result.stream_events():
            pass
        return str(result.final_output)
    return str((await Runner.run(agent, task)).final_output)


if __name__ == "__main__":
    output = asyncio.run(main(sys.argv[1], sys.argv[2]))
    print(json.dumps({"output": output, "called": called}))
