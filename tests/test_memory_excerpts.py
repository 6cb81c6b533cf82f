"""A reply's block shows the sentences of a memory that answer the question (MEMORY_SENTENCES).

Found with the real 0.5B model (bench/memory_qa.py): "What do I do for a living?" was answered
with advice on living: the block held the sister message and the user's own earlier question
"Where does my sister live?", while "…my dog is called Biscuit. I work as a nurse at St.
Mary's hospital. I was born in 1987." was third; and "What is her name?" was answered "Ines"
because the follow-up's block added the wife's message. Ranked by their best sentence, with
questions stating nothing and a cut relative to the first, the block holds the nurse sentence
alone, and a follow-up adds no other person's fact.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import select

from memory.config import default_embedding_model
from memory.prompt.context import ContextBudget, ShownMemory, ShownPart, TurnView, build_context
from memory.prompt.templates import load_prompts
from memory.recall.embeddings import SentenceTransformerEmbedder
from memory.recall.excerpts import cut_relative, focus
from memory.recall.found import FoundMemory
from memory.storage.models import Turn
from tests.fake_openai import Reply
from tests.support import new_conversation
from tests.test_memory_recall import retrieved, say
from tests.test_remembering_rule import small_model_server

SISTER = (
    "Some things about me. My sister Mara lives in Porto. My car is a 2009 Volvo. I'm allergic to peanuts."
)
WORK = (
    "More about me: my dog is called Biscuit. I work as a nurse at St. Mary's hospital. I was born in 1987."
)
WIFE = "Also, I play the cello. My wife's name is Ines. My favourite colour is teal."
ASKED = "Where does my sister live?"


def memory(text: str, score: float) -> FoundMemory:
    return FoundMemory(
        turn_id=uuid.uuid4(),
        conversation_id=None,
        text=text,
        role="user",
        created_at=datetime(2026, 11, 1, tzinfo=UTC),
        score=score,
    )


@pytest.fixture(scope="module")
def real_encoder() -> SentenceTransformerEmbedder:
    encoder = SentenceTransformerEmbedder(default_embedding_model())
    encoder.load(threads=1)
    return encoder


async def test_the_stating_sentence_goes_first_and_questions_and_far_memories_stay_out(
    real_encoder: SentenceTransformerEmbedder,
) -> None:
    # Recall's own order, as measured: the sister message and the user's question above the nurse.
    recalled = [memory(SISTER, 0.9), memory(ASKED, 0.8), memory(WORK, 0.7), memory(WIFE, 0.6)]
    shown = await focus(
        real_encoder, "What do I do for a living?", recalled, k=2, sentences_shown=1, cut=0.75
    )
    assert [m.text for m in shown] == [WORK]
    assert shown[0].excerpt == "I work as a nurse at St. Mary's hospital. I was born in 1987."
    # Without the cut, the next memory comes too, but never the question: it states nothing.
    wider = await focus(real_encoder, "What do I do for a living?", recalled, k=4, sentences_shown=1, cut=0.0)
    assert ASKED not in [m.text for m in wider] and wider[0].text == WORK and len(wider) == 3
    # A follow-up searched with the user's recent words: the sister's sentence, not the wife's message.
    follow_up = await focus(
        real_encoder,
        "What is her name? Where does my sister live?",
        recalled,
        k=2,
        sentences_shown=1,
        cut=0.75,
    )
    assert [(m.text, m.excerpt) for m in follow_up] == [
        (SISTER, "Some things about me. My sister Mara lives in Porto.")
    ]


async def test_only_questions_keep_recalls_order_whole(real_encoder: SentenceTransformerEmbedder) -> None:
    recalled = [memory(ASKED, 0.8), memory("What is my wife's name?", 0.5)]
    shown = await focus(real_encoder, "Which city do I live in?", recalled, k=2, sentences_shown=1, cut=0.75)
    assert [(m.text, m.excerpt, m.score) for m in shown] == [(m.text, None, m.score) for m in recalled]


def test_the_relative_cut_on_fused_scores() -> None:
    recalled = [memory(SISTER, 0.8), memory(WIFE, 0.61), memory(WORK, 0.59)]
    assert [m.text for m in cut_relative(recalled, 0.75)] == [SISTER, WIFE]
    assert cut_relative(recalled, 0.0) == recalled


async def test_the_block_shows_the_excerpt_and_replays_it_with_its_message(
    start_server: Any, fake_openai: Any
) -> None:
    """Through a live server: the model is shown one sentence of the memory, the part stored with
    the reply keeps that excerpt (and the whole text, to tell a corrected memory), and the next
    prompt of the conversation shows the same text again: the prefix the model server cached."""
    server = await small_model_server(start_server, fake_openai, memory_sentences=1, memory_relative_cut=0.75)
    async with server.client() as client:
        fake_openai.script(Reply(text="Noted, thank you for telling me."))
        await say(client, await new_conversation(client, "About me"), WORK)
        asked = await new_conversation(client, "Question")
        fake_openai.script(Reply(text="You are a nurse."), Reply(text="It is St. Mary's."))
        found = retrieved(await say(client, asked, "What do I do for a living as a nurse?"))
        first = fake_openai.requests[-1].messages
        await say(client, asked, "At which hospital?")
        second = fake_openai.requests[-1].messages
    [item] = [i for i in found["items"] if i["text"] == WORK]
    block = first[-1]["content"]
    async with server.services.db.transaction() as session:
        parts = list(
            (
                await session.execute(
                    select(Turn.prompt_part)
                    .where(Turn.conversation_id == uuid.UUID(asked), Turn.prompt_part.is_not(None))
                    .order_by(Turn.seq)
                )
            ).scalars()
        )
    [stored] = [m for m in parts[0]["memories"] if m["text"] == WORK]
    excerpt = stored["excerpt"]
    assert excerpt in WORK and excerpt != WORK and excerpt in block
    assert WORK not in block  # one sentence of the memory, not the whole message
    assert item["score"] > 0
    # The second prompt begins with the first one's messages, the excerpt where it was.
    assert json.dumps(second[: len(first)]) == json.dumps(first)


def test_a_block_leaves_out_what_an_earlier_message_shows_but_not_another_sentence_of_it() -> None:
    """A follow-up is not shown again the sentence its conversation already shows; another sentence
    of the same memory (another fact) is new to it and is shown."""
    prompts = load_prompts("en")
    shown = memory(WORK, 0.6)
    first = replace(shown, excerpt="More about me: my dog is called Biscuit.")
    part = ShownPart("Thursday, 26 November 2026, 10:00 UTC", (ShownMemory.of(first),)).to_json()
    turns = [
        TurnView(role="user", status="completed", content="What is my dog called?", id=1, seq=1),
        TurnView(role="assistant", status="completed", content="Biscuit.", id=2, seq=2, prompt_part=part),
        TurnView(role="user", status="completed", content="And what do I do?", id=3, seq=3),
    ]
    budget = ContextBudget()
    again = build_context(turns, prompts=prompts, budget=budget, memory=[first])
    assert again.memory_used == [] and again.dropped["memory_already_shown"] == 1
    other = replace(shown, excerpt="I work as a nurse at St. Mary's hospital. I was born in 1987.")
    built = build_context(turns, prompts=prompts, budget=budget, memory=[other])
    assert built.memory_used == [other]
    assert "I work as a nurse" in built.messages[-1]["content"]
    assert "Biscuit" not in built.messages[-1]["content"]  # the earlier sentence stays where it was shown
    whole = build_context(turns, prompts=prompts, budget=budget, memory=[shown])
    assert whole.memory_used == [shown]  # the whole message holds more than the earlier sentence
