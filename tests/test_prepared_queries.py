"""A reply's query encoded while the reply is accepted: used once, only when it is the query
searched with the encoder searched, never left behind.

Live server and real Postgres. The encoder is the real model (OpenVINO, one thread),
wrapped at its process edge to record what it is asked to encode and when; the tests of
generations use the deterministic HashEmbedder, as tests/test_memory_reindex.py does.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from indexer.pipeline import IndexPipeline
from memory.config import default_embedding_model
from memory.events import EventName, RecallError
from memory.recall.embedding_service import EmbeddingUnavailable
from memory.recall.embeddings import HashEmbedder, SentenceTransformerEmbedder
from memory.recall.index import Generation, MemoryIndex, current_generation
from memory.recall.prepared_queries import PreparedQueries, PreparedQuery
from memory.recall.search import recall_memories
from memory.record.conversations import Owner
from memory.record.outbox import turn_payload
from memory.storage.db import Database
from tests.conftest import LiveServer, token_for
from tests.sse import SSEEvent, iter_sse
from tests.support import new_conversation, wait_until
from tests.test_indexer import chat_turns, test_settings
from tests.test_memory_recall import FACT, QUESTION, retrieved, say

OWNER = Owner("tenant-a", "user-a")
FOLLOW_UP = "Where does she live?"


class RecordingEmbedder:
    """The real encoder, noting each text it is asked to encode in a shared log (in call order)."""

    def __init__(self, encoder: SentenceTransformerEmbedder, log: list[str]) -> None:
        self.encoder = encoder
        self.dim = encoder.dim
        self.spec = encoder.spec
        self.runtime = encoder.runtime
        self.log = log
        self.texts: list[str] = []
        self.hold: dict[str, asyncio.Event] = {}  # a text's encode waits until its event is set

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.texts.extend(texts)
        self.log.extend(f"encode {text}" for text in texts)
        for text in texts:
            if text in self.hold:
                await self.hold[text].wait()
        return await self.encoder.embed(texts)


@pytest.fixture(scope="module")
def real_encoder() -> SentenceTransformerEmbedder:
    encoder = SentenceTransformerEmbedder(
        default_embedding_model(), runtime="openvino", cache_root=Path(os.environ["EMBEDDING_CACHE_DIR"])
    )
    encoder.load(threads=1)
    return encoder


def window_reads(server: LiveServer, log: list[str]) -> Any:
    """Note each read of a prompt window (memory.record.turns.RECENT_TURNS) in ``log``."""

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "unnest(b.lineage_ids" in statement and "indexed_seq" not in statement:
            log.append("window read")

    return note


def queries_ahead(response: httpx.Response) -> dict[str, float]:
    """chatmem_queries_encoded_ahead_total by outcome, from a /metrics answer."""
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(response.text)
        if family.name == "chatmem_queries_encoded_ahead"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


async def test_a_standalone_messages_query_is_encoded_once_before_its_window_is_read_and_recall_uses_it(
    start_server: Any, real_encoder: SentenceTransformerEmbedder
) -> None:
    log: list[str] = []
    embedder = RecordingEmbedder(real_encoder, log)
    server: LiveServer = await start_server(embedder=embedder)
    recaller = server.services.recaller
    engine = server.services.db.engine.sync_engine
    note = window_reads(server, log)
    event.listen(engine, "before_cursor_execute", note)
    try:
        async with server.client() as client:
            await say(client, await new_conversation(client, "Family"), FACT)  # leans on "there": not ahead
            log.clear()
            before = recaller.prepared.prepared
            counted = queries_ahead(await client.get("/metrics"))
            found = retrieved(await say(client, await new_conversation(client), QUESTION))
            now_counted = queries_ahead(await client.get("/metrics"))
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert FACT in [item["text"] for item in found["items"]] and "error" not in found
    assert found["rewrite"] == "skipped" and found["rewritten_query"] == QUESTION
    # Encoded once, and asked for before the window was read (it used to follow the window read).
    assert embedder.texts.count(QUESTION) == 1, embedder.texts
    assert log.index(f"encode {QUESTION}") < log.index("window read"), log
    assert (recaller.prepared.prepared - before, recaller.prepared.used) == (1, 1)
    assert len(recaller.prepared) == 0
    # An operator sees the same in /metrics: one started ahead, and recall used it.
    assert {k: now_counted[k] - counted.get(k, 0.0) for k in now_counted} == {"started": 1.0, "used": 1.0}


@pytest.mark.parametrize("door", ["chat.completions", "responses"])
async def test_an_openai_doors_query_is_encoded_before_its_turns_are_stored(
    start_server: Any, real_encoder: SentenceTransformerEmbedder, door: str
) -> None:
    log: list[str] = []
    embedder = RecordingEmbedder(real_encoder, log)
    server: LiveServer = await start_server(embedder=embedder)
    engine = server.services.db.engine.sync_engine
    async with server.client() as native:  # the user has memory (a user with none is not searched)
        await say(native, await new_conversation(native, "Family"), FACT)

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO TURNS"):
            log.append("turn insert")

    event.listen(engine, "before_cursor_execute", note)
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    try:
        if door == "responses":
            await client.responses.create(model="chatmem-demo", input=QUESTION)
        else:
            messages = [{"role": "user", "content": QUESTION}]
            await client.chat.completions.create(model="chatmem-demo", messages=messages)  # type: ignore[arg-type]
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert embedder.texts.count(QUESTION) == 1, embedder.texts
    # Asked for before the message was stored (it used to wait for the accept to store it).
    assert log.index(f"encode {QUESTION}") < log.index("turn insert"), log
    assert server.services.recaller.prepared.used == 1


async def test_a_follow_up_is_not_encoded_ahead(
    start_server: Any, real_encoder: SentenceTransformerEmbedder
) -> None:
    embedder = RecordingEmbedder(real_encoder, [])
    server: LiveServer = await start_server(embedder=embedder)
    recaller = server.services.recaller
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, cid, FACT)
        before = recaller.prepared.prepared
        embedder.texts.clear()
        found = retrieved(await say(client, cid, FOLLOW_UP))
    assert recaller.prepared.prepared == before  # its query depends on the history
    assert found["rewrite"] == "heuristic" and found["rewritten_query"] != FOLLOW_UP
    assert FOLLOW_UP not in embedder.texts and embedder.texts.count(found["rewritten_query"]) == 1
    assert len(recaller.prepared) == 0


async def test_a_reply_with_memory_off_is_not_encoded_ahead(
    start_server: Any, real_encoder: SentenceTransformerEmbedder
) -> None:
    embedder = RecordingEmbedder(real_encoder, [])
    server: LiveServer = await start_server(embedder=embedder)
    recaller = server.services.recaller
    async with server.client() as client:
        await say(client, await new_conversation(client), QUESTION, memory_scope="none")
        await say(client, await new_conversation(client, use_memory=False), QUESTION)
    assert recaller.prepared.prepared == 0 and embedder.texts == []


async def test_a_reply_that_fails_to_start_or_is_stopped_while_its_query_encodes_leaves_nothing_behind(
    start_server: Any, real_encoder: SentenceTransformerEmbedder
) -> None:
    embedder = RecordingEmbedder(real_encoder, [])
    # Recall's time box far off: the held encode must be ended by the stop, not by the box (3 s
    # by default, which a loaded machine spent before its stop landed: the reply then went on
    # without memory, and announced it, before the stop came).
    server: LiveServer = await start_server(embedder=embedder, recall_timeout_seconds=120)
    recaller = server.services.recaller
    async with server.client() as client:
        cid = await new_conversation(client)
        events = await say(client, cid, FACT)
        assert recaller.prepared.prepared == 0  # it leans on "there"
        # An edit of an assistant turn is refused inside the accept transaction, after the
        # edited text's encode was started: the encode is dropped with the transaction.
        reply_id = events[0].data["reply_id"]
        r = await client.post(f"/v1/turns/{reply_id}/edit", json={"content": QUESTION})
        assert r.status_code == 422, r.text
        assert recaller.prepared.prepared == 1 and len(recaller.prepared) == 0
        # Stopped while its query's encode is still running: nothing is kept, the encode ends.
        held = asyncio.Event()
        embedder.hold[QUESTION] = held
        stream: list[SSEEvent] = []
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": QUESTION}
        ) as response:
            async for sse in iter_sse(response):
                stream.append(sse)
                if sse.event == EventName.TURN_STARTED:
                    await wait_until(lambda: QUESTION in embedder.texts, what="the query's encode")
                    stop = await client.post(f"/v1/turns/{sse.data['reply_id']}/stop")
                    assert stop.status_code in (200, 202), stop.text
    held.set()
    assert stream[-1].event == EventName.TURN_INTERRUPTED, [e.event for e in stream]
    assert EventName.MEMORY_RETRIEVED not in [e.event for e in stream]
    assert recaller.prepared.prepared == 2 and recaller.prepared.used == 0
    assert len(recaller.prepared) == 0


async def index_facts(db: Database, index: MemoryIndex, pg_url: str, texts: list[str]) -> None:
    _, turns = await chat_turns(db, texts, owner=OWNER)
    await IndexPipeline(db, index, test_settings(pg_url)).index([turn_payload(t) for t in turns])


async def ready(prepared: PreparedQueries, key: uuid.UUID) -> PreparedQuery:
    """``key``'s entry once its encode has ended, as when a reply's recall comes after it."""
    entry = prepared.take(key)
    assert entry is not None
    await asyncio.wait({entry.encode})
    return entry


# Said after the indexing: found only among the turns the indexer has not reached.
UNINDEXED_FACT = "Ingrid's new flat in Reykjavik looks out over the old harbour."


async def searched_ahead_and_not(
    db: Database, index: MemoryIndex, pg_url: str, unindexed: list[str]
) -> tuple[Any, Any, PreparedQueries]:
    """The same search with its query encoded ahead, then without, over two indexed facts and
    the ``unindexed`` chat turns; and the holder the encoded-ahead query was taken from."""
    await index_facts(db, index, pg_url, [FACT, "I sold my old bike to a neighbour in June."])
    await chat_turns(db, unindexed, owner=OWNER)
    generation = current_generation(index)
    assert generation is not None
    prepared = PreparedQueries()
    key = uuid.uuid4()
    prepared.prepare(key, QUESTION, generation, box_seconds=5)

    async def search(**extra: Any) -> Any:
        return await recall_memories(
            db, index, tenant_id=OWNER.tenant_id, user_id=OWNER.user_id, query_text=QUESTION, k=3, **extra
        )

    ahead = await search(prepared=await ready(prepared, key))
    return ahead, await search(), prepared


async def test_a_query_encoded_ahead_is_the_vector_recall_would_encode(
    db: Database, pg_url: str, real_encoder: SentenceTransformerEmbedder
) -> None:
    index = MemoryIndex(db, real_encoder)
    await index.start()
    ahead, plain, prepared = await searched_ahead_and_not(
        db, index, pg_url, [UNINDEXED_FACT, "What a view that must be."]
    )
    assert ahead.query_ahead and not plain.query_ahead
    # Encoded alone ahead, and in one batch with the unindexed turns without: on some CPUs the
    # encoder's kernels round a padded batch differently in the last bits (about 1e-7), so the
    # same vector within float32 rounding, and the same memories in the same order.
    assert len(ahead.query_vector) == len(plain.query_vector)
    assert ahead.query_vector == pytest.approx(plain.query_vector, rel=0, abs=1e-6)
    found = [(m.turn_id, m.indexed) for m in ahead.memories]
    assert found == [(m.turn_id, m.indexed) for m in plain.memories]
    assert [m.score for m in ahead.memories] == pytest.approx([m.score for m in plain.memories], abs=1e-6)
    assert ahead.memories[0].text.endswith(FACT)
    assert UNINDEXED_FACT in [m.text for m in ahead.memories if not m.indexed]
    assert len(prepared) == 0


async def test_a_search_with_its_query_encoded_ahead_reads_in_one_transaction(
    db: Database, pg_url: str
) -> None:
    # The unindexed turns and the index were read in two transactions: the query's encode came
    # between them. With the vector at hand both reads share one (three round trips fewer).
    index = MemoryIndex(db, HashEmbedder(seed=0), check_seconds=3600)  # no re-read of the generation
    current = await index.start()
    await index_facts(db, index, pg_url, [FACT])
    await chat_turns(db, [UNINDEXED_FACT], owner=OWNER)
    prepared = PreparedQueries()
    checkouts: list[str] = []

    def note(*_: Any) -> None:
        checkouts.append("connection")

    async def search(**extra: Any) -> Any:
        checkouts.clear()
        event.listen(db.engine.sync_engine.pool, "checkout", note)
        try:
            return await recall_memories(
                db, index, tenant_id=OWNER.tenant_id, user_id=OWNER.user_id, query_text=QUESTION, k=3, **extra
            )
        finally:
            event.remove(db.engine.sync_engine.pool, "checkout", note)

    key = uuid.uuid4()
    prepared.prepare(key, QUESTION, current, box_seconds=5)
    ahead = await search(prepared=await ready(prepared, key))
    assert ahead.query_ahead and len(checkouts) == 1, checkouts
    plain = await search()
    assert not plain.query_ahead and len(checkouts) == 2, checkouts  # its encode comes between the reads
    assert [m.text for m in ahead.memories] == [m.text for m in plain.memories]
    assert {m.text for m in ahead.memories} >= {UNINDEXED_FACT} and ahead.memories[0].text.endswith(FACT)


async def test_a_query_encoded_for_another_generation_is_never_compared_with_this_ones_rows(
    db: Database, pg_url: str
) -> None:
    old, new = HashEmbedder(seed=0), HashEmbedder(seed=1)
    index = MemoryIndex(db, old)
    current = await index.start()
    await index_facts(db, index, pg_url, [FACT])
    prepared = PreparedQueries()
    # Encoded ahead for the generation a reindex has switched away from (another id and encoder) ...
    switched_away = Generation(current.id + 1, new, "another encoder")
    for key, generation in ((uuid.uuid4(), switched_away), (uuid.uuid4(), current)):
        prepared.prepare(key, QUESTION, generation, box_seconds=5)
        recalled = await recall_memories(
            db,
            index,
            tenant_id=OWNER.tenant_id,
            user_id=OWNER.user_id,
            query_text=QUESTION,
            k=3,
            prepared=await ready(prepared, key),
        )
        # ... it is dropped and the query encoded by the searched generation's encoder.
        assert recalled.query_ahead == (generation is current)
        assert recalled.query_vector == old.embed_one(QUESTION)
        assert recalled.memories[0].text.endswith(FACT)
    # A different text (the rewrite changed the query) is not used either.
    key = uuid.uuid4()
    prepared.prepare(key, "Where does Ingrid keep her bees?", current, box_seconds=5)
    recalled = await recall_memories(
        db,
        index,
        tenant_id=OWNER.tenant_id,
        user_id=OWNER.user_id,
        query_text=QUESTION,
        k=3,
        prepared=await ready(prepared, key),
    )
    assert not recalled.query_ahead and recalled.query_vector == old.embed_one(QUESTION)


class Held(HashEmbedder):
    """An encoder whose query encode waits until ``free`` is set (an encoder busy with others)."""

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.free = asyncio.Event()
        self.log: list[str] = []

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if QUESTION in texts:
            await self.free.wait()
            self.log.append("query encoded")
        return await super().embed(texts)


async def test_a_search_whose_query_is_still_encoding_reads_the_unindexed_turns_meanwhile(
    db: Database, pg_url: str
) -> None:
    embedder = Held(seed=0)
    embedder.free.set()  # the indexing encodes freely
    index = MemoryIndex(db, embedder, check_seconds=3600)
    current = await index.start()
    await index_facts(db, index, pg_url, [FACT])
    await chat_turns(db, [UNINDEXED_FACT], owner=OWNER)
    embedder.free.clear()
    prepared = PreparedQueries()
    key = uuid.uuid4()
    prepared.prepare(key, QUESTION, current, box_seconds=5)
    engine = db.engine.sync_engine

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "indexed_seq" in statement:
            embedder.log.append("unindexed read")

    event.listen(engine, "before_cursor_execute", note)
    try:
        search = asyncio.ensure_future(
            recall_memories(
                db,
                index,
                tenant_id=OWNER.tenant_id,
                user_id=OWNER.user_id,
                query_text=QUESTION,
                k=3,
                prepared=prepared.take(key),
            )
        )
        # The read does not wait for the encode: the search waits for the vector after it.
        await wait_until(lambda: "unindexed read" in embedder.log, what="the unindexed read")
        embedder.free.set()
        recalled = await search
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert embedder.log == ["unindexed read", "query encoded"], embedder.log
    assert recalled.query_ahead and recalled.memories[0].text.endswith(FACT)
    assert UNINDEXED_FACT in [m.text for m in recalled.memories]


class AwayForTurns(HashEmbedder):
    """An encoder whose service answers the query but goes away before the unindexed turns."""

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        if any(UNINDEXED_FACT in text for text in texts):  # the turn's text, never the query
            raise EmbeddingUnavailable("the embedding service went away")
        return await super().embed(texts)


async def test_a_search_with_its_query_encoded_ahead_degrades_to_keywords_as_one_without(
    db: Database, pg_url: str
) -> None:
    index = MemoryIndex(db, AwayForTurns(seed=0), check_seconds=3600)
    await index.start()
    ahead, plain, _ = await searched_ahead_and_not(db, index, pg_url, [UNINDEXED_FACT])
    assert ahead.query_ahead and ahead.degraded is not None and ahead.degraded == plain.degraded
    assert ahead.degraded[0] == RecallError.EMBEDDING_UNAVAILABLE
    assert [(m.turn_id, m.score) for m in ahead.memories] == [(m.turn_id, m.score) for m in plain.memories]
    assert ahead.memories[0].text.endswith(FACT) and all(m.indexed for m in ahead.memories)


async def test_the_holder_keeps_a_bounded_number_and_each_entry_is_taken_once() -> None:
    class Waiting:
        """An encoder that never answers (an embedding service that hangs)."""

        dim = 8

        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            await asyncio.Event().wait()
            return []

    generation = Generation(1, Waiting(), "waiting")
    prepared = PreparedQueries(max_entries=2)
    keys = [uuid.uuid4() for _ in range(3)]
    for key in keys:
        prepared.prepare(key, f"question {key}", generation, box_seconds=5)
    assert len(prepared) == 2 and prepared.take(keys[0]) is None  # the oldest went first
    first = prepared.take(keys[1])
    assert first is not None and prepared.take(keys[1]) is None
    prepared.drop(keys[2])
    assert len(prepared) == 0
    await asyncio.sleep(0)
    assert not first.encode.done()  # a taken entry is its taker's to finish or cancel
    first.encode.cancel()
