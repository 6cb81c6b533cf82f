"""A long conversation's history is read a page at a time, over real HTTP and Postgres.

`GET /v1/conversations/{id}/turns` used to answer every turn of the branch in one response:
3 MB and 0.3 s for 5,000 imported turns, growing with every message.
"""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import LiveServer
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
