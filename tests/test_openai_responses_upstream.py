"""The Responses API in front of a real OpenAI-compatible model (the scripted one of tests/fake_openai.py).

What the client asked of the model must reach it: instructions in the system message,
tool_choice, sampling and length; images as content parts; and a stopped response must
close the model's stream.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from tests.conftest import LiveServer, token_for
from tests.fake_openai import FakeOpenAI, Reply, ToolCall

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PIXEL = "data:image/png;base64,iVBORw0KGgo="


async def client_for(start_server: Any, fake_openai: FakeOpenAI) -> AsyncOpenAI:
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    return AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)


async def test_instructions_tool_choice_and_sampling_reach_the_model(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(tool_calls=[ToolCall("get_weather", {"city": "Oslo"})]))
    response = await client.responses.create(
        model="fake-model",
        instructions="Answer like a ship's captain.",
        input="weather in Oslo?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.3,
        top_p=0.9,
        max_output_tokens=64,
    )
    assert [item.type for item in response.output] == ["function_call"]
    [sent] = fake_openai.requests
    system = sent.messages[0]
    assert system["role"] == "system" and system["content"].endswith("Answer like a ship's captain.")
    assert sent.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (sent.body["temperature"], sent.body["top_p"], sent.body["max_tokens"]) == (0.3, 0.9, 64)
    assert "get_weather" in [tool["function"]["name"] for tool in sent.tools or []]


async def test_an_image_reaches_the_model_as_a_content_part(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="a pixel"))
    response = await client.responses.create(
        model="fake-model",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this?"},
                    {"type": "input_image", "image_url": PIXEL, "detail": "low"},
                ],
            }
        ],
    )
    assert response.output_text == "a pixel", response.error
    [sent] = fake_openai.requests
    # The reply's own part (the time, any memories) goes before the user's words in their
    # message; the image follows the words as the client sent it.
    text_part, image_part = sent.messages[-1]["content"]
    assert sent.messages[-1]["role"] == "user"
    assert text_part["type"] == "text" and text_part["text"].endswith("what is this?")
    assert image_part == {"type": "image_url", "image_url": {"url": PIXEL, "detail": "low"}}


async def test_closing_a_response_stream_closes_the_models_stream(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="word " * 400, chunk_delay=0.02))
    stream = await client.responses.create(model="fake-model", input="talk", stream=True)
    received = ""
    async for event in stream:
        if event.type == "response.output_text.delta":
            received += event.delta
            if len(received) > 40:
                break
    await stream.close()
    assert await fake_openai.requests[0].wait_disconnected(within=5), "the model's stream must be closed"
