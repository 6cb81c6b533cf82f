"""A long conversation's history is read a page at a time, over real HTTP and Postgres.

`GET /v1/conversations/{id}/turns` used to answer every turn of the branch in one response:
3 MB and 0.3 s for 5,000 imported turns, growing with every message. An AG-UI message read
the whole thread (and made AG-UI messages of it) under the conversation's lock to find the
message it follows: 0.5 s to the first token at 5,000 turns, against 0.18 s at 100.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from openai import AsyncOpenAI
from sqlalchemy import event

from memory.record.branches import encode_history_cursor
from memory.storage.models import Turn
from tests.conftest import LiveServer, token_for
from tests.sse import iter_sse
from tests.support import new_conversation

TURNS = 1_200


async def imported(client: httpx.AsyncClient, count: int) -> str:
    conversation = await new_conversation(client)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(count)]
    r = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": turns})
    assert r.status_code == 201, r.text
    return conversation


async def page(client: httpx.AsyncClient, conversation: str, **params: Any) -> dict[str, Any]:
    r = await client.get(f"/v1/conversations/{conversation}/turns", params=params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def whole_history(client: httpx.AsyncClient, conversation: str, **params: Any) -> list[str]:
    """Every turn's content, oldest first, read newest page first as a chat page scrolls up."""
    pages: list[list[str]] = []
    cursor = None
    while True:
        body = await page(client, conversation, **params, **({"cursor": cursor} if cursor else {}))
        pages.insert(0, [t["content"] for t in body["items"]])
        cursor = body["next_cursor"]
        if cursor is None:
            return [content for items in pages for content in items]


async def test_a_long_conversations_turns_come_in_bounded_pages_newest_first(server: LiveServer) -> None:
    async with server.client() as client:
        conversation = await imported(client, TURNS)

        first = await page(client, conversation)
        assert [t["content"] for t in first["items"]] == [f"message {i}" for i in range(TURNS - 100, TURNS)]
        assert first["next_cursor"] is not None

        assert await whole_history(client, conversation, limit=500) == [f"message {i}" for i in range(TURNS)]

        url = f"/v1/conversations/{conversation}/turns"
        too_many = await client.get(url, params={"limit": 501})
        assert too_many.status_code == 422, too_many.text
        bad = await client.get(url, params={"cursor": "bm90IGEgY3Vyc29y"})  # "not a cursor"
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["code"] == "invalid_input"


async def ui_messages_page(
    client: httpx.AsyncClient, chat: str, **params: Any
) -> tuple[list[dict[str, Any]], str | None]:
    r = await client.get(f"/v1/ai-sdk/chat/{chat}/messages", params=params)
    assert r.status_code == 200, r.text
    return r.json(), r.headers.get("X-Chatmem-Next-Cursor")


def texts(messages: list[dict[str, Any]]) -> list[str]:
    return [" ".join(p["text"] for p in m["parts"] if p["type"] == "text") for m in messages]


async def test_an_ai_sdk_chats_messages_come_in_bounded_pages_newest_first(server: LiveServer) -> None:
    """`GET /v1/ai-sdk/chat/{id}/messages` answered every message of the chat: 1.45 MB at 5,000
    turns, growing with every message. It pages as GET …/turns does, the cursor in a header so
    that the body stays the `UIMessage[]` useChat takes."""
    async with server.client() as client:
        chat = await imported(client, TURNS)

        newest, cursor = await ui_messages_page(client, chat)
        assert texts(newest) == [f"message {i}" for i in range(TURNS - 100, TURNS)]
        assert cursor is not None

        pages: list[list[str]] = []
        cursor = None
        while True:
            messages, cursor = await ui_messages_page(
                client, chat, limit=500, **({"cursor": cursor} if cursor else {})
            )
            pages.insert(0, texts(messages))
            if cursor is None:
                break
        assert [t for items in pages for t in items] == [f"message {i}" for i in range(TURNS)]
        assert [len(items) for items in pages] == [200, 500, 500]

        url = f"/v1/ai-sdk/chat/{chat}/messages"
        for limit in (0, 501):
            refused = await client.get(url, params={"limit": limit})
            assert refused.status_code == 422, refused.text
        bad = await client.get(url, params={"cursor": "bm90IGEgY3Vyc29y"})  # "not a cursor"
        assert bad.status_code == 422, bad.text
        assert bad.json()["error"]["code"] == "invalid_input"


async def test_a_page_of_ai_sdk_messages_makes_no_orm_object_of_each_stored_turn(server: LiveServer) -> None:
    """A page of 500 messages was read as some 1,000 Turn objects, made on the event loop (~14 ms of
    its CPU), stalling every other stream of the process; a row of the columns a message uses is enough."""
    async with server.client() as client:
        chat = await imported(client, TURNS)
        with turns_loaded() as loaded:
            messages, cursor = await ui_messages_page(client, chat, limit=500)
        assert texts(messages) == [f"message {i}" for i in range(TURNS - 500, TURNS)]
        assert cursor is not None
        assert loaded[0] == 0, f"{loaded[0]} Turn objects made for a page of 500 messages"


async def test_a_reply_of_several_steps_is_one_message_on_a_page_of_ai_sdk_messages(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        chat = await imported(client, 4)
        # A reply with a tool step: an assistant turn with the call, the tool's turn, the answer.
        body = {
            "id": chat,
            "trigger": "submit-message",
            "messages": [
                {"id": "ask-time", "role": "user", "parts": [{"type": "text", "text": "what time is it?"}]}
            ],
        }
        async with client.stream("POST", "/v1/ai-sdk/chat", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for _ in iter_sse(response):
                pass
        turns = (await page(client, chat))["items"]
        assert [t["role"] for t in turns[-3:]] == ["assistant", "tool", "assistant"]

        reply, cursor = await ui_messages_page(client, chat, limit=1)
        assert [m["role"] for m in reply] == ["assistant"]
        assert {p["type"] for p in reply[0]["parts"]} >= {"tool-current_time", "text"}
        asked, cursor = await ui_messages_page(client, chat, limit=1, cursor=cursor)
        assert [m["id"] for m in asked] == ["ask-time"]
        rest, cursor = await ui_messages_page(client, chat, limit=10, cursor=cursor)
        assert texts(rest) == [f"message {i}" for i in range(4)] and cursor is None
        whole, _ = await ui_messages_page(client, chat)
        assert whole == [*rest, *asked, *reply]


async def test_pages_of_an_edited_branch_and_of_a_fork_follow_their_own_history(server: LiveServer) -> None:
    async with server.client() as client:
        conversation = await imported(client, 300)
        items = (await page(client, conversation, limit=300))["items"]
        edited = await client.post(
            f"/v1/turns/{items[150]['id']}/edit", json={"content": "message 150, edited", "stream": False}
        )
        assert edited.status_code == 200, edited.text
        fork = await client.post(f"/v1/conversations/{conversation}/fork", json={"turn_id": items[99]["id"]})
        assert fork.status_code == 201, fork.text

        history = await whole_history(client, conversation, limit=7)
        assert history[:151] == [f"message {i}" for i in range(150)] + ["message 150, edited"]
        assert len(history) == 152  # the edit's reply ends it
        listed = await client.get(f"/v1/conversations/{conversation}/branches")
        root = next(b["id"] for b in listed.json()["items"] if b["parent_branch_id"] is None)
        original = await whole_history(client, conversation, limit=7, branch=root)
        assert original == [f"message {i}" for i in range(300)]
        assert await whole_history(client, fork.json()["id"], limit=7) == [f"message {i}" for i in range(100)]


@contextmanager
def turns_loaded() -> Iterator[list[int]]:
    """How many stored turns the server process reads into objects inside the block."""
    loaded = [0]

    def count(*_: Any) -> None:
        loaded[0] += 1

    event.listen(Turn, "load", count)
    try:
        yield loaded
    finally:
        event.remove(Turn, "load", count)


async def ag_ui_run(client: httpx.AsyncClient, thread: str, messages: list[dict[str, Any]]) -> None:
    body = {"threadId": thread, "runId": str(uuid.uuid4()), "messages": messages}
    async with client.stream("POST", "/v1/ag-ui", json=body) as response:
        assert response.status_code == 200, await response.aread()
        types = [item.data["type"] async for item in iter_sse(response)]
    assert types[-1] == "RUN_FINISHED", types


async def test_an_ag_ui_message_on_a_long_thread_does_not_read_the_whole_thread(server: LiveServer) -> None:
    async with server.client() as client:
        thread = await imported(client, TURNS)
        newest = (await page(client, thread, limit=1))["items"][0]
        said = {"id": str(uuid.uuid4()), "role": "user", "content": "and the next one?"}
        with turns_loaded() as loaded:
            await ag_ui_run(client, thread, [{"id": newest["id"], "role": "assistant", "content": "…"}, said])
        assert loaded[0] < 200, loaded[0]
        history = await whole_history(client, thread, limit=500)
        assert history[: TURNS + 1] == [f"message {i}" for i in range(TURNS)] + ["and the next one?"]

        # A client whose history ends earlier edits from there (found pages back), on a new branch.
        ninth = (await page(client, thread, cursor=encode_history_cursor(11)))["items"][-1]  # seqs start at 1
        assert ninth["content"] == "message 9"
        edit = {"id": str(uuid.uuid4()), "role": "user", "content": "an edit after message 9"}
        await ag_ui_run(client, thread, [{"id": ninth["id"], "role": "assistant", "content": "…"}, edit])
        history = await whole_history(client, thread, limit=500)
        assert history[:11] == [f"message {i}" for i in range(10)] + ["an edit after message 9"]
        assert len(history) == 12  # and its reply


async def test_a_client_tool_result_on_a_long_thread_does_not_read_the_whole_thread(
    server: LiveServer,
) -> None:
    tools = [{"name": "get_weather", "description": "The weather", "parameters": {"type": "object"}}]
    async with server.client() as client:
        thread = await imported(client, TURNS)
        newest = (await page(client, thread, limit=1))["items"][0]
        ask = {"id": str(uuid.uuid4()), "role": "user", "content": '/tool get_weather {"city": "Oslo"}'}
        sent = [{"id": newest["id"], "role": "assistant", "content": "…"}, ask]
        body = {"threadId": thread, "runId": str(uuid.uuid4()), "messages": sent, "tools": tools}
        async with client.stream("POST", "/v1/ag-ui", json=body) as response:
            events = [item.data async for item in iter_sse(response)]
        start = next(e for e in events if e["type"] == "TOOL_CALL_START")
        call = {
            "id": start["toolCallId"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
        answer = {"id": str(uuid.uuid4()), "role": "tool", "toolCallId": call["id"], "content": "sunny, 21 C"}
        with turns_loaded() as loaded:
            await ag_ui_run(
                client,
                thread,
                [*sent, {"id": start["parentMessageId"], "role": "assistant", "toolCalls": [call]}, answer],
            )
        assert loaded[0] < 200, loaded[0]
        stored = (await page(client, thread, limit=5))["items"]
        assert [t["content"] for t in stored if t["role"] == "tool"] == ["sunny, 21 C"]
        assert stored[-1]["role"] == "assistant" and stored[-1]["status"] == "completed"


async def test_an_ai_sdk_edit_of_a_recent_message_on_a_long_chat_does_not_read_the_whole_chat(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        chat = await imported(client, TURNS)
        last_user = (await page(client, chat, limit=2))["items"][0]
        assert last_user["role"] == "user"
        edited = {
            "id": last_user["id"],
            "role": "user",
            "parts": [{"type": "text", "text": "edited last question"}],
        }
        body = {"id": chat, "trigger": "submit-message", "messageId": last_user["id"], "messages": [edited]}
        with turns_loaded() as loaded:
            async with client.stream("POST", "/v1/ai-sdk/chat", json=body) as response:
                assert response.status_code == 200, await response.aread()
                parts = [item.data async for item in iter_sse(response)]
        assert loaded[0] < 200, loaded[0]
        assert parts[-1] == "[DONE]" or parts[-1].get("type") == "finish", parts[-3:]
        history = await whole_history(client, chat, limit=500)
        assert history[-2] == "edited last question"
        assert history[: TURNS - 2] == [f"message {i}" for i in range(TURNS - 2)]


async def test_finding_the_conversation_a_sent_history_continues_does_not_read_every_candidate_whole(
    server: LiveServer,
) -> None:
    """An OpenAI-style request without a conversation id read the whole history of each of up to
    20 conversations that began with the same message, to compare them with the one sent."""
    async with server.client() as client:
        candidates = [await imported(client, 600) for _ in range(6)]
    sdk = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0, timeout=30)
    sent = [
        {"role": "user", "content": "message 0"},
        {"role": "assistant", "content": "message 1"},
        {"role": "user", "content": "message 2"},
        {"role": "assistant", "content": "message 3"},
        {"role": "user", "content": "not message 4"},
    ]
    with turns_loaded() as loaded:
        raw = await sdk.chat.completions.with_raw_response.create(model="chatmem-demo", messages=sent)  # type: ignore[arg-type]
    assert loaded[0] < 300, loaded[0]
    # The same choice as before: the newest of the equally matching conversations, edited after message 3.
    chosen = raw.headers["x-chatmem-conversation-id"]
    assert chosen == candidates[-1]
    async with server.client() as client:
        history = await whole_history(client, chosen, limit=500)
    assert history[:5] == ["message 0", "message 1", "message 2", "message 3", "not message 4"]
    assert len(history) == 6 and history[5] == raw.parse().choices[0].message.content
