"""Standing memories: a conversation opens with the user's own statements, the same in every new one.

With MEMORY_STANDING_TOKENS a conversation's first reply gets the user's newest statements
about themselves from earlier conversations in a block before its time, kept with that
message for the whole conversation: every new conversation begins with the same bytes until
the user says something new, so a model server reads them once, not once a reply.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from memory.prompt.context import ContextBudget, ShownMemory, ShownPart, TurnView, build_context
from memory.prompt.templates import load_prompts
from memory.recall.standing import is_statement
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.openai_rules import check_chat_messages
from tests.support import new_conversation
from tests.test_memory_recall import FACT, index_outbox, retrieved, say
from tests.test_prompt_layout import context

EN = load_prompts("en")
NOW = datetime(2025, 3, 14, 9, 30, tzinfo=UTC)
SHOWN_AT = "Friday, 14 March 2025, 09:30 UTC"
BUDGET = ContextBudget(standing_tokens=300)
ASKED = "Tell me about my sister Ingrid."


def said(n: int, text: str) -> ShownMemory:
    return ShownMemory(
        turn_id=f"00000000-0000-0000-0000-00000000000{n}",
        chunk_index=0,
        text=text,
        created_at=NOW - timedelta(days=10 - n),
        conversation_id=None,
        conversation_title="About me",
        role="user",
        score=0.0,
    )


DOG = said(1, "My dog is called Rex.")
CAR = said(2, "My car is a 2009 Volvo.")
CITY = said(3, "I live in Leeds.")


def test_a_conversations_first_part_begins_with_the_standing_block_before_the_time() -> None:
    turns = [TurnView(role="user", status="completed", content="what's my dog called?", id=1, seq=1)]
    found_again = ShownMemory(**{**DOG.to_json(), "created_at": DOG.created_at, "score": 0.9})
    built = build_context(
        turns, prompts=EN, budget=BUDGET, now=NOW, standing=[DOG, CAR], memory=[found_again, CITY]
    )
    assert check_chat_messages(built.messages) is None
    assert built.messages[1]["content"] == (
        "<profile>\n- My dog is called Rex.\n- My car is a 2009 Volvo.\n</profile>\n\n"
        f"<memories>\nCurrent time: {SHOWN_AT}.\n"
        '- [2025-03-07, conversation "About me"] the user said: I live in Leeds.\n'
        "</memories>\n\nwhat's my dog called?"
    )
    # A recalled memory the standing block already shows is not shown twice.
    assert built.dropped["memory_already_shown"] == 1
    assert built.new_part is not None
    assert [(m.text, m.standing) for m in built.new_part.memories] == [
        (DOG.text, True),
        (CAR.text, True),
        (CITY.text, False),
    ]
    # Off (the default budget): no block, whatever the caller passes.
    plain = build_context(turns, prompts=EN, budget=ContextBudget(), now=NOW, standing=[DOG])
    assert plain.messages[1]["content"].startswith("(Current time: ")


def test_the_standing_block_keeps_the_newest_statements_that_fit() -> None:
    turns = [TurnView(role="user", status="completed", content="hello", id=1, seq=1)]
    one_line = ContextBudget(standing_tokens=16)
    built = build_context(turns, prompts=EN, budget=one_line, now=NOW, standing=[DOG, CAR, CITY])
    assert built.messages[1]["content"].startswith("<profile>\n- I live in Leeds.\n</profile>\n\n(Current")
    assert built.dropped["standing_over_budget"] == 2


def test_a_statement_of_several_sentences_is_a_line_each() -> None:
    """A small model finds one fact among lines better than inside a paragraph; short ones too."""
    turns = [TurnView(role="user", status="completed", content="hello", id=1, seq=1)]
    about = said(4, "Some things about me. I live in Leeds. My car is a 2009 Volvo.")
    built = build_context(turns, prompts=EN, budget=BUDGET, now=NOW, standing=[about])
    assert built.messages[1]["content"].startswith(
        "<profile>\n- Some things about me.\n- I live in Leeds.\n- My car is a 2009 Volvo.\n</profile>\n\n"
    )


def test_the_standing_block_is_replayed_unchanged_and_loses_a_forgotten_statement() -> None:
    part = ShownPart(SHOWN_AT, (DOG, CAR)).to_json()
    part["memories"] = [{**m, "standing": True} for m in part["memories"]]
    turns = [
        TurnView(role="user", status="completed", content="hello", id=1, seq=1),
        TurnView(role="assistant", status="completed", content="Hi!", id=2, seq=2, prompt_part=part),
        TurnView(role="user", status="completed", content="what car do I drive?", id=3, seq=3),
    ]
    replayed = build_context(turns, prompts=EN, budget=BUDGET, now=NOW, memory=[CAR])
    assert replayed.messages[1]["content"] == (
        "<profile>\n- My dog is called Rex.\n- My car is a 2009 Volvo.\n</profile>\n\n"
        f"(Current time: {SHOWN_AT}.)\n\nhello"
    )
    # Shown by the block: the new reply's part does not repeat it.
    assert replayed.messages[-1]["content"].startswith("(Current time: ")
    assert replayed.dropped["memory_already_shown"] == 1

    alive = {DOG.key}  # the car was forgotten since
    after = build_context(turns, prompts=EN, budget=BUDGET, now=NOW, alive=alive)
    assert after.messages[1]["content"].startswith("<profile>\n- My dog is called Rex.\n</profile>\n\n")
    assert after.dropped["memory_gone_since_shown"] == 1


def test_a_statement_is_short_about_the_speaker_and_not_a_question() -> None:
    assert is_statement("My sister Mara lives in Porto.")
    assert is_statement("I’m allergic to peanuts")
    assert is_statement("我住在英国利兹市。")
    assert not is_statement("Where does my sister live?")
    assert not is_statement("我住在哪里？")
    assert not is_statement("thanks!")
    assert not is_statement("Write a haiku about autumn leaves.")
    assert not is_statement("I " + "really " * 60 + "like tea.")


# --- live -------------------------------------------------------------------------------------


async def test_new_conversations_open_with_the_same_statements_and_a_forgotten_one_leaves(
    start_server: Any, fake_openai: FakeOpenAI, make_settings: Any
) -> None:
    """Through the API and the strict fake: the user's statement (not their question, not the
    assistant's words, not a chat kept out of memory) opens each new conversation, byte for byte
    the same, and is kept with that message for the conversation's later replies."""
    settings = {"memory_standing_tokens": 300, "max_tool_steps": 0, "query_rewrite": "heuristic"}
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", **settings
    )
    fake_openai.script(*(Reply(text=f"Noted, my friend {n}.") for n in range(8)))
    async with server.client() as client:
        first = await new_conversation(client, "Family")
        await say(client, first, FACT)
        await say(client, first, "Where does my sister Ingrid live now?")
        secret = await new_conversation(client, "Secret", memory_mode="none")
        await say(client, secret, "My password hint is my first cat's name.")
        await index_outbox(server.services.db, make_settings(**settings))

        opened, announced = [], []
        for title in ("Travel", "Cooking"):
            cid = await new_conversation(client, title)
            announced.append(retrieved(await say(client, cid, ASKED)))
            opened.append(fake_openai.requests[-1].messages)
        travel, cooking = opened
        assert travel[0] == cooking[0]  # the system message
        block = travel[1]["content"].split("\n\n")[0]
        assert block == f"<profile>\n- {FACT}\n</profile>"
        assert cooking[1]["content"].split("\n\n")[0] == block
        assert check_chat_messages(travel) is None
        # memory.retrieved names them apart from what recall found, which does not repeat them.
        assert [item["text"] for item in announced[0]["standing"]] == [FACT]
        assert all(item["text"] != FACT for item in announced[0]["items"])
        assert FACT not in travel[1]["content"].removeprefix(block)  # nor does the prompt

        # The conversation's next reply is sent the first prompt unchanged as its prefix.
        await say(client, cid, "Something warm, please.")
        later = fake_openai.requests[-1].messages
        assert later[: len(cooking)] == cooking

        items = (await client.get("/v1/memory/items", params={"limit": 50})).json()["items"]
        fact = next(item for item in items if item["text"] == FACT)
        assert (await client.delete(f"/v1/memory/items/{fact['id']}")).status_code == 204
        after = await context(client, cid)
        # The block is gone from the replayed message, and so is the reply to the forgotten message.
        replayed = after[1]["content"]
        assert replayed.startswith("<memories>\n") and replayed.endswith(f"\n\n{ASKED}")
        assert FACT not in replayed and "Noted, my friend 0." not in replayed
        fresh = await new_conversation(client, "After")
        await say(client, fresh, "Hello again.")
        assert "<profile>" not in fake_openai.requests[-1].messages[1]["content"]
