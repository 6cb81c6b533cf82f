"""The Responses API (`/openai/v1/responses`) with the official `openai` Python SDK on a live server.

One server process for the module (the demo model at 40 tokens/s); each test is its own
user. What was stored is read back through chatmem's own API: the stored reply must be
what the client was sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from memory.config import Settings
from tests.conftest import auth
from tests.openai_support import MODEL, TENANT, conversations, ended_turns, make_key, new_user, sdk, turns
from tests.procs import ServerProcess, server_process
from tests.support import conversation_locked, wait_until

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# A 1x1 PNG, as a data URL.
PIXEL = (
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


# The bound the live server runs with (MAX_OUTPUT_TOKENS, by default).
MAX_OUTPUT_TOKENS: int = Settings.model_fields["max_output_tokens"].default


@pytest.fixture(scope="module")
async def live(pg_url: str) -> AsyncIterator[ServerProcess]:
    async with server_process(pg_url, demo_tokens_per_second=40) as proc:
        yield proc


async def client_for(live: ServerProcess) -> tuple[str, openai.OpenAI]:
    user = new_user()
    return user, sdk(live, await make_key(live, user))


def text_of(items: list[Any]) -> str:
    return "".join(
        part.text
        for item in items
        if item.type == "message"
        for part in item.content
        if part.type == "output_text"
    )


# --- plain, streamed, chained ----------------------------------------------------------


async def test_a_plain_response_is_the_stored_reply(live: ServerProcess) -> None:
    user, client = await client_for(live)
    raw = client.responses.with_raw_response.create(model=MODEL, input="hello there", instructions="be brief")
    response = raw.parse()
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith("resp_") and response.completed_at is not None
    assert response.instructions == "be brief" and response.store is True and response.background is False
    assert response.usage is not None and response.usage.output_tokens > 0
    assert "hello there" in response.output_text
    stored = await turns(live, user, raw.headers["x-chatmem-conversation-id"])
    assert [(t["role"], t["status"]) for t in stored] == [("user", "completed"), ("assistant", "completed")]
    assert stored[1]["content"] == response.output_text
    assert raw.headers["x-chatmem-reply-id"] == stored[1]["id"]
    again = client.responses.retrieve(response.id)
    assert again.model_dump(exclude={"completed_at"}) == response.model_dump(exclude={"completed_at"})
    items = client.responses.input_items.list(response.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]


async def test_a_response_held_to_the_sdks_own_types_lacked_usages_cache_write_tokens(
    live: ServerProcess,
) -> None:
    """The SDK makes its objects without validating them, so a field its types require can be
    missing unseen; a typed client that validates (as pydantic does here) refused the usage."""
    _user, client = await client_for(live)
    raw = client.responses.with_raw_response.create(model=MODEL, input="hello there")
    made = Response.model_validate_json(raw.http_response.text)
    assert made.usage is not None and made.usage.input_tokens_details.cache_write_tokens == 0
    completed = list(client.responses.create(model=MODEL, input="hi", stream=True))[-1]
    assert completed.type == "response.completed"
    Response.model_validate(completed.response.model_dump(exclude_unset=True))
    Response.model_validate_json(client.responses.with_raw_response.retrieve(made.id).http_response.text)


async def test_a_streamed_response_numbers_its_events_and_equals_what_is_stored(live: ServerProcess) -> None:
    user, client = await client_for(live)
    events = list(client.responses.create(model=MODEL, input="count from 1 to 5", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed" and final.output_text == streamed
    assert client.responses.retrieve(final.id).output_text == streamed
    conversation = (await conversations(live, user))[0]["id"]
    assert (await turns(live, user, conversation))[-1]["content"] == streamed


async def test_the_stream_helper_accumulates_the_same_response(live: ServerProcess) -> None:
    _user, client = await client_for(live)
    with client.responses.stream(model=MODEL, input="stream me") as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas


async def test_previous_response_id_continues_and_branches_when_the_branch_moved_on(
    live: ServerProcess,
) -> None:
    user, client = await client_for(live)
    first = client.responses.with_raw_response.create(model=MODEL, input="my code word is papaya")
    conversation = first.headers["x-chatmem-conversation-id"]
    one = first.parse()
    two = client.responses.create(model=MODEL, input="what was it?", previous_response_id=one.id)
    assert two.previous_response_id == one.id
    stored = await turns(live, user, conversation)
    assert [t["content"] for t in stored if t["role"] == "user"] == ["my code word is papaya", "what was it?"]
    # Continuing from the first response again: a new branch after it, made active.
    three = client.responses.with_raw_response.create(
        model=MODEL, input="no, forget that", previous_response_id=one.id
    )
    assert three.headers["x-chatmem-conversation-id"] == conversation
    stored = await turns(live, user, conversation)
    assert [t["content"] for t in stored if t["role"] == "user"] == [
        "my code word is papaya",
        "no, forget that",
    ]
    async with live.client(TENANT, user) as api:
        branches = (await api.get(f"/v1/conversations/{conversation}/branches")).json()["items"]
    assert len(branches) == 2
    # The second response still reads as it was.
    assert client.responses.retrieve(two.id).output_text == two.output_text


async def test_a_response_recalls_what_the_user_said_in_another_conversation(live: ServerProcess) -> None:
    user, client = await client_for(live)
    told = client.responses.with_raw_response.create(model=MODEL, input="My sister Ottilie lives in Tromsø.")
    told_turn = (await turns(live, user, told.headers["x-chatmem-conversation-id"]))[0]["id"]
    raw = client.responses.with_raw_response.create(model=MODEL, input="Where does my sister Ottilie live?")
    assert raw.headers["x-chatmem-conversation-id"] != told.headers["x-chatmem-conversation-id"]
    assert told_turn in raw.headers["x-chatmem-memory-turn-ids"].split(",")
    assert "Tromsø" in raw.parse().output_text  # the demo model quotes what it was given
    assert (
        raw.headers["x-chatmem-memory-count"]
        == client.responses.with_raw_response.retrieve(raw.parse().id).headers["x-chatmem-memory-count"]
    )


# --- function tools ---------------------------------------------------------------------


async def test_function_tool_round_trip_with_a_forced_tool_choice(live: ServerProcess) -> None:
    user, client = await client_for(live)
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input="Use the weather tool for Paris.",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    first = raw.parse()
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "64 degrees and clear"}],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert second.status == "completed" and "64 degrees and clear" in second.output_text
    stored = await turns(live, user, raw.headers["x-chatmem-conversation-id"])
    assert [t["role"] for t in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["arguments"] == call.arguments
    assert stored[2]["tool_call_id"] == call.call_id and stored[2]["content"] == "64 degrees and clear"


async def test_tool_choice_required_and_none(live: ServerProcess) -> None:
    _user, client = await client_for(live)
    forced = client.responses.create(
        model=MODEL,
        input="hello",
        tools=[WEATHER],
        tool_choice="required",  # type: ignore[list-item]
    )
    assert [item.type for item in forced.output] == ["function_call"]
    free = client.responses.create(
        model=MODEL,
        input="what's the weather in Paris?",
        tools=[WEATHER],
        tool_choice="none",  # type: ignore[list-item]
    )
    assert [item.type for item in free.output] == ["message"]
    asked = client.responses.create(model=MODEL, input="what's the weather in Paris?", tools=[WEATHER])  # type: ignore[list-item]
    assert [item.type for item in asked.output] == ["function_call"]


# --- stop -------------------------------------------------------------------------------


async def test_closing_the_stream_mid_text_stops_and_the_next_response_is_valid(live: ServerProcess) -> None:
    user, client = await client_for(live)
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="/long tell me everything", stream=True
    )
    conversation = raw.headers["x-chatmem-conversation-id"]
    stream = raw.parse()
    received, response_id = "", ""
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            received += event.delta
            if len(received.split()) >= 12:
                break
    stream.close()  # the client's stop
    stored = await ended_turns(live, user, conversation)
    reply = stored[-1]
    assert reply["status"] == "interrupted_by_user" and reply["interrupt_reason"] == "client_disconnected"
    assert reply["content"].startswith(received)
    assert len(reply["content"].split()) - len(received.split()) <= 2, (reply["content"], received)
    stopped = client.responses.retrieve(response_id)
    assert stopped.status == "incomplete" and stopped.incomplete_details is not None
    assert stopped.output_text == reply["content"]  # what was sent, byte for byte
    assert stopped.output[0].status == "incomplete"
    after = client.responses.create(model=MODEL, input="go on", previous_response_id=response_id)
    assert after.status == "completed" and "go on" in after.output_text


def close_mid_arguments(client: openai.OpenAI, arguments: str) -> tuple[str, str, str, str]:
    """Stream a call of get_weather with ``arguments`` and close the stream (the client's stop)
    once 40 characters of them came: (conversation id, response id, call id, arguments received)."""
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=f"/tool get_weather {arguments}",
        tools=[WEATHER],  # type: ignore[list-item]
        stream=True,
    )
    stream = raw.parse()
    received, response_id, call_id = "", "", ""
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            call_id = event.item.call_id
        if event.type == "response.function_call_arguments.delta":
            received += event.delta
            if len(received) >= 40:
                break
    stream.close()
    return raw.headers["x-chatmem-conversation-id"], response_id, call_id, received


async def test_closing_the_stream_mid_arguments_keeps_them_and_the_next_response_is_valid(
    live: ServerProcess,
) -> None:
    user, client = await client_for(live)
    long_args = json.dumps({"city": "Paris " * 60})
    conversation, response_id, _, received = close_mid_arguments(client, long_args)
    stored = await ended_turns(live, user, conversation)
    call = stored[-1]["tool_calls"][0]
    assert stored[-1]["status"] == "interrupted_by_user"
    assert call["arguments"].startswith(received) and call["arguments"] != long_args
    stopped = client.responses.retrieve(response_id)
    [item] = stopped.output
    assert (
        item.type == "function_call" and item.status == "incomplete" and item.arguments == call["arguments"]
    )
    after = client.responses.create(model=MODEL, input="never mind", previous_response_id=response_id)
    assert after.status == "completed" and "never mind" in after.output_text


async def test_a_result_for_a_call_a_stop_cut_off_is_refused_and_nothing_is_stored(
    live: ServerProcess,
) -> None:
    # It was stored as a tool turn and answered 200, but the next prompt leaves out every call of a
    # stopped reply, so the model never saw the result: it went on as if the client had not answered.
    user, client = await client_for(live)
    conversation, response_id, call_id, _ = close_mid_arguments(client, json.dumps({"city": "Paris " * 60}))
    stopped = await ended_turns(live, user, conversation)
    assert stopped[-1]["status"] == "interrupted_by_user"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL,
            previous_response_id=response_id,
            tools=[WEATHER],  # type: ignore[list-item]
            input=[{"type": "function_call_output", "call_id": call_id, "output": '{"sky": "clear"}'}],
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_input", error
    assert "stopped" in error["message"]
    assert await turns(live, user, conversation) == stopped  # nothing stored, no branch made
    async with live.client(TENANT, user) as http:
        branches = (await http.get(f"/v1/conversations/{conversation}/branches")).json()["items"]
    assert len(branches) == 1


# --- background, cancel, resume ---------------------------------------------------------


async def test_background_poll_resume_and_cancel(live: ServerProcess) -> None:
    user, client = await client_for(live)
    started = client.responses.create(model=MODEL, input="/long a long story", background=True)
    assert started.status in ("queued", "in_progress") and started.background is True
    deadline = time.monotonic() + 20
    while not (polled := client.responses.retrieve(started.id)).output_text:
        assert polled.status == "in_progress" and time.monotonic() < deadline
        time.sleep(0.05)
    # Resume from the middle: exactly the events after N, numbered on from there.
    first = list(_take(client.responses.retrieve(started.id, stream=True), 8))
    resumed = client.responses.retrieve(started.id, stream=True, starting_after=first[4].sequence_number)
    following = list(_take(resumed, 3))
    assert [e.sequence_number for e in following] == [5, 6, 7]
    assert [e.model_dump() for e in following] == [e.model_dump() for e in first[5:8]]
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    stored = await ended_turns(live, user, (await conversations(live, user))[0]["id"])
    assert stored[-1]["status"] == "interrupted_by_user" and stored[-1]["interrupt_reason"] == "user"
    assert client.responses.retrieve(started.id).output_text == stored[-1]["content"]
    # A resumed stream of the whole response ends as the stored one does.
    events = list(client.responses.retrieve(started.id, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == stored[-1]["content"]
    assert client.responses.cancel(started.id).status == "cancelled"  # again: the same


def _take(stream: Any, count: int) -> Any:
    try:
        for index, event in enumerate(stream):
            yield event
            if index + 1 == count:
                return
    finally:
        stream.close()


async def test_a_background_stream_outlives_its_client(live: ServerProcess) -> None:
    _user, client = await client_for(live)
    stream = client.responses.create(model=MODEL, input="keep going", background=True, stream=True)
    created = next(iter(stream))
    stream.close()  # not a stop: background responses run on
    deadline = time.monotonic() + 20
    while (response := client.responses.retrieve(created.response.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert response.status == "completed"


async def test_only_background_responses_can_be_cancelled(live: ServerProcess) -> None:
    _user, client = await client_for(live)
    done = client.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)


# --- store, delete, images and files ----------------------------------------------------


async def test_store_false_is_answered_then_not_retrievable(live: ServerProcess) -> None:
    user, client = await client_for(live)
    response = client.responses.create(model=MODEL, input="off the record", store=False)
    assert response.status == "completed" and response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="and?", previous_response_id=response.id)
    # chatmem still keeps the turns in the conversation (its memory mode decides recall).
    assert len(await conversations(live, user)) == 1


async def test_delete_hides_the_response_and_keeps_the_turns(live: ServerProcess) -> None:
    user, client = await client_for(live)
    response = client.responses.create(model=MODEL, input="delete me")
    deleted = client.responses.delete(response.id)
    assert deleted is None  # the SDK returns nothing for a 200 deletion
    for call in (client.responses.retrieve, client.responses.input_items.list, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    conversation = (await conversations(live, user))[0]["id"]
    assert len(await turns(live, user, conversation)) == 2


async def test_images_and_files_are_stored_given_to_the_model_and_acknowledged(live: ServerProcess) -> None:
    user, client = await client_for(live)
    pdf = "data:application/pdf;base64,JVBERi0xLjEKJSVFT0Y="
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is in these?"},
                    {"type": "input_image", "image_url": PIXEL, "detail": "auto"},
                    {"type": "input_file", "filename": "notes.pdf", "file_data": pdf},
                ],
            }
        ],
    )
    response = raw.parse()
    assert "I see 1 image and the file notes.pdf" in response.output_text
    conversation = raw.headers["x-chatmem-conversation-id"]
    stored = await turns(live, user, conversation)
    assert stored[0]["content"] == "what is in these?"
    assert stored[0]["metadata"]["attachments"] == [
        {"type": "image", "url": PIXEL, "detail": "auto"},
        {"type": "file", "filename": "notes.pdf", "data": pdf},
    ]
    async with live.client(TENANT, user) as api:
        context = (await api.get(f"/v1/conversations/{conversation}/context")).json()
    user_message = next(m for m in context["messages"] if m["role"] == "user")
    assert [p["type"] for p in user_message["content"]] == ["text", "image_url", "file"]


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"model": MODEL}, openai.BadRequestError, "input"),
        ({"model": MODEL, "input": []}, openai.BadRequestError, "input"),
        ({"model": "gpt-4o", "input": "a"}, openai.NotFoundError, "model"),
        (
            {"model": MODEL, "input": [{"type": "web_search_call", "id": "x"}]},
            openai.BadRequestError,
            "input[0].type",
        ),
        (
            {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "call_x", "output": "r"}]},
            openai.BadRequestError,
            "input",
        ),
        (
            {
                "model": MODEL,
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x"}]}],
            },
            openai.BadRequestError,
            "input[0].content[0].image_url",
        ),
        (
            {"model": MODEL, "input": "a", "tools": [{"type": "web_search"}]},
            openai.BadRequestError,
            "tools[0].type",
        ),
        (
            {
                "model": MODEL,
                "input": "a",
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "nope"},
            },
            openai.BadRequestError,
            "tool_choice",
        ),
        (
            {"model": MODEL, "input": "a", "previous_response_id": "resp_nope"},
            openai.NotFoundError,
            "previous_response_id",
        ),
        (
            {"model": MODEL, "input": "a", "background": True, "store": False},
            openai.BadRequestError,
            "background",
        ),
        ({"model": MODEL, "input": "a", "temperature": 7}, openai.BadRequestError, "temperature"),
        ({"model": MODEL, "input": "a\x00b"}, openai.BadRequestError, None),
    ],
)
async def test_bad_requests_are_openai_shaped_before_any_stream_and_store_nothing(
    live: ServerProcess, body: dict[str, Any], error: type[openai.APIStatusError], param: str | None
) -> None:
    user, client = await client_for(live)
    for stream in (False, True):
        with pytest.raises(error) as caught:
            client.responses.create(**body, stream=stream)
        payload = caught.value.body
        assert isinstance(payload, dict) and payload["message"] and payload["type"] == "invalid_request_error"
        if param is not None:
            assert payload["param"] == param
    assert await conversations(live, user) == []


async def test_max_output_tokens_of_ten_to_the_thirty_was_accepted(live: ServerProcess) -> None:
    # No upper bound: 10**30 was taken and stored with the response; an upstream model would
    # refuse it only after the user's turn was stored.
    user, client = await client_for(live)
    for asked in (10**30, MAX_OUTPUT_TOKENS + 1):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model=MODEL, input="hi", max_output_tokens=asked, stream=stream)
            payload = caught.value.body
            assert isinstance(payload, dict) and payload["param"] == "max_output_tokens", payload
            assert payload["type"] == "invalid_request_error" and str(MAX_OUTPUT_TOKENS) in payload["message"]
    assert await conversations(live, user) == []


async def test_tool_definitions_are_held_to_the_bounds_every_door_holds_them_to(live: ServerProcess) -> None:
    # AG-UI held a description to 10,000 characters and a schema to 200 KB; the OpenAI doors took
    # anything the 1 MB body held, stored it with the response and sent it to the model every step.
    user, client = await client_for(live)
    wordy = {**WEATHER, "description": "x" * 10_001}
    huge = {**WEATHER, "parameters": {"type": "object", "description": "y" * 200_001}}
    for tool, param in ((wordy, "tools[0].description"), (huge, "tools[0].parameters")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(model=MODEL, input="hi", tools=[tool], stream=stream)  # type: ignore[list-item]
            assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
        function = {k: v for k, v in tool.items() if k != "type"}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": function}],  # type: ignore[list-item]
            )
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param
    assert await conversations(live, user) == []
    within = {**WEATHER, "description": "x" * 10_000}
    answered = client.responses.create(model=MODEL, input="hi", tools=[within])  # type: ignore[list-item]
    assert answered.status == "completed"


async def test_another_users_response_is_404_everywhere(live: ServerProcess) -> None:
    _owner, owner_client = await client_for(live)
    response = owner_client.responses.create(model=MODEL, input="mine", background=True)
    intruder, client = await client_for(live)
    for call in (
        client.responses.retrieve,
        client.responses.cancel,
        client.responses.delete,
        client.responses.input_items.list,
    ):
        with pytest.raises(openai.NotFoundError):
            call(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="theirs", previous_response_id=response.id)
    async with httpx.AsyncClient(
        base_url=live.base_url, headers={"Authorization": f"Bearer {client.api_key}"}
    ) as http:
        streamed = await http.get(f"/openai/v1/responses/{response.id}", params={"stream": "true"})
    assert streamed.status_code == 404 and streamed.json()["error"]["code"] == "not_found"
    assert await conversations(live, intruder) == []
    assert owner_client.responses.retrieve(response.id).id == response.id


async def test_background_responses_count_against_the_running_reply_cap(live: ServerProcess) -> None:
    user, client = await client_for(live)
    started = [
        client.responses.create(model=MODEL, input=f"/long story {n}", background=True) for n in range(10)
    ]
    with pytest.raises(openai.RateLimitError) as caught:
        client.responses.create(model=MODEL, input="one too many", background=True)
    assert caught.value.response.headers.get("retry-after")
    assert len(await conversations(live, user)) == 10  # the refused one stored nothing
    for response in started:
        assert client.responses.cancel(response.id).status == "cancelled"


# --- WebSocket mode (the SDK's `client.responses.connect()`) ----------------------------

TERMINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def _until_terminal(connection: Any) -> list[Any]:
    events = []
    for event in connection:
        events.append(event)
        if event.type in TERMINAL:
            return events
    raise AssertionError("the connection closed before a terminal event")


async def test_websocket_mode_continues_unstored_responses_on_its_connection_only(
    live: ServerProcess,
) -> None:
    user, client = await client_for(live)
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="the code word is cobalt", store=False)
        first = _until_terminal(connection)
        assert [e.sequence_number for e in first] == list(range(len(first)))
        done = first[-1].response
        assert first[-1].type == "response.completed" and done.store is False
        connection.response.create(
            model=MODEL, input="what was it?", store=False, previous_response_id=done.id
        )
        second = _until_terminal(connection)[-1]
        assert second.type == "response.completed" and second.response.previous_response_id == done.id
        # A continuation that fails forgets the response it named.
        connection.response.create(
            model=MODEL,
            store=False,
            previous_response_id=second.response.id,
            input=[{"type": "function_call_output", "call_id": "call_missing", "output": "x"}],
        )
        failed = _until_terminal(connection)[-1]
        assert failed.type == "error" and failed.status == 400
        connection.response.create(
            model=MODEL, input="again", store=False, previous_response_id=second.response.id
        )
        forgotten = _until_terminal(connection)[-1]
        assert forgotten.type == "error" and forgotten.error.code == "previous_response_not_found"
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="and now?", store=False, previous_response_id=done.id)
        elsewhere = _until_terminal(connection)[-1]
        assert elsewhere.type == "error" and elsewhere.error.code == "previous_response_not_found"
    [conversation] = await conversations(live, user)
    stored = await turns(live, user, conversation["id"])
    assert [t["content"] for t in stored if t["role"] == "user"] == [
        "the code word is cobalt",
        "what was it?",
    ]


async def test_a_key_revoked_while_its_websocket_was_open_kept_creating_responses(
    live: ServerProcess,
) -> None:
    user = new_user()
    async with live.client(TENANT, user) as api:
        made = (await api.post("/v1/keys", json={"name": "socket"})).json()
    client = sdk(live, made["key"])
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="first, while the key is live")
        assert _until_terminal(connection)[-1].type == "response.completed"
        async with live.client(TENANT, user) as api:
            assert (await api.delete(f"/v1/keys/{made['id']}")).status_code == 200
        connection.response.create(model=MODEL, input="second, after the revocation")
        refused = _until_terminal(connection)[-1]
        assert refused.type == "error" and refused.status == 401
        assert refused.error.code == "invalid_api_key"
    [conversation] = await conversations(live, user)
    stored = await turns(live, user, conversation["id"])
    assert [t["content"] for t in stored if t["role"] == "user"] == ["first, while the key is live"]


async def test_a_binary_websocket_message_dropped_the_connection_without_a_word(live: ServerProcess) -> None:
    """A binary frame raised in the server (it read text only): no close frame, no error."""
    _user, client = await client_for(live)
    with client.responses.connect() as connection:
        connection.send_raw(json.dumps({"type": "response.create", "model": MODEL, "input": "hi"}).encode())
        refused = _until_terminal(connection)
        assert [e.type for e in refused] == ["error"] and refused[0].status == 400
        assert refused[0].error.type == "invalid_request_error" and "text message" in refused[0].error.message
        connection.response.create(model=MODEL, input="and as text?")
        assert _until_terminal(connection)[-1].type == "response.completed"  # the connection stayed open


async def test_a_websocket_handshake_without_a_valid_key_was_a_bare_403(live: ServerProcess) -> None:
    """The HTTP door answers OpenAI's 401 `invalid_api_key`; the handshake was closed (403, no body)."""
    import websockets

    for api_key in ("not-a-key", "sk-chatmem-0000"):
        client = openai.OpenAI(base_url=f"{live.base_url}/openai/v1", api_key=api_key, max_retries=0)
        with pytest.raises(websockets.InvalidStatus) as refused, client.responses.connect() as connection:
            connection.response.create(model=MODEL, input="hi")
            _until_terminal(connection)
        answer = refused.value.response
        assert answer.status_code == 401, answer
        assert json.loads(answer.body)["error"]["code"] == "invalid_api_key"
        assert answer.headers["WWW-Authenticate"] == "Bearer"


async def test_closing_the_websocket_mid_response_stops_it(live: ServerProcess) -> None:
    user, client = await client_for(live)
    received = ""
    with client.responses.connect() as connection:
        connection.response.create(model=MODEL, input="/long keep talking")
        for event in connection:
            if event.type == "response.output_text.delta":
                received += event.delta
                if len(received.split()) >= 8:
                    break
    [conversation] = await conversations(live, user)
    reply = (await ended_turns(live, user, conversation["id"]))[-1]
    assert reply["status"] == "interrupted_by_user" and reply["content"].startswith(received)
    assert len(reply["content"].split()) < 100


# --- compaction -------------------------------------------------------------------------


async def test_compaction_keeps_the_history_and_a_response_goes_on_from_its_item(live: ServerProcess) -> None:
    user, client = await client_for(live)
    compacted = client.responses.compact(
        model=MODEL,
        input=[
            {"role": "user", "content": "We launch on Tuesday and tell support first."},
            {"role": "assistant", "content": "Understood: Tuesday, support first."},
        ],
    )
    assert compacted.object == "response.compaction"
    [item] = compacted.output
    assert item.type == "compaction" and item.encrypted_content
    raw = client.responses.with_raw_response.create(
        model=MODEL,
        input=[item.model_dump(exclude_none=True), {"role": "user", "content": "when do we launch?"}],
        store=False,
    )
    assert raw.parse().status == "completed"
    stored = await turns(live, user, raw.headers["x-chatmem-conversation-id"])
    assert [(t["role"], t["content"]) for t in stored][:3] == [
        ("user", "We launch on Tuesday and tell support first."),
        ("assistant", "Understood: Tuesday, support first."),
        ("user", "when do we launch?"),
    ]
    # The item is the owner's: for anyone else it names nothing.
    _other, intruder = await client_for(live)
    with pytest.raises(openai.NotFoundError):
        intruder.responses.create(
            model=MODEL, input=[item.model_dump(exclude_none=True), {"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError):
        client.responses.compact(model=MODEL, input=[])
    with pytest.raises(openai.BadRequestError):
        client.post("/responses/compact", body={"input": "no model"}, cast_to=object)


ODD_BODIES = {
    "nested past the bound": f'{{"model":"{MODEL}","input":{"[" * 2000}"a"{"]" * 2000}}}',
    "an integer of 5,000 digits": f'{{"model":"{MODEL}","input":"a","max_output_tokens":{"9" * 5000}}}',
    "a lone surrogate in metadata": f'{{"model":"{MODEL}","input":"a","metadata":{{"k":"\\ud800"}}}}',
    "a NUL in a call id": json.dumps(
        {"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c\u0000x", "output": "r"}]}
    ),
    "a lone surrogate in a call id": (
        f'{{"model":"{MODEL}","input":[{{"type":"function_call_output","call_id":"\\udc00","output":"r"}}]}}'
    ),
    "a NUL in a file name": json.dumps(
        {
            "model": MODEL,
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_file", "filename": "a\u0000", "file_data": "QQ=="}],
                }
            ],
        }
    ),
    "not JSON": '{"model":',
    "a list": "[1]",
}


@pytest.mark.parametrize("body", list(ODD_BODIES.values()), ids=list(ODD_BODIES))
async def test_odd_bodies_are_400s_in_openai_shape_never_500s(live: ServerProcess, body: str) -> None:
    user = new_user()
    key = await make_key(live, user)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=live.base_url, headers=headers) as http:
        response = await http.post("/openai/v1/responses", content=body)
        assert response.status_code in (400, 422), response.text
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert (await http.get("/openai/v1/models")).status_code == 200  # the connection and server live on
    assert await conversations(live, user) == []


async def waiting_for_an_approval(server: ServerProcess) -> tuple[str, openai.AsyncOpenAI, Response, str]:
    """A new user, their SDK client, and the response it created that waits for an approval
    (the server asks one for `current_time`), with its conversation's id."""
    user = new_user()
    token = auth(TENANT, user)["Authorization"].removeprefix("Bearer ")
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token, max_retries=0)
    parked = await client.responses.create(model=MODEL, input="what time is it?")
    assert parked.status == "incomplete" and parked.incomplete_details is not None
    assert parked.incomplete_details.reason == "awaiting_approval"
    async with server.client(TENANT, user) as api:
        conversation = (await api.get("/v1/conversations")).json()["items"][0]["id"]
    return user, client, parked, conversation


def assert_replaced_once(stored: list[dict[str, Any]]) -> None:
    """The waiting reply was stopped by new input, and that one input was answered."""
    assert [(t["role"], t["status"]) for t in stored] == [
        ("user", "completed"),
        ("assistant", "interrupted_by_user"),
        ("user", "completed"),
        ("assistant", "completed"),
    ]
    assert stored[1]["interrupt_reason"] == "new_message"


@pytest.mark.parametrize("continued_by", ["previous_response_id", "conversation"])
async def test_new_input_after_a_response_that_waits_for_an_approval_replaces_it(
    start_server: Any, continued_by: str
) -> None:
    # It was a 409 ("a reply is already streaming"): a Responses client, which has no way to decide
    # the approval, could not go on in its conversation at all.
    server = await start_server(tools_requiring_approval=["current_time"])
    user, client, parked, conversation = await waiting_for_an_approval(server)
    continuing = {"previous_response_id": parked.id, "conversation": conversation}
    after = await client.responses.create(
        model=MODEL, input="never mind, say hi", **{continued_by: continuing[continued_by]}
    )
    assert after.status == "completed" and "say hi" in after.output_text
    async with server.client(TENANT, user) as api:
        stored = (await api.get(f"/v1/conversations/{conversation}/turns")).json()["items"]
        context = (await api.get(f"/v1/conversations/{conversation}/context")).json()
    assert_replaced_once(stored)
    assert stored[1]["tool_calls"][0]["state"] == "cancelled"
    assert not any(m.get("tool_calls") or m["role"] == "tool" for m in context["messages"])
    assert (await client.responses.retrieve(parked.id)).status == "incomplete"


async def test_two_inputs_at_once_beside_a_waiting_reply_replace_it_once_and_the_second_is_409(
    start_server: Any, db: Any
) -> None:
    # The door decided "a waiting reply gives way" before taking the conversation's lock, so both
    # requests decided it; the second then stopped the reply the first had just started and
    # stored its own message too: two messages answered at once, one reply cut off.
    server = await start_server(tools_requiring_approval=["current_time"], demo_tokens_per_second=20)
    user, client, _, conversation = await waiting_for_an_approval(server)
    # Both requests get as far as the conversation's lock, and wait there together.
    async with conversation_locked(db, conversation) as waiting:
        inputs = [
            asyncio.create_task(
                client.responses.create(model=MODEL, input=f"instead, {n}", conversation=conversation)
            )
            for n in ("one", "two")
        ]
        await waiting(2)
    outcomes = await asyncio.gather(*inputs, return_exceptions=True)
    answered = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, openai.ConflictError)]
    assert len(answered) == 1 and len(refused) == 1, outcomes
    assert answered[0].status == "completed"
    async with server.client(TENANT, user) as api:
        stored = (await api.get(f"/v1/conversations/{conversation}/turns")).json()["items"]
    assert_replaced_once(stored)


@pytest.mark.parametrize("continuing", [False, True], ids=["new", "continuing"])
@pytest.mark.parametrize("content", ["   ", [{"type": "input_image", "image_url": PIXEL}]])
async def test_a_message_without_text_continuing_a_response_was_refused_naming_messages(
    live: ServerProcess, content: Any, continuing: bool
) -> None:
    """Continuing a response, a blank message (or an image alone) was refused as `messages is
    empty`, param `messages`, a field the Responses API has not; a new one, as an empty message
    when it held an image. Either way: a 400 on `input` that says the text is missing."""
    user, client = await client_for(live)
    previous = client.responses.create(model=MODEL, input="first").id if continuing else None
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL, input=[{"role": "user", "content": content}], previous_response_id=previous
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "input", error
    assert "no text" in error["message"]
    assert len(await conversations(live, user)) == (1 if continuing else 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("stream", '"yes"'), ("store", '"false"'), ("max_output_tokens", '"64"'), ("temperature", '"0.5"')],
)
async def test_a_flag_or_a_number_sent_as_a_string_was_read_as_its_value(
    live: ServerProcess, field: str, value: str
) -> None:
    """`"stream": "yes"` answered a stream, `"store": "false"` stored nothing, `"64"` was 64:
    a value of the wrong JSON type is a 400 naming it, before anything is stored."""
    user = new_user()
    headers = {"Authorization": f"Bearer {await make_key(live, user)}", "Content-Type": "application/json"}
    body = f'{{"model": "{MODEL}", "input": "hi", "{field}": {value}}}'
    async with httpx.AsyncClient(base_url=live.base_url, headers=headers) as http:
        response = await http.post("/openai/v1/responses", content=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert await conversations(live, user) == []


async def test_a_function_tools_strict_flag_sent_as_a_string_was_read_as_its_value(
    live: ServerProcess,
) -> None:
    """The body was strict, its tools were not: `"strict": "true"` was stored and echoed as true."""
    user, client = await client_for(live)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model=MODEL,
                input="hi",
                tools=[{**WEATHER, "strict": "true"}],  # type: ignore[list-item]
                stream=stream,
            )
        payload = caught.value.body
        assert isinstance(payload, dict) and payload["param"] == "tools[0].strict", payload
        assert payload["type"] == "invalid_request_error"
    assert await conversations(live, user) == []


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"input": [5]}, "input[0]"),
        ({"conversation": {"id": 5}}, "conversation.id"),
        ({"tools": [5]}, "tools[0]"),
    ],
)
async def test_a_wrong_value_was_named_by_pydantics_location_not_the_field(
    live: ServerProcess, sent: dict[str, Any], param: str
) -> None:
    """param was `input.str`, `conversation.str`, `tools.0`: pydantic's location, not the field."""
    user, client = await client_for(live)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", extra_body=sent)
    payload = caught.value.body
    assert isinstance(payload, dict) and payload["param"] == param, payload
    assert await conversations(live, user) == []


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"include": 5}, "include"),
        ({"include": [5]}, "include[0]"),
        ({"text": {"format": 5}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format.schema"),
        ({"text": {"verbosity": 5}}, "text.verbosity"),
        ({"reasoning": {"effort": 5}}, "reasoning.effort"),
        ({"reasoning": {"summary": []}}, "reasoning.summary"),
        ({"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ],
)
async def test_an_unused_option_of_the_wrong_type_was_accepted_and_echoed_back(
    live: ServerProcess, sent: dict[str, Any], param: str
) -> None:
    """`include: 5`, `text: {"format": 5}`, `reasoning: {"effort": 5}` were taken, stored with the
    response and echoed back on every read: the API refuses them as 400 `invalid_type` naming the
    parameter, worded as the chat completions door words it."""
    user, client = await client_for(live)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="hi", stream=stream, extra_body=sent)
        payload = caught.value.body
        assert isinstance(payload, dict) and payload["type"] == "invalid_request_error", payload
        assert payload["param"] == param and payload["code"] == "invalid_type", payload
        assert payload["message"].startswith(f"Invalid type for '{param}': expected "), payload
        assert caught.value.status_code == 400
    assert await conversations(live, user) == []


async def test_unused_options_of_the_right_type_are_still_accepted_and_echoed(live: ServerProcess) -> None:
    _user, client = await client_for(live)
    text: Any = {
        "format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True},
        "verbosity": "low",
    }
    reasoning: Any = {"effort": "low", "summary": "auto"}
    response = client.responses.create(
        model=MODEL, input="hi", text=text, reasoning=reasoning, include=["reasoning.encrypted_content"]
    )
    for seen in (response, client.responses.retrieve(response.id)):
        assert seen.text.model_dump(by_alias=True, exclude_none=True) == text
        assert seen.reasoning is not None and seen.reasoning.model_dump(exclude_none=True) == reasoning


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_file", "filename": "a.pdf", "file_data": "not base64!"}, "file_data"),
        ({"type": "input_file", "filename": "a.txt", "file_data": "data:text/plain,hello"}, "file_data"),
        ({"type": "input_image", "image_url": "data:image/png;base64,@@@@"}, "image_url"),
    ],
)
async def test_an_attachment_that_is_not_base64_was_stored_and_sent_to_the_model(
    live: ServerProcess, part: dict[str, Any], param: str
) -> None:
    """A file or image data: URL whose data was not base64 was stored with the user's message and
    given to the model, which refuses it: a failed reply after its stream began. It is a 400
    naming the part, before any stream, with nothing stored."""
    user, client = await client_for(live)
    content = [part, {"type": "input_text", "text": "what is this?"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model=MODEL,
                input=[{"role": "user", "content": content}],  # type: ignore[list-item]
                stream=stream,
            )
        payload = caught.value.body
        assert isinstance(payload, dict) and payload["param"] == f"input[0].content[0].{param}", payload
        assert payload["type"] == "invalid_request_error"
    assert await conversations(live, user) == []


async def test_a_response_sent_again_with_its_idempotency_key_had_a_new_created_at(
    live: ServerProcess,
) -> None:
    """A request sent again with its Idempotency-Key reattached to the reply it started, but
    the answer's created_at was the second request's time: not the response it names."""
    user, client = await client_for(live)
    key = {"Idempotency-Key": f"again-{user}"}
    first = client.responses.create(model=MODEL, input="once, please", extra_headers=key)
    await wait_until(lambda: int(time.time()) > first.created_at, what="a later second")
    again = client.responses.create(model=MODEL, input="once, please", extra_headers=key)
    assert again.id == first.id
    assert again.created_at == first.created_at == client.responses.retrieve(first.id).created_at
    assert text_of(again.output) == text_of(first.output)
    [conversation] = await conversations(live, user)
    assert [t["role"] for t in await turns(live, user, conversation["id"])] == ["user", "assistant"]


async def test_another_users_conversation_was_a_404_naming_no_param(live: ServerProcess) -> None:
    """A `conversation` id that is well formed but not the caller's was refused as chatmem's
    `conversation not found`, param null, where a malformed one names `conversation`."""
    _owner, client = await client_for(live)
    made = client.responses.with_raw_response.create(model=MODEL, input="mine")
    theirs = f"conv_{uuid.UUID(made.headers['x-chatmem-conversation-id']).hex}"
    intruder, other = await client_for(live)
    for conversation in (theirs, "conv_not-an-id"):
        with pytest.raises(openai.NotFoundError) as refused:
            other.responses.create(model=MODEL, input="hi", conversation=conversation)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "conversation", error
        assert error["code"] == "not_found"
        assert error["message"] == f"Conversation with id '{conversation}' not found."
    assert await conversations(live, intruder) == []
