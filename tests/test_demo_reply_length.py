"""The demo model's reply length: its own by default, or a fixed number of words (DEMO_REPLY_WORDS)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from chat_api.providers.base import TextDelta
from chat_api.providers.demo import DemoProvider
from memory.prompt.context import ContextBudget, TurnView, build_context
from memory.prompt.templates import load_prompts
from memory.recall.found import FoundMemory

NOW = datetime(2025, 3, 14, 9, 30, tzinfo=UTC)
QUESTION = "what did I say about my trip to Lisbon?"


def prompt(memories: int) -> list[dict[str, Any]]:
    """The messages the context builder makes for QUESTION with `memories` recalled turns."""
    found = [
        FoundMemory(
            turn_id=uuid.uuid4(),
            conversation_id=uuid.uuid4(),
            text=f"message {i}: I flew to Lisbon with my sister and we stayed near the river for a week",
            role="user",
            created_at=datetime(2024, 7, 1 + i, tzinfo=UTC),
            score=1.0 - i / 10,
        )
        for i in range(memories)
    ]
    turns = [TurnView(seq=1, id=1, role="user", status="completed", content=QUESTION)]
    built = build_context(turns, prompts=load_prompts("en"), budget=ContextBudget(), memory=found, now=NOW)
    return built.messages


async def reply(provider: DemoProvider, messages: list[dict[str, Any]]) -> str:
    return "".join([d.text async for d in provider.stream(messages) if isinstance(d, TextDelta)])


async def test_a_fixed_reply_length_is_the_same_with_and_without_memories() -> None:
    fixed = DemoProvider(tokens_per_second=1e6, reply_words=60)
    without, with_memories = await reply(fixed, prompt(0)), await reply(fixed, prompt(3))
    assert len(without.split(" ")) == len(with_memories.split(" ")) == 60
    assert "I remember: [2024-07-01" in with_memories  # it still quotes what it was given
    assert "I remember" not in without


async def test_a_fixed_reply_length_longer_than_the_reply_repeats_the_filler() -> None:
    long = await reply(DemoProvider(tokens_per_second=1e6, reply_words=300), prompt(0))
    assert len(long.split(" ")) == 300
    assert long.count("chatmem's built-in demo model") >= 5


async def test_by_default_a_reply_that_quotes_memories_is_longer() -> None:
    own = DemoProvider(tokens_per_second=1e6)
    without, with_memories = await reply(own, prompt(0)), await reply(own, prompt(3))
    assert len(with_memories.split(" ")) > 2 * len(without.split(" "))
    assert without.endswith("for real answers.")
