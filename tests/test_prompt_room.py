"""A client's system prompt that leaves the reply no room in the prompt is refused, on every door.

Found: a system prompt (chat completions' system/developer messages, the Responses API's
`instructions` and system items, the AI SDK's system messages, AG-UI's system messages and
context) that, with chatmem's own and the new message, filled CONTEXT_MAX_TOKENS less the
reply's reserve was accepted; the history got no room and the prompt went to the model over
the budget. Now it is refused in the door's error shape (the OpenAI doors' 400, driven by the
`openai` SDK; chatmem's 422 on the AI SDK and AG-UI doors, whose refusals come before any
stream as JSON), naming the field as the client sent it, with nothing stored.

Found too: a new message that alone (with chatmem's system prompt and the time) filled that room
was accepted and sent whole, over the budget, whatever system text was beside it; the model
server refused or cut it mid-stream. Now it is refused the same way, as OpenAI answers a prompt
over a model's context (`context_length_exceeded`), naming the message and saying how many
tokens it is and how many fit: over HTTP and the Responses WebSocket, on continued chats, and
on chatmem's own API.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import func, select

from memory.prompt.context import MESSAGE_OVERHEAD_TOKENS
from memory.prompt.tokens import count_tokens
from memory.storage.db import Database
from memory.storage.models import Conversation, OutboxRow, Turn
from tests.conftest import LiveServer, token_for
from tests.fake_openai import FakeOpenAI, Reply

# A prompt may take 2,400 - 1,024 = 1,376 tokens; chatmem's own system prompt takes ~285 of them.
MAX_TOKENS, RESERVE = 2400, 1024
TOO_LONG = "Be precise and name your sources. " * 200  # ~1,700 tokens
FITS = "Be precise and name your sources. " * 100  # ~850 tokens
LONG_QUESTION = "alpha beta gamma delta " * 60 + "which letter comes next?"  # ~350 tokens
# ~1,600 tokens (9,200 characters, well within MAX_MESSAGE_CHARS): alone over the room.
HUGE_QUESTION = "alpha beta gamma delta " * 400 + "which letter comes next?"


async def served(start_server: Any, fake_openai: FakeOpenAI) -> LiveServer:
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
        context_max_tokens=MAX_TOKENS,
        reply_reserve_tokens=RESERVE,
    )
    return server


async def client_for(start_server: Any, fake_openai: FakeOpenAI) -> AsyncOpenAI:
    server = await served(start_server, fake_openai)
    return AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)


async def stored(db: Database) -> tuple[int, int, int]:
    """(conversations, turns, outbox rows) in the database."""
    async with db.transaction() as session:
        counts = [
            (await session.execute(select(func.count()).select_from(table))).scalar_one()
            for table in (Conversation, Turn, OutboxRow)
        ]
    return counts[0], counts[1], counts[2]


def refused(error: pytest.ExceptionInfo[openai.BadRequestError], param: str) -> None:
    assert error.value.status_code == 400
    body: Any = error.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error", body
    assert body["code"] == "context_length_exceeded" and "system prompt is too long" in body["message"], body


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chat_completion_whose_system_prompt_leaves_no_room_is_refused_not_sent_over_the_budget(
    start_server: Any, fake_openai: FakeOpenAI, db: Database, stream: bool
) -> None:
    client = await client_for(start_server, fake_openai)
    assert count_tokens(TOO_LONG) > MAX_TOKENS - RESERVE
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(
            model="fake-model",
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "system", "content": TOO_LONG},
                {"role": "user", "content": "hi"},
            ],
            stream=stream,
        )
    refused(error, "messages[1].content")  # the longer of the two system texts
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_responses_instructions_that_leave_no_room_are_refused_not_sent_over_the_budget(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(model="fake-model", instructions=TOO_LONG, input="hi")
    refused(error, "instructions")
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(
            model="fake-model",
            instructions="Be brief.",
            input=[{"role": "developer", "content": TOO_LONG}, {"role": "user", "content": "hi"}],
            stream=True,
        )
    refused(error, "input[0].content")
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_a_continued_chat_whose_system_prompt_and_new_message_no_longer_fit_is_refused(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="Noted."))
    first: list[Any] = [{"role": "system", "content": FITS}, {"role": "user", "content": "hi"}]
    kept = {"X-Chatmem-Chat-Key": "room"}
    answer = await client.chat.completions.create(model="fake-model", messages=first, extra_headers=kept)
    assert answer.choices[0].message.content == "Noted."
    before = await stored(db)
    assert before[0] == 1 and before[1] == 2

    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(
            model="fake-model",
            messages=[
                *first,
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": LONG_QUESTION},
            ],
            extra_headers=kept,
        )
    refused(error, "messages[0].content")
    assert await stored(db) == before and len(fake_openai.requests) == 1

    # The same question without the system prompt fits, and is answered in the same conversation.
    await client.chat.completions.create(
        model="fake-model",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": LONG_QUESTION},
        ],
        extra_headers=kept,
    )
    after = await stored(db)
    assert after[0] == 1 and after[1] == 4


async def test_a_response_continued_with_instructions_and_a_new_message_that_no_longer_fit_is_refused(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="Noted."))
    first = await client.responses.create(model="fake-model", instructions=FITS, input="hi")
    assert first.output_text == "Noted."
    before = await stored(db)
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(
            model="fake-model", instructions=FITS, input=LONG_QUESTION, previous_response_id=first.id
        )
    refused(error, "instructions")
    assert await stored(db) == before and len(fake_openai.requests) == 1


async def test_an_ai_sdk_system_message_that_leaves_no_room_is_refused_not_sent_over_the_budget(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    server = await served(start_server, fake_openai)
    system = {"id": "s1", "role": "system", "parts": [{"type": "text", "text": TOO_LONG}]}
    user = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
    for trigger in ("submit-message", "regenerate-message"):
        body = {"id": "chat-room", "trigger": trigger, "messages": [system, user]}
        async with server.client() as api:
            refused = await api.post("/v1/ai-sdk/chat", json=body)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["details"]["field"] == "messages[0].parts"
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


@pytest.mark.parametrize("where", ["messages", "context"])
async def test_an_ag_ui_system_message_or_context_that_leaves_no_room_is_refused_not_sent_over_the_budget(
    start_server: Any, fake_openai: FakeOpenAI, db: Database, where: str
) -> None:
    server = await served(start_server, fake_openai)
    user = {"id": "u1", "role": "user", "content": "hi"}
    body: dict[str, Any] = {"threadId": str(uuid.uuid4()), "runId": "r1", "messages": [user]}
    if where == "context":
        body["context"] = [{"description": "notes", "value": TOO_LONG}]
    else:
        body["messages"] = [{"id": "s1", "role": "developer", "content": TOO_LONG}, user]
    async with server.client() as api:
        refused = await api.post("/v1/ag-ui", json=body)
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    field = "context[0]" if where == "context" else "messages[0].content"
    assert error["code"] == "context_length_exceeded" and error["details"]["field"] == field
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


def refused_as_too_long(body: Any, param: str) -> None:
    """The question was refused as OpenAI refuses a prompt over its context, saying how long it is
    and how much fits; chatmem's own API and the AI SDK and AG-UI doors say the same in their shape."""
    named = body["param"] if "param" in body else body["details"]["field"]
    assert named == param, body
    assert body["code"] == "context_length_exceeded", body
    counted = re.search(r"comes to ~(\d+) tokens and at most (\d+) fit", body["message"])
    assert counted is not None, body
    assert int(counted[1]) == count_tokens(HUGE_QUESTION) + MESSAGE_OVERHEAD_TOKENS
    # chatmem's system prompt and the time take a few hundred tokens of the 1,376.
    assert MAX_TOKENS - RESERVE - 500 < int(counted[2]) < MAX_TOKENS - RESERVE < int(counted[1])


def openai_refused(error: pytest.ExceptionInfo[openai.BadRequestError], param: str) -> None:
    assert error.value.status_code == 400
    body: Any = error.value.body
    assert body["type"] == "invalid_request_error", body
    refused_as_too_long(body, param)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_question_that_alone_fills_the_room_was_sent_whole_with_or_without_a_system_prompt(
    start_server: Any, fake_openai: FakeOpenAI, db: Database, stream: bool
) -> None:
    """A short system prompt beside it is not what is too long: the question is named either way."""
    client = await client_for(start_server, fake_openai)
    assert count_tokens(HUGE_QUESTION) > MAX_TOKENS - RESERVE
    for system in ([{"role": "developer", "content": "Be brief."}], []):
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(
                model="fake-model",
                messages=[*system, {"role": "user", "content": HUGE_QUESTION}],
                stream=stream,
            )
        openai_refused(error, f"messages[{len(system)}].content")
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_a_responses_input_that_alone_fills_the_room_was_sent_whole_to_the_model(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(model="fake-model", instructions="Be brief.", input=HUGE_QUESTION)
    openai_refused(error, "input")
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(
            model="fake-model",
            input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": HUGE_QUESTION}],
            stream=True,
        )
    openai_refused(error, "input[1].content")
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_a_continued_chat_or_response_whose_new_message_alone_fills_the_room_is_refused(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="Noted."), Reply(text="Noted."))
    first: list[Any] = [{"role": "user", "content": "hi"}]
    kept = {"X-Chatmem-Chat-Key": "room"}
    await client.chat.completions.create(model="fake-model", messages=first, extra_headers=kept)
    response = await client.responses.create(model="fake-model", input="hi")
    before = await stored(db)
    assert before[0] == 2 and before[1] == 4
    requests = len(fake_openai.requests)

    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(
            model="fake-model",
            messages=[
                *first,
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": HUGE_QUESTION},
            ],
            extra_headers=kept,
        )
    openai_refused(error, "messages[2].content")
    with pytest.raises(openai.BadRequestError) as error:
        await client.responses.create(
            model="fake-model",
            input=[{"role": "user", "content": HUGE_QUESTION}],
            previous_response_id=response.id,
            stream=True,
        )
    openai_refused(error, "input[0].content")
    assert await stored(db) == before and len(fake_openai.requests) == requests


async def test_a_responses_websocket_message_that_alone_fills_the_room_is_an_error_and_the_connection_goes_on(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    client = await client_for(start_server, fake_openai)
    fake_openai.script(Reply(text="Epsilon."))
    async with client.responses.connect() as connection:
        await connection.response.create(model="fake-model", input=HUGE_QUESTION)
        refused = await connection.recv()
        assert refused.type == "error" and refused.status == 400, refused  # type: ignore[union-attr]
        refused_as_too_long(refused.error.model_dump(), "input")  # type: ignore[union-attr]
        assert await stored(db) == (0, 0, 0) and fake_openai.requests == []
        await connection.response.create(model="fake-model", input="which letter comes next?")
        async for event in connection:
            if event.type in ("response.completed", "response.failed", "error"):
                assert event.type == "response.completed", event
                break
    assert (await stored(db))[:2] == (1, 2)


async def test_an_ai_sdk_or_ag_ui_message_that_alone_fills_the_room_was_sent_whole_to_the_model(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    server = await served(start_server, fake_openai)
    system = {"id": "s1", "role": "system", "parts": [{"type": "text", "text": "Be brief."}]}
    user = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": HUGE_QUESTION}]}
    ai_sdk = {"id": "chat-room", "trigger": "submit-message", "messages": [system, user]}
    ag_ui = {
        "threadId": str(uuid.uuid4()),
        "runId": "r1",
        "messages": [
            {"id": "s1", "role": "system", "content": "Be brief."},
            {"id": "u1", "role": "user", "content": HUGE_QUESTION},
        ],
    }
    for path, body, field in (
        ("/v1/ai-sdk/chat", ai_sdk, "messages[1].parts"),
        ("/v1/ag-ui", ag_ui, "messages[1].content"),
    ):
        async with server.client() as api:
            refused = await api.post(path, json=body)
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"].startswith("application/json")
        refused_as_too_long(refused.json()["error"], field)
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_a_chatmem_api_message_or_edit_that_alone_fills_the_room_was_sent_whole_to_the_model(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    server = await served(start_server, fake_openai)
    fake_openai.script(Reply(text="Noted."))
    async with server.client() as api:
        conversation = (await api.post("/v1/conversations", json={})).json()["id"]
        answered = await api.post(
            f"/v1/conversations/{conversation}/messages", json={"content": "hi", "stream": False}
        )
        assert answered.status_code == 200, answered.text
        user_turn = answered.json()["user_turn"]["id"]
        before = await stored(db)
        requests = len(fake_openai.requests)
        for path in (f"/v1/conversations/{conversation}/messages", f"/v1/turns/{user_turn}/edit"):
            refused = await api.post(path, json={"content": HUGE_QUESTION})
            assert refused.status_code == 422, refused.text
            refused_as_too_long(refused.json()["error"], "content")
    assert await stored(db) == before and len(fake_openai.requests) == requests
