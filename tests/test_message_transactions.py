"""What one message costs the database: the transactions and statements the server runs for it.

A whole transaction costs the server far more CPU than a statement inside one (a session,
BEGIN, COMMIT, each a round trip): a reply's start reads its prompt window in the
transaction that stores its turns, and its ending releases the conversation and announces
the end (`chatmem_turn_done`) in one statement.

Live server, real Postgres, real HTTP; transactions as SQLAlchemy's engine events see them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy import event

from memory.events import EventName
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.sse import SSEEvent, collect
from tests.support import new_conversation

# memory.record.turns.RECENT_TURNS: the read a prompt window is built from (recall's read of
# the unindexed turns walks the branch lineage too, but selects no prompt part).
WINDOW_READ = "t.prompt_part, c.use_memory"


class Transactions:
    """The statements of each transaction the engine ran, in the order they ended (then the open ones)."""

    def __init__(self) -> None:
        self.ended: list[list[str]] = []
        self.open: dict[int, list[str]] = {}

    def begin(self, conn: Any) -> None:
        self.open[id(conn)] = []

    def statement(self, conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.open.setdefault(id(conn), []).append(statement)

    def end(self, conn: Any) -> None:
        self.ended.append(self.open.pop(id(conn), []))

    def all(self) -> list[list[str]]:
        return [*self.ended, *self.open.values()]

    def with_statement(self, part: str) -> list[list[str]]:
        return [tx for tx in self.all() if any(part in s for s in tx)]


@contextmanager
def recorded(server: LiveServer) -> Iterator[Transactions]:
    engine = server.services.db.engine.sync_engine
    seen = Transactions()
    hooks = {
        "begin": seen.begin,
        "before_cursor_execute": seen.statement,
        "commit": seen.end,
        "rollback": seen.end,
    }
    for name, hook in hooks.items():
        event.listen(engine, name, hook)
    try:
        yield seen
    finally:
        for name, hook in hooks.items():
            event.remove(engine, name, hook)


async def say(client: httpx.AsyncClient, url: str, content: str) -> list[SSEEvent]:
    async with client.stream("POST", url, json={"content": content}) as r:
        assert r.status_code == 200, await r.aread()
        events = await collect(r)
    assert events[-1].event == EventName.TURN_COMPLETED, events[-1]
    return events


def reply_text(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)


async def test_a_messages_prompt_window_is_read_in_the_transaction_that_stores_its_turns(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, f"/v1/conversations/{cid}/messages", "I keep bees in Lyon")
        with recorded(server) as seen:
            events = await say(client, f"/v1/conversations/{cid}/messages", "how many hives is enough?")
    reads = seen.with_statement(WINDOW_READ)
    # One read, inside the transaction that locked the conversation and stored the reply's turns
    # (it had a transaction of its own, one more per message).
    assert len(reads) == 1, reads
    assert any("INSERT INTO turns" in s for s in reads[0]), reads[0]
    assert any("FOR UPDATE" in s and "FROM conversations" in s for s in reads[0]), reads[0]
    # The read saw the message stored just before it in that transaction: the demo model answers it.
    assert "how many hives is enough?" in reply_text(events)


async def test_a_reply_started_with_its_window_read_at_start_is_sent_the_whole_history(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    fake_openai.script(Reply(text="Noted."), Reply(text="Two."), Reply(text="Three."))
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, f"/v1/conversations/{cid}/messages", "I keep bees in Lyon")
        await say(client, f"/v1/conversations/{cid}/messages", "how many hives is enough?")
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        # An edit forks a branch in the same transaction: the window read there is the new branch's.
        r = await client.post(f"/v1/turns/{turns[2]['id']}/edit", json={"content": "and in Nice?"})
        assert r.status_code == 200, r.text
        await collect(r)
    sent = [
        [(m["role"], m["content"] if isinstance(m["content"], str) else "") for m in request.messages]
        for request in fake_openai.requests
        if request.stream
    ]
    assert len(sent) == 3, sent
    second, edited = sent[1], sent[2]
    assert [role for role, _ in second] == ["system", "user", "assistant", "user"], second
    assert "I keep bees in Lyon" in second[1][1] and second[2][1] == "Noted."
    assert "how many hives is enough?" in second[3][1]
    assert [role for role, _ in edited] == ["system", "user", "assistant", "user"], edited
    assert "and in Nice?" in edited[3][1] and "hives" not in " ".join(text for _, text in edited)


async def test_a_replys_ending_releases_the_conversation_and_announces_it_in_one_statement(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        with recorded(server) as seen:
            await say(client, f"/v1/conversations/{cid}/messages", "hello")
        # Released: the next message is taken at once.
        await say(client, f"/v1/conversations/{cid}/messages", "hello again")
    endings = seen.with_statement("active_reply_id = NULL")
    assert len(endings) == 1, endings
    announced = [s for s in endings[0] if "chatmem_turn_done" in s]
    assert len(announced) == 1 and "active_reply_id = NULL" in announced[0], endings[0]
