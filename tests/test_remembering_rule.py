"""What is remembered of a reply: not what the assistant said with memory off.

Found with a real small model: a reply made without memory invented the user's car ("The
car that you drive is a Honda Accord."), was indexed, and was later recalled first, above
the user's own "My car is a 2009 Volvo.". Such replies stay in the chat; they are neither
indexed nor found before indexing. A reply made with memory on stays remembered.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from memory.events import EventName
from memory.recall.remembering import repeats_only
from memory.storage.models import MemoryItem, OutboxRow, Turn
from tests.conftest import LiveServer
from tests.fake_openai import Reply, ToolCall
from tests.sse import collect
from tests.support import new_conversation
from tests.test_approvals import approve_url, park, required, transfer_tools
from tests.test_memory_recall import index_outbox, retrieved, say

STATEMENT = "My car is a 2009 Volvo estate in dark green."


async def small_model_server(start_server: Any, fake_openai: Any, **settings: Any) -> LiveServer:
    """A live server on the strict fake model, set up as for a small local model (no tools)."""
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        max_tool_steps=0,
        query_rewrite="heuristic",
        **settings,
    )
    return server


QUESTION = "Which Volvo car do I drive?"


async def test_a_reply_made_with_memory_off_is_never_remembered(
    start_server: Any, make_settings: Any
) -> None:
    server: LiveServer = await start_server()
    db = server.services.db
    async with server.client() as client:
        off = await new_conversation(client, "Cars")
        await say(client, off, STATEMENT, memory_scope="none")  # the demo model repeats it: "You said: …"
        on = await new_conversation(client, "More cars")
        await say(client, on, "Tell me about Volvo estate cars in dark green.")

        def assistant_roles(found: dict[str, Any]) -> list[str]:
            return [item["conversation_id"] for item in found["items"] if item["role"] == "assistant"]

        # Before indexing: the user's statement is found, the memory-off reply is not.
        before = retrieved(await say(client, await new_conversation(client), QUESTION))
        assert STATEMENT in [item["text"] for item in before["items"]]
        assert off not in assistant_roles(before) and on in assistant_roles(before)

        result = await index_outbox(db, make_settings())
        # The memory-off reply, and the question's demo reply: it quotes the "on" reply it was
        # shown as a memory, filler and all (a copy: the derivative-reply rule below).
        assert result.skipped["made_without_memory"] == 1
        assert result.skipped["repeats_what_it_was_shown"] == 1
        after = retrieved(await say(client, await new_conversation(client), QUESTION))
        assert STATEMENT in [item["text"] for item in after["items"]]
        assert off not in assistant_roles(after) and on in assistant_roles(after)
    async with db.transaction() as session:
        rows = await session.execute(
            select(Turn.conversation_id, Turn.memory_use).where(Turn.role == "assistant")
        )
        uses = {conversation: use for conversation, use in rows}
        payloads = list((await session.execute(select(OutboxRow.payload))).scalars())
    assert uses[uuid.UUID(off)] == "off" and uses[uuid.UUID(on)] == "on"
    assert any(p["memory_use"] == "off" for p in payloads) and any(p["memory_use"] == "on" for p in payloads)


async def test_use_memory_off_recalls_nothing_and_its_replies_are_not_remembered(
    start_server: Any, fake_openai: Any
) -> None:
    """'Use memory in this chat' (read) is its own switch beside memory_mode ('remember this chat')."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", memory_tool="on"
    )
    async with server.client() as client:
        facts = await new_conversation(client, "Cars")
        fake_openai.script(Reply(text="Noted."), Reply(text="A Volvo."), Reply(text="I cannot know."))
        await say(client, facts, STATEMENT, memory_scope="none")
        used = await new_conversation(client)
        with_memory = await say(client, used, QUESTION)
        assert STATEMENT in [item["text"] for item in retrieved(with_memory)["items"]]

        created = await client.post("/v1/conversations", json={"title": "private", "use_memory": False})
        assert created.status_code == 201 and created.json()["use_memory"] is False
        private = created.json()["id"]
        events = await say(client, private, QUESTION)
        assert not [e for e in events if e.event == EventName.MEMORY_RETRIEVED]
        request = fake_openai.requests[-1]
        assert STATEMENT not in json.dumps(request.messages)
        assert "recall_memory" not in [t["function"]["name"] for t in request.tools or ()]
        patched = await client.patch(f"/v1/conversations/{private}", json={"use_memory": True})
        assert patched.json()["use_memory"] is True and patched.json()["memory_mode"] == "persistent"
    async with server.services.db.transaction() as session:
        rows = await session.execute(
            select(Turn.memory_use).where(
                Turn.conversation_id == uuid.UUID(private), Turn.role == "assistant"
            )
        )
        assert list(rows.scalars()) == ["off"]


async def test_remember_is_the_plain_name_of_memory_mode(start_server: Any) -> None:
    """'Remember this chat' (write) reads and writes as `remember`; `memory_mode` stays the same switch."""
    server: LiveServer = await start_server()
    async with server.client() as client:
        created = await client.post("/v1/conversations", json={"remember": False})
        assert created.status_code == 201
        assert (created.json()["remember"], created.json()["memory_mode"]) == (False, "none")
        conversation = created.json()["id"]
        patched = await client.patch(f"/v1/conversations/{conversation}", json={"remember": True})
        assert (patched.json()["remember"], patched.json()["memory_mode"]) == (True, "persistent")
        old_name = await client.patch(f"/v1/conversations/{conversation}", json={"memory_mode": "none"})
        assert old_name.json()["remember"] is False
        # The two switches are independent: neither changes the other.
        assert old_name.json()["use_memory"] is True
        read_off = await client.patch(f"/v1/conversations/{conversation}", json={"use_memory": False})
        assert (read_off.json()["use_memory"], read_off.json()["remember"]) == (False, False)
        default = await client.post("/v1/conversations", json={})
        assert (default.json()["remember"], default.json()["use_memory"]) == (True, True)

        for body in ({"remember": True, "memory_mode": "none"}, {"remember": "maybe"}):
            refused = await client.post("/v1/conversations", json=body)
            assert refused.status_code == 422, body
            assert refused.json()["error"]["code"]  # the API's own error shape
        disagree = await client.patch(
            f"/v1/conversations/{conversation}", json={"remember": False, "memory_mode": "persistent"}
        )
        assert disagree.status_code == 422
        after = (await client.get(f"/v1/conversations/{conversation}")).json()
        assert (after["remember"], after["use_memory"]) == (False, False)  # nothing half-written
        agree = await client.post("/v1/conversations", json={"remember": False, "memory_mode": "none"})
        assert agree.status_code == 201 and agree.json()["memory_mode"] == "none"


async def test_a_reply_that_only_repeats_what_it_was_shown_is_not_remembered(
    start_server: Any, fake_openai: Any, make_settings: Any
) -> None:
    """Found with a real small model: replies that repeated the user's statement ("Your car is
    a 2009 Volvo…") or the memories they were shown were indexed, and took recall's first
    places above the user's own words. A reply with something new stays remembered."""
    server = await small_model_server(start_server, fake_openai)
    echo = "Your car is a 2009 Volvo estate, in dark green!"
    from_memory = "You drive a dark green Volvo estate from 2009."
    new = "Volvo estates are roomy, safe family cars with large boots."
    async with server.client() as client:
        stated = await new_conversation(client, "Cars")
        asked = await new_conversation(client, "Question")
        chatted = await new_conversation(client, "Chat")
        fake_openai.script(Reply(text=echo), Reply(text=from_memory), Reply(text=new))
        await say(client, stated, STATEMENT)
        await say(client, asked, QUESTION)  # shown the statement as a memory
        assert STATEMENT in json.dumps(fake_openai.requests[-1].messages)
        await say(client, chatted, "Tell me about Volvo estate cars.")

        def assistant_conversations(found: dict[str, Any]) -> set[str]:
            return {item["conversation_id"] for item in found["items"] if item["role"] == "assistant"}

        fake_openai.script(Reply(text="Noted."), Reply(text="Noted."))
        before = retrieved(await say(client, await new_conversation(client), QUESTION))
        assert STATEMENT in [item["text"] for item in before["items"]]
        assert assistant_conversations(before) & {stated, asked} == set()
        assert chatted in assistant_conversations(before)

        result = await index_outbox(server.services.db, make_settings())
        # The echo and the answer made of the shown memory, each under the reason it has.
        assert result.skipped["repeats_what_it_was_shown"] >= 2
        assert result.skipped["made_without_memory"] == 0
        after = retrieved(await say(client, await new_conversation(client), QUESTION))
        assert STATEMENT in [item["text"] for item in after["items"]]
        assert assistant_conversations(after) & {stated, asked} == set()
        assert chatted in assistant_conversations(after)
    async with server.services.db.transaction() as session:
        rows = await session.execute(
            select(Turn.conversation_id, Turn.memory_use).where(
                Turn.role == "assistant",
                Turn.conversation_id.in_([uuid.UUID(c) for c in (stated, asked, chatted)]),
            )
        )
        uses = {str(conversation): use for conversation, use in rows}
        payloads = list((await session.execute(select(OutboxRow.payload))).scalars())
    assert uses == {stated: "derivative", asked: "derivative", chatted: "on"}
    assert {p["turn_id"] for p in payloads if p.get("memory_use") == "derivative"}  # carried to the indexer


def test_repeats_only_counts_content_terms() -> None:
    shown = "<memories>My sister Mara lives in Porto.</memories> Where does my sister live?"
    assert repeats_only("Your sister lives in Porto.", shown)
    assert repeats_only("Porto!", shown)
    assert not repeats_only("Your sister Mara lives in Lisbon, near the river.", shown)
    assert not repeats_only("Based on the conversation provided, my sister lives in Porto.", shown)
    assert not repeats_only("Hi!", shown)  # no content terms: not this rule's to judge


async def _memory_rows(db: Any, turn_ids: list[uuid.UUID]) -> list[tuple[str, str, bool]]:
    """(turn id, text, forgotten) of every chunk row of these turns, in every generation."""
    async with db.transaction() as session:
        rows = await session.execute(
            select(MemoryItem.turn_id, MemoryItem.text, MemoryItem.forgotten_at.is_not(None)).where(
                MemoryItem.turn_id.in_(turn_ids), MemoryItem.kind == "chunk"
            )
        )
        return [(str(turn), text, forgotten) for turn, text, forgotten in rows]


def _by_seq(first: dict[str, Any]) -> Any:
    """Sort key putting the first answer (by id) before its regenerated sibling."""
    return lambda reply: reply[0] != uuid.UUID(first["id"])


async def _replies(db: Any, conversation: str) -> list[tuple[uuid.UUID, str | None]]:
    async with db.transaction() as session:
        rows = await session.execute(
            select(Turn.id, Turn.memory_use).where(
                Turn.conversation_id == uuid.UUID(conversation), Turn.role == "assistant"
            )
        )
        return [(turn_id, use) for turn_id, use in rows]


@pytest.mark.parametrize("change", ["forget", "correct"])
async def test_a_forgotten_fact_does_not_come_back_through_a_reply_that_repeated_it(
    start_server: Any, fake_openai: Any, make_settings: Any, change: str
) -> None:
    """A reply that repeated the user's fact in new words is remembered (it is not a copy); once
    the user forgets or corrects the fact, that reply and a reply shown the fact as a memory are
    not found either: the indexed one is taken out, the one still queued is never indexed."""
    server = await small_model_server(start_server, fake_openai)
    db = server.services.db
    retold = "Noted: a green Volvo estate from 2009, a fine choice for family trips."
    regenerated = "Understood, a dark green 2009 Volvo estate: a sturdy car for long drives."
    recalled = "You drive a Volvo estate from 2009; estates like it keep their value well."
    async with server.client() as client:
        stated = await new_conversation(client, "Cars")
        fake_openai.script(Reply(text=retold), Reply(text=regenerated))
        await say(client, stated, STATEMENT)
        [_, first] = (await client.get(f"/v1/conversations/{stated}/turns")).json()["items"]
        async with client.stream("POST", f"/v1/turns/{first['id']}/regenerate", json={}) as r:
            assert r.status_code == 200
            assert (await collect(r))[-1].event == EventName.TURN_COMPLETED
        indexed = await index_outbox(db, make_settings())
        assert (
            indexed.indexed_turns == 3
        )  # the statement, the reply that retold it, and its regenerated answer
        asked = await new_conversation(client, "Question")
        fake_openai.script(Reply(text=recalled))
        await say(client, asked, QUESTION)  # shown the statement as a memory; still queued
        assert STATEMENT in json.dumps(fake_openai.requests[-1].messages)
        retold_id, regenerated_id = (
            turn for turn, _ in sorted(await _replies(db, stated), key=_by_seq(first))
        )
        [(recalled_id, recalled_use)] = await _replies(db, asked)
        uses = {use for _, use in await _replies(db, stated)} | {recalled_use}
        assert uses == {"on"}  # new words: all remembered

        def texts(found: dict[str, Any]) -> list[str]:
            return [item["text"] for item in found["items"]]

        fake_openai.script(Reply(text="Noted."))
        before = texts(retrieved(await say(client, await new_conversation(client), QUESTION)))
        # The test could fail: all three are found (the first answer is off the active branch now).
        assert {STATEMENT, regenerated, recalled} <= set(before)

        items = (await client.get("/v1/memory/items", params={"limit": 50})).json()["items"]
        [statement] = [item for item in items if item["text"] == STATEMENT]
        if change == "forget":
            assert (await client.delete(f"/v1/memory/items/{statement['id']}")).status_code == 204
        else:
            corrected = "My car is a 2015 Skoda Octavia in silver."
            patched = await client.patch(f"/v1/memory/items/{statement['id']}", json={"text": corrected})
            assert patched.status_code == 200
        assert [use for _, use in await _replies(db, stated)] == ["forgotten", "forgotten"]
        assert [use for _, use in await _replies(db, asked)] == ["forgotten"]

        def old_fact(found: list[str]) -> list[str]:
            return [text for text in found if "2009" in text]

        # Before the queued reply is indexed (the not-yet-indexed search), and after.
        fake_openai.script(Reply(text="Noted."), Reply(text="Noted."))
        assert old_fact(texts(retrieved(await say(client, await new_conversation(client), QUESTION)))) == []
        result = await index_outbox(db, make_settings())
        assert result.skipped["shown_a_forgotten_memory"] >= 3  # every reply, redelivered or queued
        assert old_fact(texts(retrieved(await say(client, await new_conversation(client), QUESTION)))) == []
        searched = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
        assert old_fact([item["text"] for item in searched.json()["items"]]) == []
    rows = await _memory_rows(db, [retold_id, regenerated_id, recalled_id])
    # The indexed replies are tombstones; the queued one has no row at all.
    assert sorted(rows) == sorted([(str(retold_id), "", True), (str(regenerated_id), "", True)])


@pytest.mark.parametrize("change", ["delete", "remember_off"])
async def test_a_deleted_conversation_does_not_come_back_through_a_reply_that_repeated_it(
    start_server: Any, fake_openai: Any, make_settings: Any, change: str
) -> None:
    """Deleting a conversation (or turning its 'remember this chat' off) forgot (hid) its own
    memory rows, but a reply elsewhere that was shown one of them as a memory, and retold it in
    new words, stayed remembered: the fact came back in every later recall. Such replies are
    forgotten with the conversation, the indexed one taken out, the one still queued never
    indexed."""
    server = await small_model_server(start_server, fake_openai)
    db = server.services.db
    indexed_retelling = "You drive a Volvo estate from 2009; estates like it keep their value well."
    queued_retelling = "Your dark green 2009 Volvo estate should be serviced every spring."
    async with server.client() as client:
        deleted = await new_conversation(client, "Cars")
        fake_openai.script(Reply(text="Noted."))
        await say(client, deleted, STATEMENT)
        await index_outbox(db, make_settings())
        asked = await new_conversation(client, "Question")
        asked_later = await new_conversation(client, "Later")
        fake_openai.script(Reply(text=indexed_retelling))
        await say(client, asked, QUESTION)  # shown the statement as a memory
        assert STATEMENT in json.dumps(fake_openai.requests[-1].messages)
        await index_outbox(db, make_settings())
        fake_openai.script(Reply(text=queued_retelling))
        await say(client, asked_later, "When should my car be serviced?")  # shown it too; still queued
        assert STATEMENT in json.dumps(fake_openai.requests[-1].messages)

        def old_fact(found: list[str]) -> list[str]:
            return [text for text in found if "2009" in text]

        fake_openai.script(Reply(text="Noted."))
        before = retrieved(await say(client, await new_conversation(client), QUESTION))["items"]
        # The test could fail: the statement and both retellings are found.
        assert {STATEMENT, indexed_retelling, queued_retelling} <= {item["text"] for item in before}

        if change == "delete":
            assert (await client.delete(f"/v1/conversations/{deleted}")).status_code == 204
        else:
            off = await client.patch(f"/v1/conversations/{deleted}", json={"remember": False})
            assert off.status_code == 200 and off.json()["remember"] is False
        # Before the queued reply is indexed (the not-yet-indexed search), and after.
        fake_openai.script(Reply(text="Noted."), Reply(text="Noted."))
        found = retrieved(await say(client, await new_conversation(client), QUESTION))["items"]
        assert old_fact([item["text"] for item in found]) == []
        await index_outbox(db, make_settings())
        found = retrieved(await say(client, await new_conversation(client), QUESTION))["items"]
        assert old_fact([item["text"] for item in found]) == []
        searched = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
        assert old_fact([item["text"] for item in searched.json()["items"]]) == []
        listed = (await client.get("/v1/memory/items", params={"limit": 200})).json()["items"]
        assert old_fact([item["text"] for item in listed]) == []
        # The replies stay in their chats as they were said.
        turns = (await client.get(f"/v1/conversations/{asked}/turns")).json()["items"]
        assert turns[-1]["content"] == indexed_retelling


async def test_what_was_said_while_remember_was_off_is_not_remembered_once_it_is_on_again(
    server: LiveServer, make_settings: Any
) -> None:
    """'Remember this chat' off, a message, then on again before the indexer reached that
    message: the indexer and the not-yet-indexed search read the switch as it is now, so the
    message said off the record was recalled at once and indexed later. What is said while the
    switch is off stays out; what is said after it is on again is remembered."""
    db = server.services.db
    secret = "Off the record: my therapist is Dr Okonkwo on Tuesdays."
    later = "On the record: my dentist is Dr Lindqvist on Fridays."
    async with server.client() as client:
        created = await client.post("/v1/conversations", json={"title": "Private", "remember": False})
        private = created.json()["id"]
        await say(client, private, secret)
        patched = await client.patch(f"/v1/conversations/{private}", json={"remember": True})
        assert patched.status_code == 200 and patched.json()["remember"] is True
        await say(client, private, later)

        def texts(items: list[dict[str, Any]]) -> list[str]:
            return [item["text"] for item in items]

        question = "Who is my therapist, and who is my dentist?"
        # Before the indexer ran (the not-yet-indexed search), and after.
        found = texts(retrieved(await say(client, await new_conversation(client), question))["items"])
        assert later in found and secret not in found
        await index_outbox(db, make_settings())
        found = texts(retrieved(await say(client, await new_conversation(client), question))["items"])
        assert later in found and secret not in found
        listed = texts(
            (await client.get("/v1/memory/items", params={"conversation_id": private})).json()["items"]
        )
        assert later in listed and secret not in listed


async def test_a_reply_waiting_for_an_approval_across_a_forget_all_does_not_retell_it_afterwards(
    start_server: Any, fake_openai: Any, make_settings: Any
) -> None:
    """A reply shown a memory, then parked for an approval while the user forgot all of their
    memory, went on after the approval in a new turn: above the conversation's forget mark and
    with memory in use, that turn (which retold the memory) was remembered, and the forgotten
    fact came back. A reply begun before the forget stays unremembered in every step."""
    server: LiveServer = await start_server(
        tools=transfer_tools([]),
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        query_rewrite="heuristic",
    )
    db = server.services.db
    retelling = "Sent: fuel money for the dark green 2009 Volvo estate, as you asked."
    async with server.client() as client:
        stated = await new_conversation(client, "Cars")
        fake_openai.script(Reply(text="Noted."))
        await say(client, stated, STATEMENT)
        await index_outbox(db, make_settings())
        trip = await new_conversation(client, "Trip")
        call = ToolCall("transfer_funds", {"amount": 40, "to": "bob"})
        fake_openai.script(Reply(text="Fuel money for your Volvo.", tool_calls=[call]), Reply(text=retelling))
        parked = await park(client, trip, "Send Bob 40 for fuel for my car, please.")
        assert STATEMENT in json.dumps(fake_openai.requests[-1].messages)  # shown as a memory

        assert (await client.delete("/v1/memory")).status_code == 204
        async with client.stream("POST", approve_url(required(parked)), json={}) as r:
            assert r.status_code == 200
            events = await collect(r)
        assert events[-1].event == EventName.TURN_COMPLETED
        assert retelling in [
            t["content"] for t in (await client.get(f"/v1/conversations/{trip}/turns")).json()["items"]
        ]

        def old_fact(found: list[dict[str, Any]]) -> list[str]:
            return [item["text"] for item in found if "2009" in item["text"]]

        # Before the reply's last turn is indexed (the not-yet-indexed search), and after.
        searched = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
        assert old_fact(searched.json()["items"]) == []
        await index_outbox(db, make_settings())
        searched = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
        assert old_fact(searched.json()["items"]) == []
        assert old_fact((await client.get("/v1/memory/items", params={"limit": 200})).json()["items"]) == []


@pytest.mark.parametrize("change", ["forget", "delete"])
async def test_a_forgotten_fact_does_not_come_back_through_a_reply_shown_it_by_the_recall_tool(
    server: LiveServer, make_settings: Any, change: str
) -> None:
    """Forgetting a fact (or deleting its conversation) forgot the replies shown it by their
    prompt, but not a reply shown it by the recall_memory tool: that reply retold it, stayed
    remembered, and the fact came back in memory search and the items list."""
    db = server.services.db
    boat = "My sailing boat is called Sea Biscuit and is moored in Kinsale."
    async with server.client() as client:
        boats = await new_conversation(client, "Boats")
        await say(client, boats, boat)
        await index_outbox(db, make_settings())
        asked = await new_conversation(client, "Ask")
        # Recall before the reply is of this conversation only: the tool alone shows the fact.
        events = await say(
            client, asked, "/remember what is my sailing boat called", memory_scope="conversation"
        )
        assert boat not in [item["text"] for item in retrieved(events)["items"]]
        turns = (await client.get(f"/v1/conversations/{asked}/turns")).json()["items"]
        assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant"]
        assert "Sea Biscuit" in turns[2]["content"] and "Sea Biscuit" in turns[3]["content"]
        await index_outbox(db, make_settings())

        def old_fact(found: list[dict[str, Any]]) -> list[str]:
            return [item["text"] for item in found if "Sea Biscuit" in item["text"]]

        listed = (await client.get("/v1/memory/items", params={"limit": 200})).json()["items"]
        # The statement, its reply, and the reply that retold it from the tool's answer: could fail.
        assert turns[3]["content"] in [item["text"] for item in listed] and boat in old_fact(listed)
        if change == "forget":
            [statement] = [item for item in listed if item["text"] == boat]
            assert (await client.delete(f"/v1/memory/items/{statement['id']}")).status_code == 204
        else:
            assert (await client.delete(f"/v1/conversations/{boats}")).status_code == 204
        searched = await client.post("/v1/memory/search", json={"query": "Sea Biscuit in Kinsale", "k": 20})
        assert old_fact(searched.json()["items"]) == []
        assert old_fact((await client.get("/v1/memory/items", params={"limit": 200})).json()["items"]) == []


@pytest.mark.parametrize("change", ["forget", "correct", "remember_off"])
async def test_a_forgotten_fact_shown_before_it_was_indexed_is_not_shown_again(
    start_server: Any, fake_openai: Any, make_settings: Any, change: str
) -> None:
    """A memory shown to a reply before the indexer reached it, then indexed, then forgotten (or
    corrected, or its chat no longer remembered) by the user, was shown again in every later
    prompt of that conversation: the stored part's memory counted as alive while its turn was
    there and not forgotten by the conversation's mark, which none of these moves."""
    server = await small_model_server(start_server, fake_openai)
    db = server.services.db
    async with server.client() as client:
        stated = await new_conversation(client, "Cars")
        fake_openai.script(Reply(text="Noted."))
        await say(client, stated, STATEMENT)
        asked = await new_conversation(client, "Question")
        fake_openai.script(Reply(text="You told me about your car."))
        shown = retrieved(await say(client, asked, QUESTION))
        assert STATEMENT in [item["text"] for item in shown["items"]]  # shown before it was indexed
        await index_outbox(db, make_settings())
        items = (await client.get("/v1/memory/items", params={"limit": 50})).json()["items"]
        [statement] = [item for item in items if item["text"] == STATEMENT]
        if change == "forget":
            assert (await client.delete(f"/v1/memory/items/{statement['id']}")).status_code == 204
        elif change == "correct":
            corrected = "My car is a 2015 Skoda Octavia in silver."
            patched = await client.patch(f"/v1/memory/items/{statement['id']}", json={"text": corrected})
            assert patched.status_code == 200
        else:
            off = await client.patch(f"/v1/conversations/{stated}", json={"remember": False})
            assert off.status_code == 200
        fake_openai.script(Reply(text="Noted."))
        await say(client, asked, "Thanks. Anything else to tell me?", memory_scope="none")
        assert STATEMENT not in json.dumps(fake_openai.requests[-1].messages)
        context = (await client.get(f"/v1/conversations/{asked}/context")).json()
        assert STATEMENT not in json.dumps(context)
