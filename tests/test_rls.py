"""Row-level security: inside a tenant's scope, a query without any tenant filter sees only that tenant.

Real embedded Postgres throughout. The test database connects as the superuser, which
RLS never restricts: these tests pass only because scoped transactions switch to the
`chatmem_tenant` role (memory/storage/db.py), and fail if that switch or a policy is missing.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from chat_api.tools import Tool, ToolContext, default_registry
from memory.events import EventName
from memory.storage.db import Database
from memory.storage.tenancy import current_tenant, tenant_scope, unscoped
from tests.conftest import LiveServer
from tests.sse import collect

RLS_TABLES = (
    "conversations",
    "turns",
    "turn_events",
    "tool_invocations",
    "outbox",
    "memory_items",
    "chat_stops",
)

SEED = [
    """INSERT INTO conversations (id, tenant_id, user_id, title, memory_mode)
       VALUES (:conversation, :tenant, 'u1', 'secret', 'persistent')""",
    """INSERT INTO turns (id, conversation_id, tenant_id, user_id, seq, role, status, content)
       VALUES (:turn, :conversation, :tenant, 'u1', 1, 'user', 'completed', 'hello')""",
    """INSERT INTO turn_events (reply_id, first_id, last_id, tenant_id, user_id, events)
       VALUES (:turn, 1, 1, :tenant, 'u1', '[]')""",
    """INSERT INTO tool_invocations (tenant_id, user_id, turn_id, call_index, call_id, tool_name, arguments,
                                     idempotency_key, state, side_effect_may_have_happened, attempts)
       VALUES (:tenant, 'u1', :turn, 0, 'c1', 'current_time', '{}', :key, 'succeeded', false, 1)""",
    """INSERT INTO outbox (tenant_id, user_id, conversation_id, turn_id, payload)
       VALUES (:tenant, 'u1', :conversation, :turn, '{}')""",
    """INSERT INTO memory_items (index_id, tenant_id, user_id, conversation_id, turn_id, chunk_index,
                                 turn_seq, role, text, search_terms, embedding, turn_created_at)
       VALUES (1, :tenant, 'u1', :conversation, :turn, 0, 1, 'user', 'hello', to_tsvector('simple', 'hello'),
               CAST(:embedding AS vector), now())""",
    """INSERT INTO chat_stops (tenant_id, user_id, chat_id, requested_at, run_key)
       VALUES (:tenant, 'u1', 'new-chat', now(), NULL)""",
]


async def seed(db: Database, tenant: str) -> dict[str, uuid.UUID]:
    """One row of `tenant` in every RLS table, written unscoped (as background work would)."""
    ids = {"conversation": uuid.uuid4(), "turn": uuid.uuid4()}
    embedding = "[" + ",".join(["1"] + ["0"] * 383) + "]"
    async with db.transaction() as session:
        for statement in SEED:
            await session.execute(
                text(statement), {**ids, "tenant": tenant, "key": f"key-{tenant}", "embedding": embedding}
            )
    return ids


@pytest.fixture
async def two_tenants(db: Database) -> dict[str, dict[str, uuid.UUID]]:
    return {"A": await seed(db, "A"), "B": await seed(db, "B")}


async def tenants_seen(db: Database, table: str) -> list[str]:
    async with db.transaction() as session:
        rows = await session.execute(text(f"SELECT tenant_id FROM {table} ORDER BY tenant_id"))
        return [row.tenant_id for row in rows]


@pytest.mark.parametrize("table", RLS_TABLES)
async def test_an_unscoped_select_in_a_tenant_scope_returns_only_that_tenants_rows(
    db: Database, two_tenants: Any, table: str
) -> None:
    with tenant_scope("A"):
        assert await tenants_seen(db, table) == ["A"]
    with tenant_scope("B"):
        assert await tenants_seen(db, table) == ["B"]


@pytest.mark.parametrize("table", RLS_TABLES)
async def test_background_work_outside_any_scope_still_sees_every_tenant(
    db: Database, two_tenants: Any, table: str
) -> None:
    assert current_tenant() is None
    assert await tenants_seen(db, table) == ["A", "B"]


@pytest.mark.parametrize("table", RLS_TABLES)
async def test_updates_and_deletes_of_another_tenants_rows_touch_nothing(
    db: Database, two_tenants: Any, table: str
) -> None:
    with tenant_scope("A"):
        async with db.transaction() as session:
            updated = await session.execute(
                text(f"UPDATE {table} SET user_id = 'stolen' WHERE tenant_id = 'B'")
            )
            deleted = await session.execute(text(f"DELETE FROM {table} WHERE tenant_id = 'B'"))
        assert (updated.rowcount, deleted.rowcount) == (0, 0)  # type: ignore[attr-defined]
    async with db.transaction() as session:
        row = (await session.execute(text(f"SELECT user_id FROM {table} WHERE tenant_id = 'B'"))).one()
    assert row.user_id == "u1"


async def test_inserting_a_row_of_another_tenant_fails(db: Database, two_tenants: Any) -> None:
    with tenant_scope("A"), pytest.raises(DBAPIError, match="row-level security"):
        async with db.transaction() as session:
            await session.execute(
                text(
                    "INSERT INTO conversations (id, tenant_id, user_id, title, memory_mode)"
                    " VALUES (:id, 'B', 'u1', 'planted', 'persistent')"
                ),
                {"id": uuid.uuid4()},
            )


async def test_moving_a_row_to_another_tenant_fails(db: Database, two_tenants: Any) -> None:
    with tenant_scope("A"), pytest.raises(DBAPIError, match="row-level security"):
        async with db.transaction() as session:
            await session.execute(text("UPDATE turns SET tenant_id = 'B'"))


async def test_the_scope_does_not_outlive_its_transaction_on_a_pooled_connection(pg_url: str) -> None:
    database = Database(pg_url, pool_size=1)
    who = text(
        "SELECT pg_backend_pid() AS pid, current_user AS role,"
        " coalesce(current_setting('chatmem.tenant_id', true), '') AS tenant"
    )
    try:
        with tenant_scope("A"):
            async with database.transaction() as session:
                scoped = (await session.execute(who)).one()
            # A failed transaction must not leave it behind either.
            with pytest.raises(DBAPIError):
                async with database.transaction() as session:
                    await session.execute(text("SELECT 1 / 0"))
        async with database.transaction() as session:
            after = (await session.execute(who)).one()
    finally:
        await database.dispose()
    assert (scoped.role, scoped.tenant) == ("chatmem_tenant", "A")
    assert after.pid == scoped.pid  # the same pooled connection
    assert (after.role, after.tenant) == ("postgres", "")


async def test_unscoped_blocks_and_the_tasks_they_start_serve_every_tenant(
    db: Database, two_tenants: Any
) -> None:
    import asyncio

    with tenant_scope("A"):
        with unscoped():
            task = asyncio.create_task(tenants_seen(db, "conversations"))
        scoped = await tenants_seen(db, "conversations")
    assert await task == ["A", "B"]
    assert scoped == ["A"]


# --- over real HTTP -------------------------------------------------------------------

PROBE = text(
    "SELECT current_user AS role, current_setting('chatmem.tenant_id', true) AS tenant,"
    " (SELECT count(*) FROM conversations) AS conversations"  # deliberately no WHERE
)


async def _probe(_args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    async with ctx.db.transaction() as session:
        row = (await session.execute(PROBE)).one()
    return {"role": row.role, "tenant": row.tenant, "conversations": row.conversations}


async def test_a_request_and_the_reply_it_starts_run_in_its_tenants_scope(
    start_server: Any, db: Database
) -> None:
    """A tool running inside a reply (a task the request started) queries without a WHERE."""
    await seed(db, "other")
    tools = default_registry()
    tools.register(Tool(name="db_probe", description="probe", parameters={"type": "object"}, func=_probe))
    server: LiveServer = await start_server(tools=tools)
    async with server.client(tenant="A", user="u1") as client:
        listed = (await client.get("/v1/conversations")).json()["items"]
        assert listed == []
        cid = (await client.post("/v1/conversations", json={"title": "mine"})).json()["id"]
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "/tool db_probe {}"}
        ) as response:
            events = await collect(response)
        names = [e.event for e in events]
        assert names[-1] == EventName.TURN_COMPLETED, names
        retrieved = next(e.data for e in events if e.event == EventName.MEMORY_RETRIEVED)
        assert "error" not in retrieved  # recall ran, scoped, without failing
        result = json.loads(next(e.data["result"] for e in events if e.event == EventName.TOOL_RESULT))
        assert result == {"role": "chatmem_tenant", "tenant": "A", "conversations": 1}
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
    # Everything the reply wrote landed, under tenant A (read unscoped, as background work does).
    async with db.transaction() as session:
        counts = {
            table: (
                await session.execute(text(f"SELECT count(*) FROM {table} WHERE tenant_id = 'A'"))
            ).scalar_one()
            for table in ("turns", "turn_events", "tool_invocations", "outbox")
        }
    assert counts["turns"] == 4 and counts["tool_invocations"] == 1
    assert counts["turn_events"] >= 1 and counts["outbox"] >= 2


# --- memory search: the one statement that runs as the connecting role -----------------


async def test_memory_search_in_a_scope_finds_the_tenants_memory_and_restores_the_role(
    db: Database, two_tenants: Any
) -> None:
    from memory.recall.index_search import search_index

    vector = [1.0] + [0.0] * 383
    with tenant_scope("A"):
        async with db.transaction() as session:
            hits = await search_index(
                session,
                tenant_id="A",
                user_id="u1",
                query_text="hello",
                query_embedding=vector,
                index_id=1,
                k=5,
            )
            role = (await session.execute(text("SELECT current_user"))).scalar_one()
            visible = (await session.execute(text("SELECT count(*) FROM memory_items"))).scalar_one()
    assert [h.turn_id for h in hits] == [two_tenants["A"]["turn"]]
    assert (role, visible) == ("chatmem_tenant", 1)


async def test_memory_search_in_a_scope_refuses_another_tenant(db: Database, two_tenants: Any) -> None:
    from memory.errors import NotFound
    from memory.recall.index_search import search_index

    with tenant_scope("A"), pytest.raises(NotFound):
        async with db.transaction() as session:
            await search_index(
                session,
                tenant_id="B",
                user_id="u1",
                query_text="hello",
                query_embedding=[1.0] * 384,
                index_id=1,
                k=5,
            )
