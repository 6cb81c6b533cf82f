"""Metrics and JSON logs."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import re
from typing import Any

import httpx
from sqlalchemy import event, text

from chat_api.observability import JsonFormatter, bind_log_context, log_context, loggable_text


def test_json_log_line_carries_the_bound_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.observability")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with log_context(request_id="r1"):
            bind_log_context(tenant_id="t1", conversation_id="c1")
            with log_context(turn_id="u1"):
                logger.warning("turn %s", "done", extra={"status": "completed"})
            logger.warning("after")
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "turn done" and first["level"] == "warning" and first["status"] == "completed"
    assert (first["request_id"], first["tenant_id"], first["conversation_id"], first["turn_id"]) == (
        "r1",
        "t1",
        "c1",
        "u1",
    )
    assert "turn_id" not in second and second["tenant_id"] == "t1"
    assert "request_id" not in third


def test_message_text_stays_out_of_logs_by_default() -> None:
    assert loggable_text("my secret plans") == "<15 chars>"


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text format."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match[1] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match[2])
    return None


async def test_metrics_and_request_ids_on_a_live_server(server: Any) -> None:
    async with server.client() as client:
        response = await client.get("/healthz", headers={"X-Request-ID": "req-123"})
        assert response.headers["x-request-id"] == "req-123"
        made_up = await client.get("/healthz", headers={"X-Request-ID": "bad id\twith tab"})
        assert re.fullmatch(r"[0-9a-f]{32}", made_up.headers["x-request-id"])

        conversation = (await client.post("/v1/conversations", json={"title": "m"})).json()["id"]
        reply = await client.post(
            f"/v1/conversations/{conversation}/messages", json={"content": "hello there", "stream": False}
        )
        assert reply.status_code == 200
        question = {"content": "Where does my sister Ingrid keep her honeybees?", "stream": False}
        assert (await client.post(f"/v1/conversations/{conversation}/messages", json=question)).is_success

        scrape = await client.get("/metrics")
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    text = scrape.text
    assert (sample(text, "chatmem_http_requests_total", route="/healthz", status="200") or 0) >= 2
    created = sample(text, "chatmem_http_requests_total", route="/v1/conversations", status="201")
    assert created is not None and created >= 1
    # No indexer runs in this app: the user and assistant turns wait in the outbox.
    backlog = sample(text, "chatmem_outbox_backlog")
    assert backlog is not None and backlog >= 2
    assert (sample(text, "chatmem_outbox_oldest_age_seconds") or 0) >= 0
    assert sample(text, "chatmem_dead_letters") == 0
    # The recall before the second reply rewrote the question and searched memory.
    rewrites = re.findall(r'^chatmem_rewrite_seconds_count\{outcome="(\w+)"\} (\S+)$', text, re.MULTILINE)
    assert sum(float(n) for _, n in rewrites) >= 1, rewrites
    assert {outcome for outcome, _ in rewrites} <= {"model", "fallback", "timeout", "skipped"}
    assert (sample(text, "chatmem_retrieval_seconds_count") or 0) >= 1


async def test_a_cli_server_freezes_its_startup_objects_and_collects_less_often(
    make_settings: Any, db: Any
) -> None:
    """What `chatmem serve` asks of create_app: startup objects out of the collector's walk, calmer GC."""
    from chat_api.app import create_app
    from memory.recall.embeddings import HashEmbedder
    from tests.conftest import LiveServer

    before = gc.get_threshold()
    settings = make_settings(gc_thresholds=(12_345, 11, 101))
    server = LiveServer(create_app(settings, embedder=HashEmbedder(), freeze_startup_objects=True))
    await server.start()
    try:
        assert gc.get_threshold() == (12_345, 11, 101)
        assert gc.get_freeze_count() > 10_000  # everything imported and loaded so far
    finally:
        await server.stop()
        gc.unfreeze()
        gc.set_threshold(*before)


async def test_a_flood_of_unauthenticated_scrapes_reads_the_outbox_once(server: Any) -> None:
    """Found: each /metrics request (no token needed) ran the outbox query on a pooled connection."""
    reads: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "FROM outbox" in statement:
            reads.append(statement)

    engine = server.services.db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
            scrapes = await asyncio.gather(*(anonymous.get("/metrics") for _ in range(40)))
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert all(s.status_code == 200 and "chatmem_outbox_backlog" in s.text for s in scrapes)
    assert len(reads) == 1, len(reads)


async def test_kafka_turns_published_but_not_consumed_by_the_indexer_show_in_a_gauge(
    start_server: Any, db: Any, pg_url: str, kafka_bootstrap: str
) -> None:
    """Found: on Kafka the backlog gauge counts only unpublished rows: with the indexer down it read 0."""
    from indexer.kafka_transport import KafkaQueueConsumer
    from tests.support import wait_until
    from tests.test_indexer import chat_turns, memorable
    from tests.test_transport_contract import index_through, kafka_test_settings, publish_once

    settings = kafka_test_settings(pg_url, kafka_bootstrap)
    server = await start_server(
        **{k: getattr(settings, k) for k in ("kafka_bootstrap_servers", "kafka_topic", "kafka_dlq_topic")}
    )
    # Rows consumed before consumption was marked on Kafka stay unmarked below the watermark: not lag.
    _, old = await chat_turns(db, [memorable(i) for i in range(2)])
    async with db.transaction() as session:
        await session.execute(text("UPDATE outbox SET published_at = now()"))
        await session.execute(text("UPDATE conversations SET indexed_seq = :seq"), {"seq": old[-1].seq})
    await chat_turns(db, [memorable(i) for i in range(2, 5)])
    assert await publish_once(db, settings) == 3

    async def scrape() -> str:
        async with httpx.AsyncClient(base_url=server.base_url) as anonymous:
            return (await anonymous.get("/metrics")).text

    first = await scrape()
    assert sample(first, "chatmem_outbox_backlog") == 0  # all published
    assert sample(first, "chatmem_outbox_unconsumed") == 3  # none consumed: the indexer is down
    assert (sample(first, "chatmem_outbox_unconsumed_oldest_age_seconds") or 0) > 0

    await index_through(db, settings, KafkaQueueConsumer(settings), 3)
    last = ""

    async def drained() -> bool:
        nonlocal last
        last = await scrape()  # the database gauges are read again every few seconds
        return sample(last, "chatmem_outbox_unconsumed") == 0

    await wait_until(drained, timeout=15, every=0.5)
    assert sample(last, "chatmem_outbox_unconsumed_oldest_age_seconds") == 0
