"""OpenAIProvider against the fake OpenAI server, through the real SDK and a real socket."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from chat_api.providers.base import Delta, ProviderError, StreamEnd, TextDelta, ToolCallDelta
from chat_api.providers.openai_provider import OpenAIProvider
from memory.config import get_settings
from tests.fake_openai import DEFAULT_TEXT, FakeOpenAI, Reply, ToolCall, collect, fake_openai  # noqa: F401
from tests.openai_rules import check_chat_messages
from tests.openai_support import WEATHER_TOOL

USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class RecordedSleeps(list[float]):
    """The provider's clock: records each backoff and returns at once, so tests never wait."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)
        await asyncio.sleep(0)


@pytest.fixture
def sleeps() -> RecordedSleeps:
    return RecordedSleeps()


@pytest.fixture
async def provider(fake_openai: FakeOpenAI, sleeps: RecordedSleeps) -> AsyncIterator[OpenAIProvider]:  # noqa: F811
    chat = OpenAIProvider(
        base_url=fake_openai.base_url,
        api_key="test-key",
        model="chat-model",
        timeout=5.0,
        max_retries=3,
        retry_base_seconds=0.5,
        rewrite_model="rewrite-model",
        sleep=sleeps,
    )
    try:
        yield chat
    finally:
        await chat.aclose()


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta))


def assembled_calls(deltas: list[Delta]) -> dict[int, dict[str, Any]]:
    """Join tool-call fragments by index the way the runner does."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": "", "fragments": 0})
            call["id"] = call["id"] or d.id
            call["name"] = call["name"] or d.name
            call["arguments"] += d.arguments
            call["fragments"] += bool(d.arguments)
    return calls


async def test_text_chunks_are_reassembled_and_usage_reported(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    text = "The weather in Paris is mild, with light rain in the evening."
    fake_openai.script(Reply(text=text, text_chunk_chars=5))

    deltas = await collect(provider.stream(USER))

    assert text_of(deltas) == text
    assert sum(isinstance(d, TextDelta) for d in deltas) == math.ceil(len(text) / 5)
    assert deltas[-1] == StreamEnd(
        finish_reason="stop",
        usage={"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18},
    )
    assert [isinstance(d, StreamEnd) for d in deltas].count(True) == 1
    (request,) = fake_openai.requests
    assert request.model == "chat-model"
    assert request.stream
    assert request.body["stream_options"] == {"include_usage": True}
    assert request.messages == USER
    assert "tools" not in request.body
    assert await request.wait_finished()
    assert not request.client_disconnected.is_set()


async def test_tool_call_arguments_are_reassembled_from_fragments(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    paris = {"city": "Paris", "unit": "celsius"}
    tokyo = {"city": "Tokyo"}
    fake_openai.script(
        Reply(
            text="Let me check.",
            tool_calls=[
                ToolCall("get_weather", paris, id="call_p"),
                ToolCall("get_weather", tokyo, id="call_t"),
            ],
            args_chunk_chars=4,
        )
    )

    deltas = await collect(provider.stream(USER, tools=[WEATHER_TOOL]))

    calls = assembled_calls(deltas)
    assert calls.keys() == {0, 1}
    assert (calls[0]["id"], calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        "call_p",
        "get_weather",
        paris,
    )
    assert (calls[1]["id"], calls[1]["name"], json.loads(calls[1]["arguments"])) == (
        "call_t",
        "get_weather",
        tokyo,
    )
    assert calls[0]["fragments"] == math.ceil(len(json.dumps(paris)) / 4)
    first_of_each = [next(d for d in deltas if isinstance(d, ToolCallDelta) and d.index == i) for i in (0, 1)]
    assert [d.id for d in first_of_each] == ["call_p", "call_t"], "id and name arrive on the first fragment"
    assert text_of(deltas) == "Let me check."
    assert isinstance(deltas[-1], StreamEnd) and deltas[-1].finish_reason == "tool_calls"
    assert fake_openai.requests[0].tools == [WEATHER_TOOL]


async def test_rate_limit_is_retried_after_the_delay_the_server_asks(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
    sleeps: RecordedSleeps,
) -> None:
    fake_openai.script(Reply(fail_status=429, retry_after=7), Reply(text="after the wait"))

    deltas = await collect(provider.stream(USER))

    assert text_of(deltas) == "after the wait"
    assert [r.status for r in fake_openai.requests] == [429, 200]
    assert sleeps == [7.0]


async def test_server_errors_are_retried_with_exponential_backoff(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
    sleeps: RecordedSleeps,
) -> None:
    fake_openai.script(Reply(fail_status=500), Reply(fail_status=503), Reply(text="third time lucky"))

    deltas = await collect(provider.stream(USER))

    assert text_of(deltas) == "third time lucky"
    assert len(fake_openai.requests) == 3
    assert len(sleeps) == 2
    assert 0.5 <= sleeps[0] <= 0.625 and 1.0 <= sleeps[1] <= 1.25


async def test_retries_stop_at_max_retries(fake_openai: FakeOpenAI, sleeps: RecordedSleeps) -> None:  # noqa: F811
    chat = OpenAIProvider(
        base_url=fake_openai.base_url,
        api_key=None,
        model="m",
        timeout=5.0,
        max_retries=1,
        retry_base_seconds=0.1,
        sleep=sleeps,
    )
    fake_openai.script(Reply(fail_status=500), Reply(fail_status=500), Reply(text="never reached"))
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(chat.stream(USER))
    finally:
        await chat.aclose()

    assert caught.value.status == 500 and caught.value.retryable
    assert len(fake_openai.requests) == 2
    assert len(sleeps) == 1


async def test_connection_dropped_after_first_token_fails_without_retry(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    # Event 1 is the role chunk, event 2 the first text piece; then the socket closes.
    fake_openai.script(Reply(text="partial answer", drop_after_chunks=2), Reply(text="must not be asked"))
    received: list[Delta] = []

    with pytest.raises(ProviderError) as caught:
        async for delta in provider.stream(USER):
            received.append(delta)

    assert received == [TextDelta("part")]
    assert caught.value.retryable is False
    assert len(fake_openai.requests) == 1


async def test_connection_dropped_before_first_token_is_retried(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    fake_openai.script(Reply(text="lost", drop_after_chunks=1), Reply(text="second attempt"))

    deltas = await collect(provider.stream(USER))

    assert text_of(deltas) == "second attempt"
    assert len(fake_openai.requests) == 2


async def test_closing_the_stream_disconnects_from_the_server(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    fake_openai.script(Reply(text="word " * 200, chunk_delay=0.02))
    stream = provider.stream(USER)
    first = await anext(stream)
    second = await anext(stream)

    await stream.aclose()

    assert [first, second] == [TextDelta("word"), TextDelta(" wor")]
    (request,) = fake_openai.requests
    assert await request.wait_disconnected(within=5.0), "the server never saw the client leave"
    assert not request.completed
    assert request.chunks_sent < 50


async def test_cancelling_the_consumer_disconnects_from_the_server(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    fake_openai.script(Reply(text="word " * 200, chunk_delay=0.02))
    first_delta = asyncio.Event()

    async def consume() -> None:
        async for _ in provider.stream(USER):
            first_delta.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(5):
        await first_delta.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    (request,) = fake_openai.requests
    assert await request.wait_disconnected(within=5.0), "the server never saw the client leave"
    assert not request.completed


async def test_invalid_message_sequence_is_a_400_and_not_retried(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
    sleeps: RecordedSleeps,
) -> None:
    messages: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "user", "content": "never mind"},
    ]

    with pytest.raises(ProviderError) as caught:
        await collect(provider.stream(messages, tools=[WEATHER_TOOL]))

    assert caught.value.status == 400
    assert caught.value.retryable is False
    assert "must be followed by tool messages responding to each 'tool_call_id'" in str(caught.value)
    assert "call_1" in str(caught.value)
    assert len(fake_openai.requests) == 1 and sleeps == []


async def test_stall_before_first_token_times_out_and_is_retried(fake_openai: FakeOpenAI) -> None:  # noqa: F811
    sleeps = RecordedSleeps()
    chat = OpenAIProvider(
        base_url=fake_openai.base_url,
        api_key=None,
        model="m",
        timeout=1.0,  # the retry's first token must fit it on a loaded machine
        max_retries=1,
        retry_base_seconds=0.1,
        sleep=sleeps,
    )
    fake_openai.script(Reply(text="slow", chunk_delay=8.0), Reply(text="prompt answer"))
    try:
        deltas = await collect(chat.stream(USER))
    finally:
        await chat.aclose()

    assert text_of(deltas) == "prompt answer"
    assert len(fake_openai.requests) == 2 and len(sleeps) == 1


async def test_complete_returns_text_from_the_rewrite_model(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    fake_openai.script(Reply(text="weather in Paris today"), Reply(text="explicit"))

    assert await provider.complete(USER) == "weather in Paris today"
    assert await provider.complete(USER, model="other-model") == "explicit"

    first, second = fake_openai.requests
    assert (first.model, first.stream) == ("rewrite-model", False)
    assert second.model == "other-model"


async def test_complete_gives_up_at_its_timeout(
    fake_openai: FakeOpenAI,  # noqa: F811
    provider: OpenAIProvider,
) -> None:
    fake_openai.script(Reply(text="too late", chunk_delay=8.0))
    started = time.monotonic()

    with pytest.raises(ProviderError) as caught:
        await provider.complete(USER, timeout=0.3)

    assert time.monotonic() - started < 4.0  # far below the answer's 8 s
    assert caught.value.retryable
    (request,) = fake_openai.requests
    assert await request.wait_disconnected(within=5.0), "the timed-out request was left open"


async def test_from_settings_uses_the_llm_settings(fake_openai: FakeOpenAI) -> None:  # noqa: F811
    settings = get_settings(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="sk-test",
        llm_model="settings-model",
        rewrite_model="settings-rewriter",
    )
    chat = OpenAIProvider.from_settings(settings)
    try:
        deltas = await collect(chat.stream(USER))
        await chat.complete(USER)
    finally:
        await chat.aclose()

    assert text_of(deltas) == DEFAULT_TEXT
    assert [r.model for r in fake_openai.requests] == ["settings-model", "settings-rewriter"]


async def test_fake_server_answers_invalid_messages_with_the_openai_error_body(
    fake_openai: FakeOpenAI,  # noqa: F811
) -> None:
    body = {"model": "m", "messages": [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]}
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{fake_openai.base_url}/chat/completions", json=body)

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "must be a response to a preceeding message with 'tool_calls'" in error["message"]
    assert set(error) >= {"message", "type", "code"}


# --- the message rules themselves -------------------------------------------------------------


def call(call_id: str, arguments: str = '{"city": "Paris"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "18°C"}


def asks(*calls: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


VALID = [
    {"role": "system", "content": "be brief"},
    *USER,
    asks(call("a"), call("b")),
    tool_result("b"),
    tool_result("a"),
    {"role": "assistant", "content": "18°C in both."},
    {"role": "user", "content": "thanks"},
]

INVALID: dict[str, tuple[list[dict[str, Any]], str]] = {
    "empty list": ([], "too short"),
    "unknown role": ([{"role": "robot", "content": "hi"}], "Invalid value: 'robot'"),
    "empty user content": ([{"role": "user", "content": ""}], "string too short"),
    "null user content": ([{"role": "user", "content": None}], "expected a string, but got null"),
    "assistant with nothing": (
        [*USER, {"role": "assistant", "content": ""}],
        "must have 'content' or 'tool_calls'",
    ),
    "empty tool_calls": ([*USER, {"role": "assistant", "content": "x", "tool_calls": []}], "empty array"),
    "missing response": (
        [*USER, asks(call("a"), call("b")), tool_result("a")],
        "did not have response messages: b",
    ),
    "response after a user turn": (
        [*USER, asks(call("a")), {"role": "user", "content": "hm"}, tool_result("a")],
        "must be followed by tool messages",
    ),
    "orphan tool message": ([*USER, tool_result("a")], "must be a response to a preceeding message"),
    "answer to another group": (
        [*USER, asks(call("a")), tool_result("a"), asks(call("b")), tool_result("a"), tool_result("b")],
        "'tool_call_id' of 'a' not found",
    ),
    "two answers to one call": (
        [*USER, asks(call("a")), tool_result("a"), tool_result("a")],
        "duplicate tool message",
    ),
    "duplicate ids across turns": (
        [*USER, asks(call("a")), tool_result("a"), asks(call("a")), tool_result("a")],
        "duplicate 'tool_calls' id",
    ),
    "half a JSON argument": ([*USER, asks(call("a", '{"city": "Pa')), tool_result("a")], "JSON object"),
    "arguments not a string": (
        [
            *USER,
            asks({"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}),
            tool_result("a"),
        ],
        "expected a string",
    ),
    "missing function name": (
        [*USER, asks({"id": "a", "type": "function", "function": {"arguments": "{}"}}), tool_result("a")],
        "function.name",
    ),
    "unknown key": ([{"role": "user", "content": "hi", "turn_id": 3}], "'turn_id' was unexpected"),
}


def test_valid_tool_round_trip_is_accepted() -> None:
    assert check_chat_messages(VALID) is None


@pytest.mark.parametrize("case", INVALID)
def test_invalid_sequences_are_refused(case: str) -> None:
    messages, expected = INVALID[case]
    error = check_chat_messages(messages)
    assert error is not None and expected in error, error
