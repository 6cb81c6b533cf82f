"""Where the model is given memory: with the latest user message, kept with it afterwards.

Each reply's part (the memories it was shown and the current time) goes before the user's
words in the latest user message, is stored with the reply, and is shown again with that
message in later prompts, so that a conversation's prompt only grows at its end (what a
model server's prompt cache needs). A memory forgotten since it was shown is left out.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from memory.prompt.context import ContextBudget, ShownMemory, ShownPart, TurnView, build_context
from memory.prompt.templates import load_prompts
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.openai_rules import check_chat_messages
from tests.support import new_conversation
from tests.test_memory_recall import FACT, QUESTION, index_outbox, say

EN = load_prompts("en")
NOW = datetime(2025, 3, 14, 9, 30, tzinfo=UTC)
SHOWN_AT = "Thursday, 13 March 2025, 18:05 UTC"


def rex(turn_id: str = "11111111-1111-1111-1111-111111111111") -> ShownMemory:
    return ShownMemory(
        turn_id=turn_id,
        chunk_index=0,
        text="My dog is called Rex",
        created_at=datetime(2024, 7, 5, tzinfo=UTC),
        conversation_id=None,
        conversation_title="Pets",
        role="user",
        score=0.9,
    )


def turns_with_part(answer_status: str = "completed") -> list[TurnView]:
    part = ShownPart(SHOWN_AT, (rex(),)).to_json()
    return [
        TurnView(role="user", status="completed", content="what's my dog called?", id=1, seq=1),
        TurnView(role="assistant", status=answer_status, content="Rex.", id=2, seq=2, prompt_part=part),
        TurnView(role="user", status="completed", content="and my cat?", id=3, seq=3),
    ]


def test_an_earlier_message_is_shown_again_with_the_part_its_reply_was_given() -> None:
    built = build_context(turns_with_part(), prompts=EN, budget=ContextBudget(), now=NOW)
    assert check_chat_messages(built.messages) is None
    first = built.messages[1]["content"]
    assert first == (
        f"<memories>\nCurrent time: {SHOWN_AT}.\n"
        '- [2024-07-05, conversation "Pets"] the user said: My dog is called Rex\n'
        "</memories>\n\nwhat's my dog called?"
    )
    # The new message gets its own part; a memory shown earlier in the window is not repeated.
    again = build_context(turns_with_part(), prompts=EN, budget=ContextBudget(), now=NOW, memory=[rex()])
    assert again.messages[:3] == built.messages[:3]
    assert "Rex" not in again.messages[-1]["content"] and again.dropped["memory_already_shown"] == 1


def test_a_memory_shown_as_today_is_replayed_as_today_the_next_day() -> None:
    """A memory's "today" is the day of the time its block says, not of the reply that replays it: the
    replayed part stays what the model server has cached, and still means the right day."""
    said = replace(rex(), created_at=datetime(2025, 3, 13, 17, 0, tzinfo=UTC))  # SHOWN_AT's day
    turns = turns_with_part()
    turns[1] = replace(turns[1], prompt_part=ShownPart(SHOWN_AT, (said,)).to_json())
    built = build_context(turns, prompts=EN, budget=ContextBudget(), now=NOW)
    assert built.messages[1]["content"] == (
        f"<memories>\nCurrent time: {SHOWN_AT}.\n"
        '- [today, conversation "Pets"] the user said: My dog is called Rex\n'
        "</memories>\n\nwhat's my dog called?"
    )


def test_a_memory_gone_since_it_was_shown_is_left_out_of_the_replayed_part() -> None:
    built = build_context(turns_with_part(), prompts=EN, budget=ContextBudget(), now=NOW, alive=set())
    first = built.messages[1]["content"]
    assert "Rex" not in first and first == f"(Current time: {SHOWN_AT}.)\n\nwhat's my dog called?"
    assert built.dropped["memory_gone_since_shown"] == 1


def test_a_failed_reply_leaves_its_message_bare() -> None:
    built = build_context(turns_with_part("failed"), prompts=EN, budget=ContextBudget(), now=NOW)
    assert built.messages[1] == {"role": "user", "content": "what's my dog called?"}


def test_replayed_parts_count_against_the_windows_token_budget() -> None:
    bare = build_context(turns_with_part("failed"), prompts=EN, budget=ContextBudget(), now=NOW)
    kept = build_context(turns_with_part(), prompts=EN, budget=ContextBudget(), now=NOW)
    assert kept.token_count > bare.token_count + 20


# --- live -------------------------------------------------------------------------------------


async def context(client: httpx.AsyncClient, cid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/conversations/{cid}/context")
    assert r.status_code == 200, r.text
    return list(r.json()["messages"])


async def test_the_next_reply_is_sent_the_previous_prompt_unchanged_as_its_prefix(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """Through the strict fake: what a prompt cache needs, and every prompt a valid sequence."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", max_tool_steps=0
    )
    fake_openai.script(Reply(text="Hello!"), Reply(text="Fine."), Reply(text="Bye."))
    async with server.client() as client:
        cid = await new_conversation(client)
        for content in ("hi", "how are you?", "bye"):
            await say(client, cid, content, memory_scope="none")
    first, second, third = fake_openai.requests
    assert all(r.status == 200 for r in (first, second, third))
    assert second.messages[: len(first.messages)] == first.messages
    assert third.messages[: len(second.messages)] == second.messages
    assert second.messages[len(first.messages)] == {"role": "assistant", "content": "Hello!"}
    assert third.messages[-1]["content"].startswith("(Current time: ")


@pytest.mark.parametrize("indexed", [True, False])
async def test_forget_then_ask_in_the_same_conversation(
    start_server: Any, make_settings: Any, indexed: bool
) -> None:
    """A replayed part never brings back a memory forgotten since it was shown (indexed or not yet)."""
    server: LiveServer = await start_server()
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        if indexed:
            await index_outbox(server.services.db, make_settings())
        cid = await new_conversation(client, "Travel")
        await say(client, cid, QUESTION)
        shown = await context(client, cid)
        assert FACT in shown[1]["content"] and shown[1]["content"].startswith("<memories>")
        await say(client, cid, "Thanks, tell me more.")
        later = await context(client, cid)
        assert later[:3] == shown[:3]  # the first exchange is shown exactly as before
        assert FACT not in later[3]["content"]  # and the fact is not shown a second time

        assert (await client.delete("/v1/memory")).status_code == 204
        after = await context(client, cid)
        user_parts = [m["content"] for m in after if m["role"] == "user"]
        assert all(FACT not in part for part in user_parts)
        assert user_parts[0].startswith("(Current time: ") and user_parts[0].endswith(QUESTION)
        events = await say(client, cid, "Where does she live?")
        assert "Reykjavik" not in "".join(
            e.data.get("text", "") for e in events if e.event == "message.delta"
        )
