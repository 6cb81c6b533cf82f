"""Fact keys: with FACT_KEYS=model the indexer asks the rewrite model for the facts a user's
message states and indexes them as search keys of that turn; a late, failed or unusable
answer gives none and the turn is indexed all the same; demo mode never asks; a key is never
a memory and goes with its item.

The model is the strict fake OpenAI server (a real HTTP server, the real `openai` SDK through
the real provider) where the protocol is the point, and the real local model (llama-server,
skipped when it cannot be installed) where what a real model answers is the point. The
assertions are about stored rows and requests, never the model's wording.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy import text

from chat_api.app import fact_asker, make_provider
from indexer.pipeline import IndexPipeline, IndexResult
from memory.config import Settings, default_embedding_model
from memory.recall import reindex
from memory.recall.embeddings import Embedder, HashEmbedder, SentenceTransformerEmbedder
from memory.recall.fact_keys import MAX_FACTS, parse_facts, wants_facts
from memory.recall.items import forget_item, list_items
from memory.recall.search import recall_memories
from memory.record.outbox import turn_payload
from memory.storage.db import Database
from tests.fake_openai import FakeOpenAI, Reply
from tests.real_model import RealModel
from tests.test_indexer import OWNER, chat_turns, test_settings
from tests.test_sentence_keys import DISTRACTORS, LONG_MESSAGE, QUESTION, REPLY

ANSWER = (
    "Here is a checklist for your hiking trip: a rain jacket, a fleece, boots rather than trail "
    "runners if the paths are wet, and snacks such as nuts and dried fruit."
)
FACTS = "The user adopted a grey rescue greyhound named Biscuit.\nThe user is planning a hiking trip."


def fact_settings(pg_url: str, base_url: str, **overrides: Any) -> Settings:
    """Settings with a real model configured and fact keys on."""
    base: dict[str, Any] = {
        "llm_provider": "openai",
        "llm_base_url": base_url,
        "llm_model": "chat-model",
        "rewrite_model": "small-model",
        "llm_max_retries": 0,
        "fact_keys": "model",
        "fact_keys_timeout_seconds": 5.0,
    }
    return test_settings(pg_url, **(base | overrides))


async def index_with_facts(
    db: Database, settings: Settings, encoder: Embedder, texts: list[str]
) -> tuple[list[Any], IndexResult]:
    """A user-assistant chat indexed in one batch by the pipeline, facts asked through the settings' model."""
    _, turns = await chat_turns(db, texts)
    provider = make_provider(settings)
    try:
        pipeline = IndexPipeline(db, encoder, settings, facts=fact_asker(settings, provider))
        result = await pipeline.index([turn_payload(t) for t in turns])
    finally:
        await provider.aclose()
    return turns, result


async def rows(db: Database, kind: str) -> list[Any]:
    async with db.session() as session:
        return list(
            await session.execute(
                text(
                    "SELECT turn_id, chunk_index, key_index, text, index_id, role FROM memory_items"
                    " WHERE kind = :kind ORDER BY turn_id, key_index"
                ),
                {"kind": kind},
            )
        )


def test_facts_are_parsed_bounded_and_checked_against_the_message() -> None:
    assert parse_facts(FACTS, LONG_MESSAGE) == tuple(FACTS.splitlines())
    assert parse_facts("- The user adopted Biscuit.\n2. The user hikes.", LONG_MESSAGE) == (
        "The user adopted Biscuit.",
        "The user hikes.",
    )
    assert parse_facts("NONE", LONG_MESSAGE) == ()
    # Small models write the facts as one paragraph: one fact a sentence; a question is none.
    assert parse_facts(
        "The user has a greyhound named Biscuit. They need boots for the hiking trip. Can you help?",
        LONG_MESSAGE,
    ) == ("The user has a greyhound named Biscuit.", "They need boots for the hiking trip.")
    # Junk: code, JSON, headings, empty, and lines that share no word with the message (invented).
    assert parse_facts('```json\n{"facts": ["Biscuit"]}\n```', LONG_MESSAGE) is None
    assert parse_facts("Here is what the message says:", LONG_MESSAGE) is None
    assert parse_facts("The user owns a yacht in Monaco.", LONG_MESSAGE) is None
    assert parse_facts("   \n", LONG_MESSAGE) is None
    many = "\n".join(f"The user packs snack number {i}." for i in range(20))
    assert len(parse_facts(many, LONG_MESSAGE) or ()) == MAX_FACTS
    assert parse_facts("The user " + "hikes " * 60, LONG_MESSAGE) is None  # longer than a fact
    # Only a user's own messages, long enough to hide a fact, are asked about.
    assert wants_facts(LONG_MESSAGE, role="user")
    assert not wants_facts(LONG_MESSAGE, role="assistant")
    assert not wants_facts("I live in Porto.", role="user")


def test_no_fact_requests_in_demo_mode_or_when_switched_off(pg_url: str, fake_openai: FakeOpenAI) -> None:
    demo = test_settings(pg_url, fact_keys="model")
    assert demo.llm_provider == "demo"
    assert fact_asker(demo, make_provider(demo)) is None
    off = fact_settings(pg_url, fake_openai.base_url, fact_keys="off")
    assert fact_asker(off, make_provider(off)) is None
    assert fact_asker(test_settings(pg_url), make_provider(test_settings(pg_url))) is None


async def test_a_user_turn_gets_the_models_facts_as_keys_never_listed_and_gone_when_forgotten(
    db: Database, pg_url: str, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(Reply(text=FACTS))
    settings = fact_settings(pg_url, fake_openai.base_url)
    turns, result = await index_with_facts(db, settings, HashEmbedder(), [LONG_MESSAGE, ANSWER])
    long_turn = turns[0]
    # One request, for the user's long turn only (the assistant's reply is not asked), to the rewrite model.
    assert len(fake_openai.requests) == 1
    request = fake_openai.requests[0]
    assert request.model == "small-model" and not request.stream
    assert "Biscuit" in request.messages[-1]["content"]
    facts = await rows(db, "fact")
    assert [(r.turn_id, r.chunk_index, r.key_index, r.text) for r in facts] == [
        (long_turn.id, 0, i, fact) for i, fact in enumerate(FACTS.splitlines())
    ]
    assert {r.index_id for r in facts} == {1} and {r.role for r in facts} == {"user"}
    assert result.facts == 2 and result.indexed_turns == 2
    assert [a.outcome for a in result.fact_answers] == ["facts"]

    # Keys are never memory items.
    async with db.session() as session:
        items, _ = await list_items(session, OWNER, limit=100)
    assert sorted(i.text for i in items) == sorted([LONG_MESSAGE, ANSWER])

    # A redelivery does not ask again and keeps the facts.
    provider = make_provider(settings)
    try:
        again = IndexPipeline(db, HashEmbedder(), settings, facts=fact_asker(settings, provider))
        await again.index([turn_payload(long_turn)])
    finally:
        await provider.aclose()
    assert len(fake_openai.requests) == 1
    assert len(await rows(db, "fact")) == 2

    # Forgetting the item removes its turn's fact keys, and a redelivery brings none back.
    (item,) = [i for i in items if i.turn_id == long_turn.id]
    async with db.transaction() as session:
        await forget_item(session, OWNER, item.id)
    assert await rows(db, "fact") == []
    await IndexPipeline(db, HashEmbedder(), settings).index([turn_payload(long_turn)])
    assert await rows(db, "fact") == []


@pytest.mark.parametrize(
    "reply, outcome",
    [
        (Reply(text=FACTS, chunk_delay=8.0), "timeout"),
        (Reply(fail_status=500, fail_message="the model is down"), "error"),
        (Reply(text='```json\n{"facts": ["The user owns a yacht"]}\n```'), "junk"),
    ],
    ids=["timeout", "error", "junk"],
)
async def test_a_late_failed_or_unusable_answer_gives_no_keys_and_the_turn_is_indexed(
    db: Database, pg_url: str, fake_openai: FakeOpenAI, reply: Reply, outcome: str
) -> None:
    fake_openai.script(reply, Reply(text=FACTS))
    # The time box leaves room for the answers meant to fit on a loaded machine.
    settings = fact_settings(pg_url, fake_openai.base_url, fact_keys_timeout_seconds=1.5)
    second = LONG_MESSAGE.replace("Biscuit", "Pepper")
    started = time.monotonic()
    turns, result = await index_with_facts(db, settings, HashEmbedder(), [LONG_MESSAGE, REPLY, second])
    elapsed = time.monotonic() - started
    assert [r for r in await rows(db, "fact") if r.turn_id == turns[0].id] == []
    async with db.session() as session:
        chunks = set(
            (await session.execute(text("SELECT turn_id FROM memory_items WHERE kind = 'chunk'"))).scalars()
        )
    assert chunks == {t.id for t in turns}  # every turn indexed, the sentence keys too
    assert await rows(db, "sentence")
    assert result.fact_answers[0].outcome == outcome
    if outcome in ("timeout", "error"):
        # The rest of the batch is not asked: a model that is away costs one time box per batch.
        assert [a.outcome for a in result.fact_answers] == [outcome]
        assert len(fake_openai.requests) == 1
        assert await rows(db, "fact") == []
    else:
        # An unusable answer is that message's alone: the next message is asked and gets its facts.
        assert [a.outcome for a in result.fact_answers] == ["junk", "facts"]
        assert {r.turn_id for r in await rows(db, "fact")} == {turns[2].id}
    if outcome == "timeout":
        assert result.fact_answers[0].seconds < 4.0  # the 8 s answer was not awaited
        assert elapsed < 15.0


async def test_a_batch_stops_asking_once_it_spent_its_fact_budget(
    db: Database, pg_url: str, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(Reply(text=FACTS, chunk_delay=0.4), Reply(text=FACTS))
    settings = fact_settings(pg_url, fake_openai.base_url, fact_keys_batch_seconds=0.2)
    second = LONG_MESSAGE.replace("Biscuit", "Pepper")
    turns, result = await index_with_facts(db, settings, HashEmbedder(), [LONG_MESSAGE, REPLY, second])
    assert [a.outcome for a in result.fact_answers] == ["facts"]
    assert len(fake_openai.requests) == 1
    assert {r.turn_id for r in await rows(db, "fact")} == {turns[0].id}
    assert result.indexed_turns == 3


async def test_a_reindex_copies_the_fact_keys_without_asking_the_model(
    db: Database, pg_url: str, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(Reply(text=FACTS))
    settings = fact_settings(pg_url, fake_openai.base_url)
    await index_with_facts(db, settings, HashEmbedder(dim=384), [LONG_MESSAGE, REPLY])
    before = await rows(db, "fact")
    assert len(before) == 2
    other = HashEmbedder(dim=384, seed=7)
    ids = await reindex.begin(db, other)
    assert ids is not None
    await reindex.build(db, other, *ids)
    after = [r for r in await rows(db, "fact") if r.index_id == ids[1]]
    assert [(r.turn_id, r.chunk_index, r.key_index, r.text) for r in after] == [
        (r.turn_id, r.chunk_index, r.key_index, r.text) for r in before
    ]
    assert len(fake_openai.requests) == 1
    # Re-embedded by the new encoder: the copy's vector is the new encoder's, not the old one's.
    async with db.session() as session:
        vectors = {
            r.index_id: r.embedding
            for r in await session.execute(
                text(
                    "SELECT index_id, embedding::text AS embedding FROM memory_items"
                    " WHERE kind = 'fact' AND key_index = 0"
                )
            )
        }
    assert vectors[ids[0]] != vectors[ids[1]]


@pytest.fixture(scope="module")
def real_encoder() -> SentenceTransformerEmbedder:
    encoder = SentenceTransformerEmbedder(default_embedding_model())
    encoder.load(threads=1)
    return encoder


@pytest.mark.real_model
async def test_the_real_model_gives_a_buried_fact_a_key_that_finds_its_turn(
    db: Database, pg_url: str, real_model: RealModel, real_encoder: SentenceTransformerEmbedder
) -> None:
    settings = fact_settings(
        pg_url,
        real_model.base_url,
        llm_model=real_model.model,
        rewrite_model=real_model.model,
        llm_api_key=real_model.api_key,
        fact_keys_timeout_seconds=120.0,
    )
    texts = []
    for distractor in DISTRACTORS:
        texts += [distractor, "That sounds lovely, tell me more about it."]
    texts += [LONG_MESSAGE, ANSWER]
    async with asyncio.timeout(600):
        turns, result = await index_with_facts(db, settings, real_encoder, texts)
    long_turn = turns[-2]
    assert [a.outcome for a in result.fact_answers] == ["facts"], (
        result.fact_answers
    )  # the only long user turn
    facts = [r for r in await rows(db, "fact") if r.turn_id == long_turn.id]
    assert facts, "the real model stated no fact of the message"
    # Search through the fact keys alone: the sentence keys out of the way (with them, the
    # message is found first by its sentence: tests/test_sentence_keys.py).
    async with db.transaction() as session:
        await session.execute(text("DELETE FROM memory_items WHERE kind = 'sentence'"))

    async def rank() -> int | None:
        recalled = await recall_memories(
            db,
            real_encoder,
            tenant_id=OWNER.tenant_id,
            user_id=OWNER.user_id,
            query_text=QUESTION,
            k=len(texts),
            unindexed_limit=0,
        )
        found = [m.turn_id for m in recalled.memories]
        return found.index(long_turn.id) + 1 if long_turn.id in found else None

    with_facts = await rank()
    # Without the fact keys the message's own vector is about hiking.
    async with db.transaction() as session:
        await session.execute(text("DELETE FROM memory_items WHERE kind = 'fact'"))
    without = await rank()
    # The facts lift the turn (the model's words decide by how much: not asserted).
    assert with_facts is not None and without is not None, (with_facts, without)
    assert with_facts < without, ([f.text for f in facts], with_facts, without)
