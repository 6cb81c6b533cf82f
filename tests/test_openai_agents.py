"""The OpenAI Agents SDK (`openai-agents`, Responses API by default) on a live `chatmem serve`.

The agent's default model client points at chatmem; the SDK sends its own requests
(whole history each turn, or `previous_response_id`), runs its function tools itself and
sends their output back. What chatmem stored is read back through its own API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)

from tests.openai_support import MODEL, async_sdk, conversations, ended_turns, make_key, new_user
from tests.procs import ServerProcess, server_process

CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return f"sunny and 21 degrees in {city}"


@pytest.fixture(scope="module")
async def live(pg_url: str) -> AsyncIterator[ServerProcess]:
    async with server_process(pg_url, demo_tokens_per_second=200) as proc:
        yield proc


async def agent_for(live: ServerProcess, **settings: object) -> tuple[str, Agent]:
    user = new_user()
    set_default_openai_client(async_sdk(live, await make_key(live, user)), use_for_tracing=False)
    set_default_openai_api("responses")  # the SDK's default; said here so the test pins it
    set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    agent = Agent(
        name="weather",
        instructions="Answer questions about the weather.",
        model=MODEL,
        tools=[get_weather],
        model_settings=ModelSettings(**settings),  # type: ignore[arg-type]
    )
    return user, agent


async def test_an_agent_runs_its_tool_through_chatmem(live: ServerProcess) -> None:
    CALLS.clear()
    user, agent = await agent_for(live)
    result = await Runner.run(agent, "What's the weather in Paris?")
    assert len(CALLS) == 1
    assert "sunny and 21 degrees" in str(result.final_output)
    [conversation] = await conversations(live, user)
    stored = await ended_turns(live, user, conversation["id"])
    assert [t["role"] for t in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == "sunny and 21 degrees in What's the weather in Paris?"
    assert stored[-1]["content"] == result.final_output


async def test_a_streamed_agent_run_with_previous_response_ids(live: ServerProcess) -> None:
    CALLS.clear()
    user, agent = await agent_for(live, tool_choice="required")
    run = Runner.run_streamed(agent, "Tell me about Lisbon.", auto_previous_response_id=True)
    text = "".join(
        [
            event.data.delta
            async for event in run.stream_events()
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"
        ]
    )
    assert len(CALLS) == 1  # tool_choice "required" forced the call, then the answer came
    assert text == run.final_output and "sunny and 21 degrees" in text
    [conversation] = await conversations(live, user)
    stored = await ended_turns(live, user, conversation["id"])
    assert [t["role"] for t in stored] == ["user", "assistant", "tool", "assistant"]
    # A follow-up chained by the last response's id continues the same conversation.
    again = await Runner.run(agent, "And tomorrow?", previous_response_id=run.last_response_id)
    assert again.final_output
    assert len(await conversations(live, user)) == 1
