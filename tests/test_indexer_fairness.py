"""Fair indexing: a big import of one user never keeps another user's live turn waiting.

Found: one 5,000-turn import kept another tenant's fresh turn unindexed for over 240 s.
Live turns now come before imported history, and users are taken round-robin, on both
transports (Postgres: the claim's order; Kafka: a topic of history read only while no
live turn waits).
"""

from __future__ import annotations

import pytest
from sqlalchemy import text

from indexer.kafka_transport import KafkaQueueConsumer
from indexer.pg_queue import PgQueueConsumer
from indexer.relay import OutboxRelay
from indexer.worker import IndexerWorker
from memory.recall.embeddings import HashEmbedder
from memory.record.conversations import Owner, create_conversation
from memory.record.imports import ImportResult, ImportTurn, import_turns
from memory.storage.db import Database
from memory.storage.models import Conversation
from tests.support import wait_until
from tests.test_indexer import chat_turns, memorable, scalar, test_settings
from tests.test_lock_order import WorkingEmbedder, running
from tests.test_transport_contract import index_through, kafka_test_settings, publish_once

BACKLOG = 400


async def _import_backlog(db: Database, owner: Owner, turns: int) -> None:
    async with db.transaction() as session:
        conversation = await create_conversation(session, owner)
        items = [
            ImportTurn(role="user" if i % 2 == 0 else "assistant", content=memorable(i), external_id=f"h{i}")
            for i in range(turns)
        ]
        await import_turns(session, owner, conversation.id, items)


async def _memory_rows(db: Database, owner: Owner) -> int:
    return int(
        await scalar(
            db,
            "SELECT count(*) FROM memory_items WHERE tenant_id = :t AND user_id = :u",
            t=owner.tenant_id,
            u=owner.user_id,
        )
    )


@pytest.mark.parametrize("transport", ["postgres", "kafka"])
async def test_a_big_import_does_not_keep_another_tenants_live_turn_unindexed(
    transport: str, db: Database, pg_url: str, request: pytest.FixtureRequest
) -> None:
    importer, bystander = Owner("t-import", "u"), Owner("t-live", "u")
    await _import_backlog(db, importer, BACKLOG)
    if transport == "postgres":
        settings = test_settings(pg_url, indexer_batch_size=8)
        parts: list[object] = [IndexerWorker(db, settings, WorkingEmbedder())]
    else:
        settings = kafka_test_settings(
            pg_url, request.getfixturevalue("kafka_bootstrap"), indexer_batch_size=8
        )
        parts = [
            OutboxRelay(db, settings),
            IndexerWorker(db, settings, WorkingEmbedder(), consumer=KafkaQueueConsumer(settings)),
        ]
    async with running(*parts):
        # The indexer is busy with the backlog when the live turn arrives.
        await wait_until(lambda: _started(db, importer), 30, "the import being indexed")
        await chat_turns(db, [memorable(1)], owner=bystander)
        await wait_until(lambda: _indexed(db, bystander), 30, "the live turn indexed")
        # It did not wait for the backlog: most of the import is still to be indexed.
        assert await _memory_rows(db, importer) < BACKLOG // 2


async def _started(db: Database, owner: Owner) -> bool:
    return await _memory_rows(db, owner) > 0


async def _indexed(db: Database, owner: Owner) -> bool:
    return await _memory_rows(db, owner) >= 1


async def _imported_conversation(db: Database, owner: Owner) -> tuple[Conversation, ImportResult]:
    """A conversation of 40 imported turns, queued for the indexer."""
    async with db.transaction() as session:
        conversation = await create_conversation(session, owner)
        items = [
            ImportTurn(role="user" if i % 2 == 0 else "assistant", content=memorable(i)) for i in range(40)
        ]
        return conversation, await import_turns(session, owner, conversation.id, items)


async def test_a_live_turn_queued_behind_its_conversations_import_did_not_move_the_watermark_past_it(
    db: Database, pg_url: str
) -> None:
    # Regression: live turns were claimed before imported history also within one conversation,
    # so the live turn's batch moved the conversation's indexed_seq past the import still queued.
    # GET /v1/conversations/{id} (and `chatmem import`, which waits on it) then said the import was
    # searchable, and recall, which reads only turns above the watermark as not yet indexed, found
    # none of the import until the indexer got to it behind every other user's backlog.
    owner = Owner("t1", "u1")
    conversation, imported = await _imported_conversation(db, owner)
    await chat_turns(db, [memorable(99)], owner=owner, conversation_id=conversation.id)
    settings = test_settings(pg_url, indexer_batch_size=8)
    consumer = PgQueueConsumer(db, settings)
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), consumer=consumer)
    await consumer.start()
    try:
        await worker.process(await consumer.poll_batch(8, 0.1))  # one batch, the rest still queued
    finally:
        await consumer.stop()
    watermark = await scalar(db, "SELECT indexed_seq FROM conversations WHERE id = :id", id=conversation.id)
    assert 0 < watermark < imported.last_seq
    async with db.session() as session:
        indexed = set((await session.execute(text("SELECT DISTINCT turn_id FROM memory_items"))).scalars())
    # Every imported turn is in the index or above the watermark, where recall reads it unindexed.
    assert all(item.turn_id in indexed or item.seq > watermark for item in imported.items)


async def test_a_live_turn_consumed_before_its_published_import_did_not_move_the_watermark_past_it(
    db: Database, pg_url: str, kafka_bootstrap: str
) -> None:
    # Regression: with Kafka, the import was already on the history topic when the conversation's
    # next live turn went to the live topic; the indexer reads live turns first, and that turn's
    # batch moved indexed_seq past the imported turns published but not yet consumed. The
    # conversation said they were searchable and recall, which reads only turns above the
    # watermark as not yet indexed, missed them.
    owner = Owner("t1", "u1")
    conversation, imported = await _imported_conversation(db, owner)
    settings = kafka_test_settings(pg_url, kafka_bootstrap, indexer_batch_size=8)
    relay = OutboxRelay(db, settings)
    producer = await relay._open_producer()
    try:
        while await relay.publish_once(producer):
            pass  # the whole import is on the history topic
        await chat_turns(db, [memorable(99)], owner=owner, conversation_id=conversation.id)
        assert await relay.publish_once(producer) == 1  # the live turn, on the live topic
    finally:
        await producer.stop()
    consumer = KafkaQueueConsumer(settings)
    worker = IndexerWorker(db, settings, HashEmbedder(dim=384), consumer=consumer)
    await consumer.start()
    batches = 0
    try:
        while True:
            batch = await consumer.poll_batch(8, 10.0)
            assert batch, "the indexer got nothing within 10 s"
            await worker.process(batch)
            batches += 1
            watermark = await scalar(
                db, "SELECT indexed_seq FROM conversations WHERE id = :id", id=conversation.id
            )
            async with db.session() as session:
                indexed = set(
                    (await session.execute(text("SELECT DISTINCT turn_id FROM memory_items"))).scalars()
                )
            # Every imported turn is in the index or above the watermark, where recall reads it.
            missed = [i.seq for i in imported.items if i.turn_id not in indexed and i.seq <= watermark]
            assert not missed, f"after batch {batches} indexed_seq is {watermark}; not indexed: {missed}"
            if all(i.turn_id in indexed for i in imported.items) and watermark > imported.last_seq:
                break  # everything consumed: the watermark is past the import and the live turn
            assert batches < 10, f"indexed_seq stuck at {watermark}"
    finally:
        await consumer.stop()


@pytest.mark.parametrize("transport", ["postgres", "kafka"])
async def test_a_dead_lettered_turn_does_not_hold_its_conversations_watermark_back(
    transport: str, db: Database, pg_url: str, request: pytest.FixtureRequest
) -> None:
    # The watermark waits for a turn still queued; a dead-lettered turn is never indexed, so it
    # must be passed over (on Kafka its outbox row stayed pending: the conversation never moved on).
    conversation_id, turns = await chat_turns(db, [memorable(i) for i in range(3)])
    async with db.transaction() as session:
        await session.execute(
            text("""UPDATE outbox SET payload = payload || '{"v": 99}' WHERE turn_id = :id"""),
            {"id": turns[1].id},
        )
    if transport == "postgres":
        settings = test_settings(pg_url)
        consumer: PgQueueConsumer | KafkaQueueConsumer = PgQueueConsumer(db, settings)
    else:
        settings = kafka_test_settings(pg_url, request.getfixturevalue("kafka_bootstrap"))
        assert await publish_once(db, settings) == 3
        consumer = KafkaQueueConsumer(settings)
    worker = await index_through(db, settings, consumer, 3)
    assert worker.stats["dead_lettered"] == 1
    watermark = await scalar(db, "SELECT indexed_seq FROM conversations WHERE id = :id", id=conversation_id)
    assert watermark == turns[2].seq
    dead = await scalar(
        db, "SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL AND turn_id = :id", id=turns[1].id
    )
    assert dead == 1
