"""Fair indexing: a big import of one user never keeps another user's live turn waiting.

Found: one 5,000-turn import kept another tenant's fresh turn unindexed for over 240 s.
Live turns now come before imported history, and users are taken round-robin, on both
transports (Postgres: the claim's order; Kafka: a topic of history read only while no
live turn waits).
"""

from __future__ import annotations

import pytest

from indexer.kafka_transport import KafkaQueueConsumer
from indexer.relay import OutboxRelay
from indexer.worker import IndexerWorker
from memory.record.conversations import Owner, create_conversation
from memory.record.imports import ImportTurn, import_turns
from memory.storage.db import Database
from tests.support import wait_until
from tests.test_indexer import chat_turns, memorable, scalar, test_settings
from tests.test_lock_order import WorkingEmbedder, running
from tests.test_transport_contract import kafka_test_settings

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
