"""The memory API: POST /v1/memory/search and DELETE /v1/memory, on a live server."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import LiveServer
from tests.support import new_conversation
from tests.test_memory_recall import FACT, say


def error_code(response: httpx.Response) -> str:
    return str(response.json()["error"]["code"])


async def test_search_returns_items_with_scores_best_first(server: LiveServer) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, FACT)
        await say(client, a, "The weather in Lisbon was lovely this week.")
        r = await client.post("/v1/memory/search", json={"query": "Ingrid honeybees", "k": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["query"] == body["rewritten_query"] == "Ingrid honeybees"
    assert body["rewrite"] == "skipped"
    assert len(body["items"]) <= 2
    first = body["items"][0]
    assert first["text"] == FACT
    assert first["conversation_id"] == a and first["conversation_title"] == "Family"
    assert first["chunk_index"] == 0 and first["role"] == "user"
    assert [i["score"] for i in body["items"]] == sorted((i["score"] for i in body["items"]), reverse=True)
    assert all("Lisbon" not in i["text"] for i in body["items"][:1])


async def test_search_rewrites_with_the_conversation_history(server: LiveServer) -> None:
    async with server.client() as client:
        a = await new_conversation(client)
        await say(client, a, FACT)
        b = await new_conversation(client)
        await say(client, b, "Let us talk about Ingrid and her honeybees.")
        r = await client.post("/v1/memory/search", json={"query": "Where is that?", "conversation_id": b})
        narrowed = await client.post(
            "/v1/memory/search", json={"query": "honeybees", "conversation_id": b, "scope": "conversation"}
        )
    body = r.json()
    assert body["rewrite"] == "heuristic" and "Ingrid" in body["rewritten_query"]
    assert FACT in [i["text"] for i in body["items"]]
    assert narrowed.status_code == 200
    assert {i["conversation_id"] for i in narrowed.json()["items"]} == {b}


async def test_search_rejects_bad_input_with_error_bodies(server: LiveServer) -> None:
    async with server.client() as client:
        cases: list[tuple[dict[str, Any], int, str]] = [
            ({"query": "x", "surprise": 1}, 422, "validation_error"),
            ({}, 422, "validation_error"),
            ({"query": "   "}, 422, "invalid_input"),
            ({"query": "a\x00b"}, 422, "invalid_input"),
            ({"query": "x", "k": 0}, 422, "validation_error"),
            ({"query": "x", "k": 101}, 422, "validation_error"),
            ({"query": "x", "scope": "conversation"}, 422, "invalid_input"),
            ({"query": "x", "scope": "everyone"}, 422, "validation_error"),
            ({"query": "x", "conversation_id": "not-a-uuid"}, 422, "validation_error"),
            ({"query": "x" * 2001}, 422, "invalid_input"),
        ]
        for body, status, code in cases:
            r = await client.post("/v1/memory/search", json=body)
            assert (r.status_code, error_code(r)) == (status, code), (body, r.text)
        malformed = await client.post(
            "/v1/memory/search", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert (malformed.status_code, error_code(malformed)) == (422, "malformed_json")
    async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
        assert (await anonymous.post("/v1/memory/search", json={"query": "x"})).status_code == 401
        assert (await anonymous.delete("/v1/memory")).status_code == 401


async def test_another_tenants_conversation_is_not_found(server: LiveServer) -> None:
    async with server.client("t2", "u1") as other:
        theirs = await new_conversation(other)
        await say(other, theirs, FACT)
    async with server.client() as client:
        r = await client.post("/v1/memory/search", json={"query": "Ingrid", "conversation_id": theirs})
        scoped = await client.post(
            "/v1/memory/search", json={"query": "Ingrid", "conversation_id": theirs, "scope": "conversation"}
        )
        everything = await client.post("/v1/memory/search", json={"query": "Ingrid honeybees Reykjavik"})
    assert (r.status_code, error_code(r)) == (404, "not_found")
    assert scoped.status_code == 404
    assert everything.json()["items"] == []


async def test_delete_forgets_only_the_callers_memory(server: LiveServer) -> None:
    async with server.client("t1", "u2") as other:
        await say(other, await new_conversation(other), FACT)
    async with server.client() as client:
        await say(client, await new_conversation(client), FACT)
        assert (await client.delete("/v1/memory")).status_code == 204
        assert (await client.delete("/v1/memory")).status_code == 204  # idempotent
        mine = await client.post("/v1/memory/search", json={"query": "Ingrid honeybees"})
    async with server.client("t1", "u2") as other:
        theirs = await other.post("/v1/memory/search", json={"query": "Ingrid honeybees"})
    assert mine.json()["items"] == []
    assert FACT in [i["text"] for i in theirs.json()["items"]]
