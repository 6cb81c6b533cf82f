"""A client's system prompt that leaves the reply no room in the prompt is refused, on every door.

Found: a system prompt (chat completions' system/developer messages, the Responses API's
`instructions` and system items, the AI SDK's system messages, AG-UI's system messages and
context) that, with chatmem's own and the new message, filled CONTEXT_MAX_TOKENS less the
reply's reserve was accepted; the history got no room and the prompt went to the model over
the budget. Now it is refused in the door's error shape (the OpenAI doors' 400, driven by the
`openai` SDK; chatmem's 422 on the AI SDK and AG-UI doors, whose refusals come before any
stream as JSON), naming the field as the client sent it, with nothing stored.
"""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from sqlalchemy import func, select

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
    assert body["code"] == "invalid_input" and "system prompt is too long" in body["message"], body


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
        assert error["code"] == "invalid_input" and error["details"]["field"] == "messages[0].parts"
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
    assert error["code"] == "invalid_input" and error["details"]["field"] == field
    assert await stored(db) == (0, 0, 0) and fake_openai.requests == []


async def test_a_short_system_prompt_beside_a_question_that_alone_fills_the_room_was_refused_as_too_long(
    start_server: Any, fake_openai: FakeOpenAI, db: Database
) -> None:
    """The system text is not what does not fit: the question is answered as it is without one."""
    client = await client_for(start_server, fake_openai)
    question = "alpha beta gamma delta " * 400 + "which letter comes next?"
    assert count_tokens(question) > MAX_TOKENS - RESERVE
    fake_openai.script(Reply(text="Epsilon."), Reply(text="Epsilon."))
    for system in ([{"role": "developer", "content": "Be brief."}], []):
        answer = await client.chat.completions.create(
            model="fake-model", messages=[*system, {"role": "user", "content": question}]
        )
        assert answer.choices[0].message.content == "Epsilon."
    assert len(fake_openai.requests) == 2 and (await stored(db))[1] == 4
