"""Sentence keys: a fact inside a long user message is found by its own sentence, and a key is
never a memory (not listed, gone with its item, rebuilt by a reindex).

The ranking test uses the real embedding model and the shipped fusion weights (retrieval is
the point); the others use the deterministic HashEmbedder.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from indexer.pipeline import IndexPipeline
from memory.config import default_embedding_model
from memory.recall import reindex
from memory.recall.embeddings import Embedder, HashEmbedder, SentenceTransformerEmbedder
from memory.recall.index import MemoryIndex, spec_key, spec_of
from memory.recall.index_search import search_candidates
from memory.recall.items import Embedded, correct_item, forget_item, list_items
from memory.recall.search import recall_memories
from memory.recall.sentence_keys import MIN_CHUNK_CHARS, sentence_keys, sentences
from memory.record.outbox import turn_payload
from memory.storage.db import Database
from tests.test_indexer import OWNER, chat_turns, test_settings

# A request about one thing that states a fact about the user in passing (LongMemEval's shape),
# among short messages about dogs and names that match the question better as a whole.
LONG_MESSAGE = (
    "I'm putting together a packing list for a weekend hiking trip in the mountains and I keep "
    "forgetting things, so I want a proper checklist this time. Last spring I adopted a grey "
    "rescue greyhound named Biscuit from the shelter on Elm Street. I need to know which layers "
    "to bring if the forecast says rain in the afternoon, and whether trail runners are enough "
    "or I really need boots. Could you also suggest some snacks that don't melt in a backpack?"
)
DISTRACTORS = [
    "Dogs at the shelter always look so hopeful when someone walks past the kennels.",
    "My neighbour has a greyhound too, they are such calm dogs around kids.",
    "I walked past the animal shelter on my way to work this morning, it was busy.",
    "I need a catchy name for the dog-walking business my cousin wants to start.",
    "The dog park near my office has a funny name that nobody can pronounce.",
    "Springtime walks in the park are the best part of the year for me.",
]
QUESTION = "What is the name of my dog?"
REPLY = "Thanks, I will keep that in mind for the trip."


@pytest.fixture(scope="module")
def real_encoder() -> SentenceTransformerEmbedder:
    encoder = SentenceTransformerEmbedder(default_embedding_model())
    encoder.load(threads=1)
    return encoder


async def index_chat(db: Database, pg_url: str, encoder: Embedder, texts: list[str]) -> list[Any]:
    """A user-assistant chat (user first, alternating) indexed through the real pipeline; its turns."""
    _, turns = await chat_turns(db, texts)
    await IndexPipeline(db, encoder, test_settings(pg_url)).index([turn_payload(t) for t in turns])
    return turns


async def key_rows(db: Database, turn_id: uuid.UUID | None = None) -> list[Any]:
    query = "SELECT turn_id, chunk_index, key_index, text, index_id FROM memory_items WHERE kind = 'sentence'"
    params: dict[str, Any] = {}
    if turn_id is not None:
        query += " AND turn_id = :turn_id"
        params["turn_id"] = turn_id
    async with db.session() as session:
        return list(await session.execute(text(query + " ORDER BY index_id, key_index"), params))


def test_a_long_message_a_person_wrote_gets_one_key_per_sentence() -> None:
    assert len(LONG_MESSAGE) >= MIN_CHUNK_CHARS
    keys = sentence_keys(LONG_MESSAGE, role="user", name=None)
    assert keys == sentences(LONG_MESSAGE)
    assert (
        "Last spring I adopted a grey rescue greyhound named Biscuit from the shelter on Elm Street." in keys
    )
    # A model's reply gets none; an assistant turn with a speaker name is a person's turn.
    assert sentence_keys(LONG_MESSAGE, role="assistant", name=None) == []
    assert sentence_keys(LONG_MESSAGE, role="assistant", name="Ben") == keys
    # Short chunks get none.
    assert sentence_keys(DISTRACTORS[0] + " " + DISTRACTORS[1], role="user", name=None) == []
    # Short sentences are merged into the next one.
    assert sentences("Yes. Sure! " + "x" * 30 + ". Ok.") == ["Yes. Sure! " + "x" * 30 + ". Ok."]


async def test_a_fact_inside_a_long_user_message_is_found_first_through_its_sentence_key(
    db: Database, pg_url: str, real_encoder: SentenceTransformerEmbedder
) -> None:
    texts = []
    for distractor in DISTRACTORS:
        texts += [distractor, "That sounds lovely, tell me more about it."]
    texts += [LONG_MESSAGE, "Here is a checklist for your hiking trip: rain jacket, fleece, boots."]
    turns = await index_chat(db, pg_url, real_encoder, texts)
    long_turn = turns[-2]
    assert len(await key_rows(db, long_turn.id)) == len(sentence_keys(LONG_MESSAGE, role="user", name=None))

    async def recalled_turns() -> list[Any]:
        recalled = await recall_memories(
            db,
            real_encoder,
            tenant_id=OWNER.tenant_id,
            user_id=OWNER.user_id,
            query_text=QUESTION,
            k=5,
            unindexed_limit=0,
        )
        return recalled.memories

    memories = await recalled_turns()
    assert memories[0].turn_id == long_turn.id
    # The memory returned is the chunk (the whole message), once; never a key's sentence.
    assert memories[0].text == LONG_MESSAGE and memories[0].chunk_index == 0
    assert [m.turn_id for m in memories].count(long_turn.id) == 1
    (vector,) = await real_encoder.embed([QUESTION])
    async with db.transaction() as session:
        candidates = await search_candidates(
            session,
            tenant_id=OWNER.tenant_id,
            user_id=OWNER.user_id,
            query_text=QUESTION,
            query_embedding=vector,
            index_id=1,
            depth=100,
        )
    (found,) = [c for c in candidates if c.memory.turn_id == long_turn.id]
    assert found.signals.key_rank == 1  # its sentence is the dense list's best key
    assert found.signals.key_cosine is not None and found.signals.key_cosine > found.signals.cosine

    # Without its keys the message's own vector is about hiking: the fact is not found first.
    async with db.transaction() as session:
        await session.execute(text("DELETE FROM memory_items WHERE kind = 'sentence'"))
    without = await recalled_turns()
    assert without[0].turn_id != long_turn.id


async def test_sentence_keys_are_never_listed_as_memory_items(db: Database, pg_url: str) -> None:
    turns = await index_chat(db, pg_url, HashEmbedder(), [LONG_MESSAGE, REPLY, DISTRACTORS[0]])
    assert await key_rows(db)
    async with db.session() as session:
        items, _ = await list_items(session, OWNER, limit=100)
        chunk_ids = set(
            (await session.execute(text("SELECT id FROM memory_items WHERE kind = 'chunk'"))).scalars()
        )
    assert {item.id for item in items} == chunk_ids
    assert {item.text for item in items} == {LONG_MESSAGE, REPLY, DISTRACTORS[0]}
    assert [item.turn_id for item in items].count(turns[0].id) == 1


@pytest.mark.parametrize("change", ["forget", "correct"])
async def test_forgetting_or_correcting_an_item_removes_its_turns_keys_for_good(
    db: Database, pg_url: str, change: str
) -> None:
    encoder = HashEmbedder()
    turns = await index_chat(db, pg_url, encoder, [LONG_MESSAGE, REPLY])
    long_turn = turns[0]
    assert await key_rows(db, long_turn.id)
    async with db.transaction() as session:
        items, _ = await list_items(session, OWNER, limit=10)
        (item,) = [i for i in items if i.turn_id == long_turn.id]
        if change == "forget":
            await forget_item(session, OWNER, item.id)
        else:
            corrected = "I have no dog."
            [vector] = await encoder.embed([corrected])
            await correct_item(session, OWNER, item.id, Embedded(corrected, vector, corrected, index_id=1))
    assert await key_rows(db, long_turn.id) == []
    # The turn's payload delivered again (a redelivery, a retry) writes no keys for it.
    await IndexPipeline(db, encoder, test_settings(pg_url)).index([turn_payload(long_turn)])
    assert await key_rows(db, long_turn.id) == []
    recalled = await recall_memories(
        db,
        encoder,
        tenant_id=OWNER.tenant_id,
        user_id=OWNER.user_id,
        query_text="Biscuit the greyhound from the shelter on Elm Street",
        k=5,
        unindexed_limit=0,
    )
    memories = recalled.memories
    assert all("Biscuit" not in m.text for m in memories)


async def test_a_reindex_for_a_pipeline_change_builds_the_sentence_keys(db: Database, pg_url: str) -> None:
    """An index built before sentence keys (pipeline 1) is searched as it is, then rebuilt with keys."""
    encoder = HashEmbedder()
    turns = await index_chat(
        db, pg_url, encoder, [LONG_MESSAGE, REPLY, DISTRACTORS[1], REPLY + " Anything else?"]
    )
    expected = await key_rows(db)
    assert expected
    # As an index built by pipeline 1 (no keys) is found after an upgrade.
    before = {**spec_of(encoder), "pipeline": "1"}
    async with db.transaction() as session:
        await session.execute(text("DELETE FROM memory_items WHERE kind = 'sentence'"))
        await session.execute(
            text("UPDATE memory_indexes SET spec = CAST(:spec AS jsonb), spec_key = :key WHERE id = 1"),
            {"spec": json.dumps(before), "key": spec_key(before)},
        )
    # A process with this encoder still searches it (same vectors), and says it needs a rebuild.
    index = MemoryIndex(db, encoder)
    assert (await index.start()).id == 1
    assert index.mismatch is not None and "reindex" in index.mismatch

    ids = await reindex.begin(db, encoder)
    assert ids == (1, 2)
    progress = await reindex.build(db, encoder, *ids)
    assert progress.switched and progress.done == progress.total == 4  # chunks; keys are not counted
    rebuilt = await key_rows(db)
    assert [(r.turn_id, r.chunk_index, r.key_index, r.text) for r in rebuilt] == [
        (r.turn_id, r.chunk_index, r.key_index, r.text) for r in expected
    ]
    assert {r.index_id for r in rebuilt} == {2}
    assert {r.turn_id for r in rebuilt} == {turns[0].id}
    # Nothing left to rebuild: the active generation is this pipeline's.
    assert await reindex.begin(db, encoder) is None
    await asyncio.sleep(0)
