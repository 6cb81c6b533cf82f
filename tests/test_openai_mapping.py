"""Which chatmem conversation an OpenAI-style request lands in, with the `openai` SDK on a live server.

The frontend owns the history it sends. With no conversation id, chatmem finds the
conversation by that history: the same history continues it, a changed last message
is an edit (a new branch), the same last message again is a regenerate (a new
branch), and an unknown history becomes a new conversation with its earlier messages
imported. A frontend's own chat id (a header) names one conversation per user.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import auth
from tests.openai_support import MODEL, TENANT, ended_turns, make_key, new_user, sdk
from tests.procs import ServerProcess, server_process
from tests.support import wait_until


@pytest.fixture(scope="module")
async def live(pg_url: str) -> AsyncIterator[ServerProcess]:
    async with server_process(pg_url, demo_tokens_per_second=400) as proc:
        yield proc


def ask(client: OpenAI, messages: list[dict[str, Any]], **headers: str) -> tuple[str, str]:
    """(conversation id, answer text) of one non-streaming request."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, extra_headers=headers or None
    )
    return raw.headers["x-chatmem-conversation-id"], raw.parse().choices[0].message.content or ""


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


async def branches(live: ServerProcess, owner: str, conversation_id: str) -> list[dict[str, Any]]:
    async with live.client(TENANT, owner) as api:
        return list((await api.get(f"/v1/conversations/{conversation_id}/branches")).json()["items"])


async def history(live: ServerProcess, owner: str, conversation_id: str) -> list[tuple[str, str]]:
    return [(t["role"], t["content"]) for t in await ended_turns(live, owner, conversation_id)]


async def test_the_same_history_continues_the_conversation(live: ServerProcess) -> None:
    owner = new_user()
    client = sdk(live, await make_key(live, owner))
    first, a1 = ask(client, [user("what is a vole?")])
    second, a2 = ask(client, [user("what is a vole?"), assistant(a1), user("and a shrew?")])
    assert second == first
    # Whitespace the frontend trimmed or reflowed does not matter.
    third, _ = ask(
        client,
        [
            user("what is a vole?"),
            assistant(f"  {a1}\n"),
            user("and a shrew?"),
            assistant(a2),
            user("thanks"),
        ],
    )
    assert third == first
    assert [role for role, _ in await history(live, owner, first)] == ["user", "assistant"] * 3
    assert len(await branches(live, owner, first)) == 1


async def test_a_changed_last_message_is_an_edit_on_a_new_branch(live: ServerProcess) -> None:
    owner = new_user()
    client = sdk(live, await make_key(live, owner))
    conversation, a1 = ask(client, [user("plan a trip")])
    ask(client, [user("plan a trip"), assistant(a1), user("to Rome")])
    edited, answer = ask(client, [user("plan a trip"), assistant(a1), user("to Lisbon")])
    assert edited == conversation
    assert "to Lisbon" in answer
    stored = await history(live, owner, conversation)
    assert stored == [
        ("user", "plan a trip"),
        ("assistant", a1),
        ("user", "to Lisbon"),
        ("assistant", answer),
    ]
    assert len(await branches(live, owner, conversation)) == 2


async def test_the_same_last_message_again_is_a_regenerate(live: ServerProcess) -> None:
    owner = new_user()
    client = sdk(live, await make_key(live, owner))
    conversation, a1 = ask(client, [user("name a colour")])
    ask(client, [user("name a colour"), assistant(a1), user("another one")])
    before = await ended_turns(live, owner, conversation)
    again, _ = ask(client, [user("name a colour"), assistant(a1), user("another one")])
    assert again == conversation
    after = await ended_turns(live, owner, conversation)
    assert [t["role"] for t in after] == ["user", "assistant", "user", "assistant"]
    assert after[2]["id"] == before[2]["id"]  # the same stored question, answered again
    assert after[3]["id"] != before[3]["id"]
    assert len(await branches(live, owner, conversation)) == 2


async def test_an_unknown_history_is_imported_into_a_new_conversation(live: ServerProcess) -> None:
    owner = new_user()
    client = sdk(live, await make_key(live, owner))
    messages = [user("I keep bees"), assistant("Lovely, how many hives?"), user("three, any tips?")]
    conversation, answer = ask(client, messages)
    stored = await history(live, owner, conversation)
    assert stored == [
        ("user", "I keep bees"),
        ("assistant", "Lovely, how many hives?"),
        ("user", "three, any tips?"),
        ("assistant", answer),
    ]
    # Another user sending the same history gets their own conversation.
    stranger = new_user()
    theirs, _ = ask(sdk(live, await make_key(live, stranger)), messages)
    assert theirs != conversation


async def test_a_frontend_chat_id_names_one_conversation_per_user(live: ServerProcess) -> None:
    owner, other = new_user(), new_user()
    client = sdk(live, await make_key(live, owner))
    chat_id = str(uuid.uuid4())
    first, _ = ask(client, [user("hello")], **{"X-OpenWebUI-Chat-Id": chat_id})
    # Even a history that does not match goes to the conversation the chat id names.
    second, _ = ask(
        client, [user("hello"), assistant("something else"), user("hm")], **{"X-OpenWebUI-Chat-Id": chat_id}
    )
    assert second == first
    third, _ = ask(client, [user("hello")], **{"X-Chatmem-Chat-Key": "librechat-123"})
    assert third != first
    theirs, _ = ask(
        sdk(live, await make_key(live, other)), [user("hello")], **{"X-OpenWebUI-Chat-Id": chat_id}
    )
    assert theirs != first
    assert len(await branches(live, owner, first)) == 2  # the mismatched history branched


async def test_a_first_message_alone_starts_a_new_conversation(live: ServerProcess) -> None:
    owner = new_user()
    client = sdk(live, await make_key(live, owner))
    first, _ = ask(client, [user("hi")])
    second, _ = ask(client, [user("hi")])
    assert first != second


@pytest.mark.parametrize("stopped_reply_sent_as", ["left out", "empty"])
async def test_a_history_whose_reply_was_stopped_before_any_text_continues_its_conversation(
    start_server: Any, stopped_reply_sent_as: str
) -> None:
    # The stored history was one message (its reply, stopped before its first token, shows
    # nothing), fewer than the question and answer a match needed: the next request started a
    # copy of the conversation with the first message imported again (twice in memory).
    server = await start_server(demo_first_token_delay_seconds=60)
    owner = new_user()
    token = auth(TENANT, owner)["Authorization"].removeprefix("Bearer ")
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token, max_retries=0)

    async def stopped_before_any_text(messages: list[dict[str, Any]]) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, stream=True
        )
        await raw.parse().close()  # the Stop button, before the first token
        return raw.headers["x-chatmem-conversation-id"]

    async def stored() -> list[tuple[str, str, str]]:
        async with server.client(TENANT, owner) as api:
            turns = (await api.get(f"/v1/conversations/{first}/turns")).json()["items"]
        ended = all(t["status"] != "streaming" for t in turns)
        return [(t["role"], t["status"], t["content"]) for t in turns] if ended else []

    first = await stopped_before_any_text([user("what is a vole?")])
    await wait_until(stored, what="the stopped reply's ending")
    sent_back = [assistant("")] if stopped_reply_sent_as == "empty" else []
    second = await stopped_before_any_text([user("what is a vole?"), *sent_back, user("and a shrew?")])
    assert second == first
    assert await wait_until(stored, what="the second reply's ending") == [
        ("user", "completed", "what is a vole?"),
        ("assistant", "interrupted_by_user", ""),
        ("user", "completed", "and a shrew?"),
        ("assistant", "interrupted_by_user", ""),
    ]
    async with server.client(TENANT, owner) as api:
        assert len((await api.get("/v1/conversations")).json()["items"]) == 1
        context = (await api.get(f"/v1/conversations/{first}/context")).json()["messages"]
    # The next prompt holds both questions and nothing empty or half made.
    assert [m["role"] for m in context if m["role"] != "system"] == ["user", "user"]
    assert all(m["content"] for m in context)
