"""Memory items a user controls: /v1/memory/items on a live server, real Postgres, the real pipeline.

Turns are indexed through the real ``IndexPipeline`` (``index_outbox``); indexing the same
outbox again is how the indexer reprocessing a turn (a redelivery, a reindex) looks.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import select, text

from memory.storage.db import Database
from memory.storage.models import MemoryItem
from memory.storage.retention import PURGE_MEMORY
from memory.storage.tenancy import tenant_scope
from tests.conftest import LiveServer
from tests.test_memory_recall import FACT, QUESTION, index_outbox, new_conversation, retrieved, say


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


async def items(client: httpx.AsyncClient, **params: Any) -> list[dict[str, Any]]:
    r = await client.get("/v1/memory/items", params=params)
    assert r.status_code == 200, r.text
    return r.json()["items"]  # type: ignore[no-any-return]


async def item_with(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
    found = [i for i in await items(client, limit=200) if i["text"] == text]
    assert len(found) == 1, text
    return found[0]


async def recalled_texts(client: httpx.AsyncClient, question: str = QUESTION) -> list[str]:
    """What the next reply (in a new conversation) is given from memory."""
    events = await say(client, await new_conversation(client), question)
    return [i["text"] for i in retrieved(events)["items"]]


async def test_items_are_listed_newest_first_paged_and_filtered(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, FACT)
        b = await new_conversation(client, "Garden")
        await say(client, b, "I planted twelve tomato seedlings behind the house.")
        await index_outbox(db, server.services.settings)
        everything = await items(client)
        first = await client.get("/v1/memory/items", params={"limit": 2})
        after = first.json()["next_cursor"]
        second = await client.get("/v1/memory/items", params={"limit": 2, "cursor": after})
        only_a = await items(client, conversation_id=a)
        newest = everything[0]["created_at"]
        since = await items(client, since=newest)
        until = await items(client, until=newest)
        future = await items(client, since=(datetime.now(UTC) + timedelta(days=1)).isoformat())
    # Two messages and two replies of the demo model, all remembered.
    assert len(everything) == 4
    created = [i["created_at"] for i in everything]
    assert created == sorted(created, reverse=True)
    assert [i["id"] for i in first.json()["items"] + second.json()["items"]] == [i["id"] for i in everything]
    assert second.json()["next_cursor"] is None
    assert {i["conversation_id"] for i in only_a} == {a} and len(only_a) == 2
    fact = next(i for i in only_a if i["text"] == FACT)
    assert fact["source"] == "turn" and fact["role"] == "user" and fact["conversation_title"] == "Family"
    assert fact["turn_id"] and fact["edited_at"] is None and fact["chunk_index"] == 0
    assert since and all(i["created_at"] >= newest for i in since)
    assert len(since) + len(until) == 4
    assert future == []


async def test_search_finds_items_best_first(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        await say(client, await new_conversation(client), FACT)
        await say(client, await new_conversation(client), "The weather in Lisbon was lovely this week.")
        await index_outbox(db, server.services.settings)
        found = await items(client, q="Ingrid honeybees", limit=3)
    assert found[0]["text"] == FACT and found[0]["id"] and found[0]["score"] > 0
    assert [i["score"] for i in found] == sorted((i["score"] for i in found), reverse=True)


async def test_a_correction_is_used_at_once_keeps_the_turn_and_survives_reindexing(
    server: LiveServer, db: Database
) -> None:
    corrected = "My sister Ingrid moved to Tromsø last spring and keeps honeybees there."
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, FACT)
        await index_outbox(db, server.services.settings)
        item = await item_with(client, FACT)
        r = await client.patch(f"/v1/memory/items/{item['id']}", json={"text": corrected})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == corrected and r.json()["edited_at"] is not None
        assert corrected in await recalled_texts(client)
        assert FACT not in await recalled_texts(client)
        # The indexer reprocesses the turn (redelivery): the correction stays.
        await index_outbox(db, server.services.settings)
        again = await client.get(f"/v1/memory/items/{item['id']}")
        turns = await client.get(f"/v1/conversations/{a}/turns")
        by_new_word = await items(client, q="Tromsø", limit=1)
    assert again.json()["text"] == corrected
    assert turns.json()["items"][0]["content"] == FACT  # the history stays as it was said
    assert by_new_word[0]["id"] == item["id"]  # re-embedded and re-keyworded


async def test_a_forgotten_item_is_gone_at_once_and_stays_gone(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, FACT)
        await index_outbox(db, server.services.settings)
        item = await item_with(client, FACT)
        assert (await client.delete(f"/v1/memory/items/{item['id']}")).status_code == 204
        assert (await client.get(f"/v1/memory/items/{item['id']}")).status_code == 404
        assert (await client.delete(f"/v1/memory/items/{item['id']}")).status_code == 404
        assert FACT not in await recalled_texts(client)
        await index_outbox(db, server.services.settings)  # reprocessing the turn
        assert FACT not in [i["text"] for i in await items(client, limit=200)]
        assert FACT not in await recalled_texts(client)
        async with db.transaction() as session:
            # The retention purge keeps the tombstone: it is what stops the indexer reviving it.
            await session.execute(PURGE_MEMORY, {"grace": 0.0, "limit": 100})
            kept = await session.execute(select(MemoryItem).where(MemoryItem.id == item["id"]))
            tombstone = kept.scalar_one()
        assert tombstone.text == "" and tombstone.embedding is None and tombstone.forgotten_at is not None
        turns = await client.get(f"/v1/conversations/{a}/turns")
    assert turns.json()["items"][0]["content"] == FACT


async def test_a_stated_fact_is_recalled_by_the_next_reply_on_another_replica(start_server: Any) -> None:
    first: LiveServer = await start_server()
    second: LiveServer = await start_server()
    stated = "I'm vegetarian and allergic to hazelnuts."
    async with first.client() as client:
        r = await client.post("/v1/memory/items", json={"text": stated})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["source"] == "stated" and body["turn_id"] is None and body["conversation_id"] is None
    async with second.client() as client:
        memory = retrieved(await say(client, await new_conversation(client), "Am I vegetarian? hazelnuts?"))
        assert stated in [i["text"] for i in memory["items"]]
        listed = await items(client)
        assert [i["id"] for i in listed] == [body["id"]]
        assert (await client.delete(f"/v1/memory/items/{body['id']}")).status_code == 204
    async with first.client() as client:
        assert stated not in await recalled_texts(client, "Am I vegetarian? hazelnuts?")


async def test_a_stated_fact_can_belong_to_a_conversation_unless_it_is_not_remembered(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Food")
        private = await new_conversation(client, "Private", memory_mode="none")
        tied = await client.post(
            "/v1/memory/items", json={"text": "I cook on Sundays.", "conversation_id": a}
        )
        refused = await client.post(
            "/v1/memory/items", json={"text": "I cook on Sundays.", "conversation_id": private}
        )
        assert (await client.patch(f"/v1/conversations/{a}", json={"memory_mode": "none"})).status_code == 200
        hidden = await client.get(f"/v1/memory/items/{tied.json()['id']}")
    assert tied.status_code == 201 and tied.json()["conversation_title"] == "Food"
    assert (refused.status_code, error_code(refused)) == (409, "conversation_memory_off")
    assert hidden.status_code == 404  # "don't remember this chat" hides what it remembered


async def test_another_users_items_answer_404(server: LiveServer, db: Database) -> None:
    async with server.client("t2", "u1") as other_tenant:
        theirs = (await other_tenant.post("/v1/memory/items", json={"text": FACT})).json()["id"]
    async with server.client("t1", "u2") as other_user:
        same_tenant = (await other_user.post("/v1/memory/items", json={"text": FACT})).json()["id"]
    async with server.client() as client:
        for item_id in (theirs, same_tenant):
            assert (await client.get(f"/v1/memory/items/{item_id}")).status_code == 404
            patched = await client.patch(f"/v1/memory/items/{item_id}", json={"text": "mine now"})
            assert (patched.status_code, error_code(patched)) == (404, "not_found")
            assert (await client.delete(f"/v1/memory/items/{item_id}")).status_code == 404
        assert await items(client) == []
        assert await items(client, q="Ingrid honeybees") == []
    async with db.transaction() as session:
        texts = set((await session.execute(select(MemoryItem.text))).scalars())
    assert texts == {FACT}  # nothing was changed or removed
    # Row-level security: scoped to tenant t1, tenant t2's row does not exist at all.
    with tenant_scope("t1"):
        async with db.transaction() as session:
            seen = (await session.execute(text("SELECT id FROM memory_items"))).scalars().all()
    assert seen == [same_tenant]


async def test_bad_input_gets_machine_readable_4xx(server: LiveServer) -> None:
    async with server.client() as client:
        created = await client.post("/v1/memory/items", json={"text": "I like tea."})
        item_id = created.json()["id"]
        cases: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None, int, str]] = [
            ("POST", "/v1/memory/items", {"text": "   "}, None, 422, "invalid_input"),
            ("POST", "/v1/memory/items", {"text": "a\x00b"}, None, 422, "invalid_input"),
            ("POST", "/v1/memory/items", {"text": "x" * 2001}, None, 422, "validation_error"),
            ("POST", "/v1/memory/items", {"text": "x", "extra": 1}, None, 422, "validation_error"),
            ("POST", "/v1/memory/items", {}, None, 422, "validation_error"),
            ("POST", "/v1/memory/items", {"text": "x", "conversation_id": 1}, None, 422, "validation_error"),
            ("PATCH", f"/v1/memory/items/{item_id}", {"text": ""}, None, 422, "invalid_input"),
            ("PATCH", f"/v1/memory/items/{item_id}", {}, None, 422, "validation_error"),
            ("GET", "/v1/memory/items/abc", None, None, 422, "validation_error"),
            ("GET", "/v1/memory/items/0", None, None, 422, "validation_error"),
            ("GET", f"/v1/memory/items/{2**63}", None, None, 422, "validation_error"),
            ("GET", "/v1/memory/items/999999", None, None, 404, "not_found"),
            ("GET", "/v1/memory/items", None, {"cursor": "bad"}, 422, "invalid_input"),
            ("GET", "/v1/memory/items", None, {"limit": 0}, 422, "validation_error"),
            ("GET", "/v1/memory/items", None, {"since": "yesterday"}, 422, "validation_error"),
            (
                "GET",
                "/v1/memory/items",
                None,
                {"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"},
                422,
                "invalid_input",
            ),
            ("GET", "/v1/memory/items", None, {"q": "tea", "cursor": "x"}, 422, "invalid_input"),
            ("GET", "/v1/memory/items", None, {"q": " "}, 422, "invalid_input"),
            (
                "GET",
                "/v1/memory/items",
                None,
                {"conversation_id": "00000000-0000-0000-0000-000000000001"},
                404,
                "not_found",
            ),
        ]
        for method, path, body, params, status, code in cases:
            r = await client.request(method, path, json=body, params=params)
            assert (r.status_code, error_code(r)) == (status, code), (method, path, body, params, r.text)
        assert [i["text"] for i in await items(client)] == ["I like tea."]  # nothing half-written
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        assert (await anonymous.get("/v1/memory/items")).status_code == 401
        assert (await anonymous.post("/v1/memory/items", json={"text": "x"})).status_code == 401
        assert (await anonymous.delete(f"/v1/memory/items/{item_id}")).status_code == 401
