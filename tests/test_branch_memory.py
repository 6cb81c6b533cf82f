"""Memory follows the active branch: recall before and after indexing, the indexer racing a switch.

Live server, real Postgres, the deterministic HashEmbedder, and the real IndexPipeline
(in the server as a worker, or driven directly where the race is the point).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from sqlalchemy import select

from indexer.pipeline import IndexPipeline
from indexer.worker import IndexerWorker
from memory.recall.embeddings import HashEmbedder
from memory.storage.db import Database
from memory.storage.models import MemoryItem, OutboxRow
from tests.conftest import LiveServer
from tests.support import new_conversation, wait_until
from tests.test_branches import send, turns

TEAL = "My favourite colour is teal, like the old harbour boats."
CRIMSON = "My favourite colour is crimson, like the theatre curtains."
QUESTION = "what is my favourite colour?"


def indexer_worker(services: Any, stop: asyncio.Event) -> Any:
    return IndexerWorker(services.db, services.settings, services.embedder).run(stop)


async def recalled(client: httpx.AsyncClient) -> str:
    """Every text memory search finds for the question, joined."""
    r = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
    assert r.status_code == 200, r.text
    return "\n".join(item["text"] for item in r.json()["items"])


async def wait_indexed(client: httpx.AsyncClient, cid: str) -> None:
    async def indexed() -> bool:
        state = (await client.get(f"/v1/conversations/{cid}")).json()
        return bool(state["indexed_seq"] >= state["turn_count"])

    await wait_until(indexed, 30, "every turn indexed")


async def edit_first_message(client: httpx.AsyncClient, cid: str, content: str) -> None:
    first = (await turns(client, cid))[0]["id"]
    r = await client.post(f"/v1/turns/{first}/edit", json={"content": content, "stream": False})
    assert r.status_code == 200, r.text


async def test_turns_not_indexed_yet_are_recalled_only_from_the_active_branch(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, TEAL)
        assert "teal" in await recalled(client)
        await edit_first_message(client, cid, CRIMSON)
        found = await recalled(client)
        assert "crimson" in found and "teal" not in found

        r = await client.post(f"/v1/conversations/{cid}/branches/{cid}/activate")
        assert r.status_code == 200
        found = await recalled(client)
        assert "teal" in found and "crimson" not in found


async def test_indexed_memory_follows_branch_switches(start_server: Callable[..., Any], db: Database) -> None:
    server = await start_server(workers=[indexer_worker])
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, TEAL)
        await edit_first_message(client, cid, CRIMSON)
        await wait_indexed(client, cid)
        async with db.session() as session:
            items = (await session.execute(select(MemoryItem))).scalars().all()
        flags = {item.text: item.on_active_branch for item in items}
        assert flags[TEAL] is False and flags[CRIMSON] is True
        found = await recalled(client)
        assert "crimson" in found and "teal" not in found

        edited = (await client.get(f"/v1/conversations/{cid}")).json()["active_branch_id"]
        assert (await client.post(f"/v1/conversations/{cid}/branches/{cid}/activate")).status_code == 200
        found = await recalled(client)
        assert "teal" in found and "crimson" not in found
        r = await client.post(f"/v1/conversations/{cid}/branches/{edited}/activate")
        assert r.status_code == 200
        found = await recalled(client)
        assert "crimson" in found and "teal" not in found


class GatedEmbedder(HashEmbedder):
    """HashEmbedder that holds each embed call until released (to put a switch inside a batch).

    A HashEmbedder to the memory index too (its spec): it makes the server's vectors, so it
    writes into the server's generation rather than taking the index over as another encoder.
    """

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.entered.set()
        await self.release.wait()
        return await super().embed(texts)


async def test_a_branch_switch_while_the_indexer_embeds_is_seen_when_it_writes(
    server: LiveServer, db: Database
) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, TEAL)
        async with db.session() as session:
            payloads = list(
                (await session.execute(select(OutboxRow.payload).order_by(OutboxRow.id))).scalars()
            )
        embedder = GatedEmbedder()
        batch = asyncio.create_task(IndexPipeline(db, embedder, server.services.settings).index(payloads))
        async with asyncio.timeout(10):
            await embedder.entered.wait()
        # The batch read its conversations before this switch and writes after it.
        await edit_first_message(client, cid, CRIMSON)
        embedder.release.set()
        result = await batch
    assert result.indexed_turns == 2
    async with db.session() as session:
        rows = (await session.execute(select(MemoryItem))).scalars().all()
    assert {row.text: row.on_active_branch for row in rows} == {
        TEAL: False,
        next(r.text for r in rows if r.role == "assistant"): False,
    }
    assert all(row.conversation_id == uuid.UUID(cid) for row in rows)
