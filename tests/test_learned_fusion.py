"""The learned fusion against the real Postgres: what it ranks first, its neighbour signals, the RRF fallback.

Memories are inserted the way the indexer writes them (``memory_text`` with the speaker's
name, keyword terms with the previous turn's words) and embedded by the deterministic
HashEmbedder; the weights are the shipped ones (memory/recall/fusion_weights.py).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, insert

from memory.recall.embeddings import HashEmbedder
from memory.recall.fusion import (
    FEATURE_NAMES,
    Fusion,
    fusion_features,
    is_model_reply,
    is_question,
    named_speakers,
)
from memory.recall.index_search import search_candidates, search_index
from memory.recall.keywords import memory_search_terms, memory_text, photo_caption
from memory.recall.unindexed import UnindexedTurn, score_unindexed
from memory.storage.db import Database
from memory.storage.models import MemoryItem

EMBEDDER = HashEmbedder()
WHEN = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)
RRF = Fusion(method="rrf")
LEARNED = Fusion(method="learned")


async def remember_conversation(
    db: Database,
    turns: list[tuple[str | None, str]],
    *,
    user_id: str = "u1",
    metadata: dict[int, dict[str, str]] | None = None,
    roles: list[str] | None = None,
) -> list[uuid.UUID]:
    """One conversation of (speaker, content) turns, indexed as the indexer would; the turn ids.

    ``metadata`` maps a turn's position (0-based) to its stored metadata; ``roles`` gives
    each turn's role (default: user and assistant in turn, as a LoCoMo import has them).
    """
    conversation_id = uuid.uuid4()
    ids = []
    previous: str | None = None
    async with db.transaction() as session:
        for seq, (name, content) in enumerate(turns, 1):
            turn_id = uuid.uuid4()
            created = WHEN + timedelta(minutes=seq)
            meta = (metadata or {}).get(seq - 1)
            text = memory_text(content, name=name, created_at=created, extra=photo_caption(meta))
            (vector,) = await EMBEDDER.embed([text])
            await session.execute(
                insert(MemoryItem).values(
                    index_id=1,
                    tenant_id="t1",
                    user_id=user_id,
                    conversation_id=conversation_id,
                    turn_id=turn_id,
                    chunk_index=0,
                    turn_seq=seq,
                    role=roles[seq - 1] if roles else ("user" if seq % 2 else "assistant"),
                    name=name,
                    text=text,
                    search_terms=func.to_tsvector("simple", memory_search_terms(text, previous=previous)),
                    embedding=vector,
                    turn_created_at=created,
                    meta=meta,
                )
            )
            previous = f"{name}: {content}" if name else content
            ids.append(turn_id)
    return ids


async def remember_chat(db: Database, turns: list[tuple[str, str]]) -> list[uuid.UUID]:
    """A user-assistant chat: (role, content) turns with no speaker names."""
    return await remember_conversation(
        db, [(None, content) for _, content in turns], roles=[role for role, _ in turns]
    )


async def search(db: Database, query: str, fusion: Fusion = LEARNED, k: int = 5) -> list:
    (vector,) = await EMBEDDER.embed([query])
    async with db.transaction() as session:
        return await search_index(
            session,
            tenant_id="t1",
            user_id="u1",
            query_text=query,
            query_embedding=vector,
            index_id=1,
            k=k,
            fusion=fusion,
        )


async def test_learned_fusion_puts_the_obvious_answer_first(db: Database) -> None:
    ids = await remember_conversation(
        db,
        [
            ("Ana", "My sister lives in Lisbon and teaches piano at the conservatory."),
            ("Ben", "I had pasta for dinner yesterday."),
            ("Ana", "The weather was rainy all week."),
            ("Ben", "We are repainting the kitchen in a pale green."),
        ],
    )
    hits = await search(db, "Where does Ana's sister teach piano?")
    assert hits[0].turn_id == ids[0]
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert all(0 < h.score < 1 for h in hits)
    assert hits[0].keyword_rank == 1 and hits[0].vector_rank is not None


async def test_a_reply_right_after_a_matching_question_is_found(db: Database) -> None:
    """The reply shares no word with the question; its neighbour (the question before it) does."""
    ids = await remember_conversation(
        db,
        [
            ("Mel", "What did you research for your volunteering project?"),
            ("Caro", "Adoption agencies, mostly the small ones upstate."),
            ("Mel", "Nice! My kids started swimming lessons."),
            ("Caro", "Swimming is great, they will love it."),
        ],
    )
    await remember_conversation(
        db, [("Mel", f"Grocery list number {i}: apples and bread.") for i in range(6)]
    )
    question = "What did Caro research for the volunteering project?"
    (vector,) = await EMBEDDER.embed([question])
    async with db.transaction() as session:
        candidates = await search_candidates(
            session,
            tenant_id="t1",
            user_id="u1",
            query_text=question,
            query_embedding=vector,
            index_id=1,
            depth=1,
        )
    reply = next(c for c in candidates if c.memory.turn_id == ids[1])
    # Its previous turn's scores come from the statement even though that turn is outside both top-1 lists.
    assert reply.signals.previous is not None and reply.signals.previous.is_question
    assert reply.signals.previous.bm25 > 0 and reply.signals.previous.cosine > 0
    assert reply.signals.next is not None and not reply.signals.next.is_question
    features = dict(
        zip(
            FEATURE_NAMES,
            fusion_features([c.signals for c in candidates], question)[candidates.index(reply)],
            strict=True,
        )
    )
    assert features["previous_person_is_question"] == 1.0  # a named speaker's turn: a person's
    assert features["previous_model_is_question"] == 0.0
    hits = await search(db, question, k=2)
    assert ids[1] in [h.turn_id for h in hits]


async def test_the_rrf_fallback_still_fuses_ranks(db: Database) -> None:
    ids = await remember_conversation(
        db,
        [
            ("Ana", "My favourite colour is teal."),
            *[("Ben", f"Note {i}: errands and chores.") for i in range(8)],
        ],
    )
    hits = await search(db, "favourite colour", RRF, k=20)
    assert hits[0].turn_id == ids[0]
    assert hits[0].score == 1.0  # first in both lists: RRF's normalised top
    assert hits[0].score == RRF.rrf(hits[0].vector_rank, hits[0].keyword_rank)
    learned = await search(db, "favourite colour", LEARNED, k=20)
    assert {h.turn_id for h in learned} == {h.turn_id for h in hits}  # the same candidates, re-ordered
    assert learned[0].turn_id == ids[0]


async def test_odd_queries_behave_as_with_rrf(db: Database) -> None:
    await remember_conversation(
        db,
        [
            ("Ana", "我下个月去成都出差，顺便吃火锅。"),
            ("Ben", "Café crème at the Zürich station 🚆 was great."),
            ("Ana", "I bought new running shoes."),
        ],
    )
    huge = " ".join(f"word{i}" for i in range(400)) + " running shoes"
    for query in ("", "   ", "？！…", "🚆🚆", "Zürich café", "成都", huge):
        learned = await search(db, query, LEARNED, k=10)
        rrf = await search(db, query, RRF, k=10)
        assert {h.turn_id for h in learned} == {h.turn_id for h in rrf}, query
        assert len({h.turn_id for h in learned}) == len(learned)


async def test_no_memories_and_k_zero(db: Database) -> None:
    assert await search(db, "anything at all", k=5) == []
    await remember_conversation(db, [("Ana", "Something to remember.")])
    assert await search(db, "remember", k=0) == []


def test_speaker_names_and_questions_are_recognised_as_words() -> None:
    assert named_speakers("What did Caroline paint?", ["Caroline", "Mel", None]) == {"Caroline"}
    assert named_speakers("What did Carolines paint?", ["Caroline"]) == set()
    assert named_speakers("Did mel and CAROLINE meet?", ["Caroline", "Mel"]) == {"Caroline", "Mel"}
    assert is_question("Did you go?  ")
    assert not is_question("Did you go? I went.")


async def test_a_captioned_image_is_a_signal_of_its_turn(db: Database) -> None:
    ids = await remember_conversation(
        db,
        [("Mel", "Look what we found at the beach!"), ("Caro", "Looks like a fun beach day.")],
        metadata={0: {"blip_caption": "a dog digging in the sand"}},
    )
    question = "What did Mel find at the beach?"
    (vector,) = await EMBEDDER.embed([question])
    async with db.transaction() as session:
        candidates = await search_candidates(
            session,
            tenant_id="t1",
            user_id="u1",
            query_text=question,
            query_embedding=vector,
            index_id=1,
            depth=5,
        )
    captioned = {c.memory.turn_id: c.signals.has_caption for c in candidates}
    assert captioned == {ids[0]: True, ids[1]: False}
    column = FEATURE_NAMES.index("has_caption")
    features = fusion_features([c.signals for c in candidates], question)
    assert sorted(features[:, column]) == [0.0, 1.0]


async def test_a_long_reply_quoting_a_fact_does_not_outrank_the_statement() -> None:
    # A model's replies are far longer than the turns the weights were fitted on; a length
    # prior once ranked such an echo above the user's own words among unindexed turns.
    conversation = uuid.uuid4()
    fact = "我妹妹去年搬到了雷克雅未克，还养了很多蜜蜂。"
    echo = (
        f"You said: “{fact}”. This reply comes from a demo model, which runs offline and streams"
        " deterministic text so that every part of the backend can be tried without a real model."
    )
    turns = [
        UnindexedTurn(uuid.uuid4(), conversation, None, seq, role, None, text, WHEN, None, None)
        for seq, (role, text) in enumerate([("user", fact), ("assistant", echo)], 1)
    ]
    query = "我妹妹现在住在雷克雅未克吗？"
    (query_vector, *vectors) = await EMBEDDER.embed(
        [query, *(memory_text(t.text, name=t.name, created_at=t.created_at) for t in turns)]
    )
    hits = score_unindexed(turns, vectors, query, query_vector, LEARNED)
    best = max(hits, key=lambda h: h.score)
    assert best.turn_id == turns[0].turn_id, [(h.text[:20], h.score) for h in hits]


async def test_the_users_own_statement_outranks_an_assistant_turn_contradicting_it(db: Database) -> None:
    """The role signal: what the user said about themselves beats what a model said about them.

    The model's reply shares more of the question's words ("drive") than the statement does.
    """
    ids = await remember_chat(
        db,
        [
            ("user", "My car is a 2009 Volvo."),
            ("assistant", "The car that you drive is a Honda Accord, a reliable car to drive every day."),
            ("user", "I had pasta for dinner yesterday."),
            ("assistant", "Pasta is a good choice for a quick dinner."),
        ],
    )
    hits = await search(db, "What car do I drive?")
    assert hits[0].turn_id == ids[0], [h.text for h in hits]
    reply = next(h for h in hits if h.turn_id == ids[1])
    assert reply.keyword_rank == 1  # by its words alone the model's reply would come first
    assert (await search(db, "What car do I drive?", RRF))[0].turn_id == ids[1]  # and by the ranks alone


async def test_a_model_reply_counts_as_such_unless_the_query_asks_what_the_assistant_said(
    db: Database,
) -> None:
    await remember_chat(
        db,
        [
            ("user", "Can you recommend a hiking trail near Porto?"),
            ("assistant", "I recommend the Paiva Walkways, a hiking trail near Porto."),
        ],
    )
    column = FEATURE_NAMES.index("model_reply_unasked")
    for query, expected in (
        ("Which hiking trail near Porto do I like?", [0.0, 1.0]),
        ("Which hiking trail near Porto did you recommend?", [0.0, 0.0]),
    ):
        (vector,) = await EMBEDDER.embed([query])
        async with db.transaction() as session:
            candidates = await search_candidates(
                session,
                tenant_id="t1",
                user_id="u1",
                query_text=query,
                query_embedding=vector,
                index_id=1,
                depth=5,
            )
        by_role = sorted(candidates, key=lambda c: c.memory.role != "user")
        features = fusion_features([c.signals for c in by_role], query)
        assert list(features[:, column]) == expected, query
    # A named assistant (one of two people in an imported chat) is a person, not a model.
    assert not is_model_reply("assistant", "Caroline") and is_model_reply("assistant", None)


async def test_the_users_question_ranks_below_the_users_statement(db: Database) -> None:
    """Same words, one a question: the statement answers, the question only asks."""
    ids = await remember_chat(
        db,
        [
            ("user", "Where is my sister living these days?"),
            ("assistant", "I do not know, you have not told me."),
            ("user", "My sister is living in Porto these days."),
            ("assistant", "Porto is a lovely city."),
        ],
    )
    hits = await search(db, "Which city is my sister living in these days?")
    ranks = [h.turn_id for h in hits]
    assert ranks.index(ids[2]) < ranks.index(ids[0]), [h.text for h in hits]
    by_ranks = [h.turn_id for h in await search(db, "Which city is my sister living in these days?", RRF)]
    assert by_ranks.index(ids[0]) < by_ranks.index(ids[2])  # the ranks alone put the question first


async def test_stopwords_stay_out_of_the_keyword_candidates(db: Database) -> None:
    """Words in nearly every row (what, did, I) never make a row a keyword candidate."""
    ids = await remember_chat(
        db,
        [
            *(("user", f"What did I say about the weather on day {i}?") for i in range(6)),
            ("user", "I drive a Volvo."),
        ],
    )
    query = "What did I drive?"
    (vector,) = await EMBEDDER.embed([query])
    async with db.transaction() as session:
        candidates = await search_candidates(
            session,
            tenant_id="t1",
            user_id="u1",
            query_text=query,
            query_embedding=vector,
            index_id=1,
            depth=100,
        )
    assert len(candidates) == len(ids)  # every row is a dense candidate
    assert {c.memory.turn_id for c in candidates if c.memory.keyword_rank is not None} == {ids[-1]}
