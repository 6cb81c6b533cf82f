"""Hybrid memory search against the real Postgres, with the deterministic HashEmbedder."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, insert, text

from memory.recall.embeddings import HashEmbedder
from memory.recall.fusion import Fusion
from memory.recall.index_search import BM25_B, BM25_K1, search_candidates, search_index
from memory.recall.keywords import memory_search_terms, memory_text
from memory.storage.db import Database
from memory.storage.models import MemoryItem

EMBEDDER = HashEmbedder()
WHEN = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)


async def remember(
    db: Database,
    content: str,
    *,
    tenant_id: str = "t1",
    user_id: str = "u1",
    conversation_id: uuid.UUID | None = None,
    turn_id: uuid.UUID | None = None,
    chunk_index: int = 0,
    seq: int = 1,
) -> uuid.UUID:
    """Insert one memory row the way the indexer does; returns its turn id."""
    turn_id = turn_id or uuid.uuid4()
    text = memory_text(content, name=None, created_at=WHEN + timedelta(minutes=seq))
    (vector,) = await EMBEDDER.embed([text])
    async with db.transaction() as session:
        await session.execute(
            insert(MemoryItem).values(
                index_id=1,
                tenant_id=tenant_id,
                user_id=user_id,
                conversation_id=conversation_id or uuid.uuid4(),
                turn_id=turn_id,
                chunk_index=chunk_index,
                turn_seq=seq,
                role="user",
                text=text,
                search_terms=func.to_tsvector("simple", memory_search_terms(text)),
                embedding=vector,
                turn_created_at=WHEN + timedelta(minutes=seq),
            )
        )
    return turn_id


async def search(db: Database, query: str, **kwargs: object) -> list:
    (vector,) = await EMBEDDER.embed([query])
    params: dict = {"tenant_id": "t1", "user_id": "u1", "k": 5, "index_id": 1} | kwargs
    async with db.transaction() as session:
        return await search_index(session, query_text=query, query_embedding=vector, **params)


async def test_finds_the_relevant_memory_first(db: Database) -> None:
    wanted = await remember(db, "My sister Anna lives in Lisbon and teaches piano.", seq=1)
    await remember(db, "I had pasta for dinner yesterday.", seq=2)
    await remember(db, "The weather was rainy all week.", seq=3)
    hits = await search(db, "Where does Anna live?")
    assert hits[0].turn_id == wanted
    assert hits[0].keyword_rank == 1
    assert hits[0].vector_rank is not None
    assert 0 < hits[0].score <= 1.0
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


async def test_never_returns_another_users_or_tenants_rows(db: Database) -> None:
    mine = await remember(db, "My passport number ends in 42 and expires in June.")
    await remember(db, "My passport number ends in 42 and expires in June.", user_id="u2")
    await remember(db, "My passport number ends in 42 and expires in June.", tenant_id="t2")
    await remember(db, "passport passport expires June", tenant_id="t2", user_id="u1")
    hits = await search(db, "When does my passport expire?", k=10)
    assert [h.turn_id for h in hits] == [mine]
    assert await search(db, "passport", user_id="nobody") == []


async def test_conversation_scope(db: Database) -> None:
    here, there = uuid.uuid4(), uuid.uuid4()
    inside = await remember(db, "We planned a trip to Kyoto in April.", conversation_id=here)
    await remember(db, "We planned a trip to Kyoto in October.", conversation_id=there)
    hits = await search(db, "trip to Kyoto", conversation_id=here)
    assert [h.turn_id for h in hits] == [inside]
    assert {h.conversation_id for h in await search(db, "trip to Kyoto")} == {here, there}


async def test_excluded_turns_are_not_returned(db: Database) -> None:
    current = await remember(db, "What is the name of my dog?", seq=2)
    answer = await remember(db, "My dog is called Biscuit.", seq=1)
    hits = await search(db, "What is the name of my dog?", exclude_turn_ids=[current])
    assert current not in {h.turn_id for h in hits}
    assert hits[0].turn_id == answer


async def test_chinese_keyword_match(db: Database) -> None:
    wanted = await remember(db, "我下个月去成都出差，顺便吃火锅。")
    await remember(db, "今天北京下雨了，我在家看书。")
    await remember(db, "I bought new running shoes.")
    hits = await search(db, "我什么时候去成都？")
    assert hits[0].turn_id == wanted
    assert hits[0].keyword_rank == 1


async def test_duplicates_collapse_to_one_hit(db: Database) -> None:
    turn = uuid.uuid4()
    await remember(db, "Biscuit the dog loves the beach. " * 3, turn_id=turn, chunk_index=0)
    await remember(db, "The dog Biscuit loves swimming at the beach.", turn_id=turn, chunk_index=1)
    await remember(db, "I am allergic to cats.", seq=2)
    await remember(db, "I'm allergic to cats!", seq=3)
    await remember(db, "i am ALLERGIC to cats", seq=4)
    dog_hits = await search(db, "Biscuit beach", k=10)
    assert [h.turn_id for h in dog_hits].count(turn) == 1
    cat_hits = await search(db, "allergic to cats", k=10)
    cat_texts = [h.text for h in cat_hits if "cats" in h.text.lower()]
    assert len(cat_texts) == 2  # "I'm" differs from "I am"; the case-only copy collapses


async def test_threshold_on_fused_score(db: Database) -> None:
    """RRF's scale: first in both lists is 1.0, so 0.9 keeps only such a hit."""
    await remember(db, "My favourite colour is teal.", seq=1)
    for i in range(12):
        await remember(db, f"Note {i}: groceries, errands and chores.", seq=i + 2)
    rrf = Fusion(method="rrf")
    everything = await search(db, "favourite colour", k=20, fusion=rrf)
    assert len(everything) > 1
    strict = await search(db, "favourite colour", k=20, min_score=0.9, fusion=rrf)
    assert [h.text for h in strict] == [everything[0].text]
    assert strict[0].score >= 0.9
    assert await search(db, "favourite colour", k=20, min_score=1.01, fusion=rrf) == []


async def test_threshold_on_learned_score(db: Database) -> None:
    """The learned fusion's scores lie in (0, 1); the threshold cuts its list the same way."""
    await remember(db, "My favourite colour is teal.", seq=1)
    for i in range(12):
        await remember(db, f"Note {i}: groceries, errands and chores.", seq=i + 2)
    everything = await search(db, "favourite colour", k=20)
    assert len(everything) > 1 and everything[0].score > everything[1].score
    strict = await search(db, "favourite colour", k=20, min_score=everything[0].score)
    assert [h.text for h in strict] == [everything[0].text]
    assert await search(db, "favourite colour", k=20, min_score=1.0) == []


async def test_k_limits_results(db: Database) -> None:
    for i in range(8):
        await remember(db, f"Memory number {i} about gardening tomatoes.", seq=i + 1)
    assert len(await search(db, "gardening tomatoes", k=3)) == 3
    assert await search(db, "gardening tomatoes", k=0) == []


async def test_keyword_score_is_okapi_bm25_of_the_question_terms(db: Database) -> None:
    """Term frequency counts a question word's every occurrence; other words only count in the length."""
    repeated = await remember(db, "Biscuit chewed a slipper, biscuit again, BISCUIT always.", seq=1)
    once = await remember(db, "Biscuit sleeps on the old slipper by the front door.", seq=2)
    await remember(db, "The weather was rainy all week in the valley.", seq=3)
    question = "biscuit slipper umbrella"
    async with db.transaction() as session:
        lexemes = (
            await session.execute(
                text(
                    "SELECT m.turn_id, length(m.search_terms) AS doc_len, t.lexeme,"
                    " array_length(t.positions, 1) AS tf"
                    " FROM memory_items m, unnest(m.search_terms) AS t"
                )
            )
        ).all()
        (vector,) = await EMBEDDER.embed([question])
        found = await search_candidates(
            session,
            tenant_id="t1",
            user_id="u1",
            query_text=question,
            query_embedding=vector,
            index_id=1,
            depth=10,
        )
    words = ["biscuit", "slipper", "umbrella"]
    tf = {(r.turn_id, r.lexeme): r.tf for r in lexemes}
    doc_len = {r.turn_id: r.doc_len for r in lexemes}
    matching = {turn for turn, lexeme in tf if lexeme in words}
    assert matching == {repeated, once} and tf[(repeated, "biscuit")] == 3
    average = sum(doc_len[t] for t in matching) / len(matching)

    def bm25(turn: uuid.UUID) -> float:
        score = 0.0
        for word in words:
            df = sum(1 for t in matching if (t, word) in tf)
            f = tf.get((turn, word), 0)
            if f:
                idf = math.log(1 + (len(doc_len) - df + 0.5) / (df + 0.5))
                length = 1 - BM25_B + BM25_B * doc_len[turn] / average
                score += idf * f * (BM25_K1 + 1) / (f + BM25_K1 * length)
        return score

    scores = {c.memory.turn_id: c.signals.bm25 for c in found}
    assert scores[repeated] == pytest.approx(bm25(repeated)) and scores[once] == pytest.approx(bm25(once))
    assert scores[repeated] > scores[once] > 0
