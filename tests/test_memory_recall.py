"""Long-term memory in every reply: rewrite, hybrid recall across conversations, isolation, forgetting.

Live server, real Postgres, the deterministic HashEmbedder. No indexer runs in the test
server, so every recall below that does not call `index_outbox` goes through the
read-your-writes path (finished turns above the watermark); the tests that do call it
index through the real `IndexPipeline`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import httpx
from sqlalchemy import event, select, update

from indexer.pipeline import IndexPipeline
from memory.config import Settings
from memory.events import EventName
from memory.recall.embeddings import HashEmbedder
from memory.recall.rewrite import HistoryLine, clean_model_query, heuristic_rewrite
from memory.storage.db import Database
from memory.storage.models import Conversation, MemoryItem, OutboxRow, Turn
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply
from tests.sse import SSEEvent, collect
from tests.support import CountingEmbedder, new_conversation

FACT = "My sister Ingrid moved to Reykjavik last spring and keeps honeybees there."
QUESTION = "Where does my sister Ingrid live now?"


async def say(client: httpx.AsyncClient, cid: str, content: str, **fields: Any) -> list[SSEEvent]:
    """Send a message and read the whole SSE stream."""
    async with client.stream(
        "POST", f"/v1/conversations/{cid}/messages", json={"content": content, **fields}
    ) as r:
        assert r.status_code == 200, await r.aread()
        events = await collect(r)
    assert events[-1].event == EventName.TURN_COMPLETED, events[-1]
    return events


def retrieved(events: list[SSEEvent]) -> dict[str, Any]:
    found = [e.data for e in events if e.event == EventName.MEMORY_RETRIEVED]
    assert len(found) == 1, [e.event for e in events]
    return found[0]  # type: ignore[no-any-return]


def reply_text(events: list[SSEEvent]) -> str:
    return "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)


async def index_outbox(db: Database, settings: Settings) -> Any:
    """Index every pending outbox row through the real pipeline, as the worker would."""
    async with db.transaction() as session:
        payloads = list((await session.execute(select(OutboxRow.payload).order_by(OutboxRow.id))).scalars())
    return await IndexPipeline(db, HashEmbedder(), settings).index(payloads)


async def test_fact_from_another_conversation_is_recalled_before_indexing(server: LiveServer) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, FACT)
        b = await new_conversation(client, "Travel plans")
        events = await say(client, b, QUESTION)
    memory = retrieved(events)
    assert memory["query"] == QUESTION
    assert memory["rewrite"] == "skipped"  # no history in conversation b
    assert memory["scope"] == "user"
    texts = [item["text"] for item in memory["items"]]
    assert FACT in texts
    item = memory["items"][texts.index(FACT)]
    assert item["conversation_id"] == a and item["conversation_title"] == "Family"
    assert item["role"] == "user" and item["score"] > 0
    assert set(memory["latency_ms"]) >= {"rewrite", "search", "total"}
    # The demo model quotes the memory block lines it was given.
    assert "Reykjavik" in reply_text(events)


async def test_an_unindexed_turn_is_encoded_once_across_recalls(start_server: Any) -> None:
    # While the indexer lags, every recall finds the same unindexed turns: re-encoding
    # them before each reply was most of memory's CPU cost per message.
    embedder = CountingEmbedder()
    server: LiveServer = await start_server(embedder=embedder)
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        for question in (QUESTION, "Does Ingrid keep bees?", "Which city did my sister move to?"):
            found = retrieved(await say(client, await new_conversation(client), question))
            assert FACT in [item["text"] for item in found["items"]]  # still recalled, from the kept vector
    # As a turn it is embedded dated ("[24 November 2026] My sister..."); undated, it was a query.
    fact_encodes = [text for text in embedder.texts if text.startswith("[") and text.endswith(FACT)]
    assert len(fact_encodes) == 1, fact_encodes


async def test_a_replys_query_is_encoded_once_when_its_block_is_shaped_by_sentences(
    start_server: Any,
) -> None:
    # With MEMORY_SENTENCES the block's sentences were scored against the query encoded a
    # second time, in a second encoder call, after the search had encoded it already.
    embedder = CountingEmbedder()
    server: LiveServer = await start_server(embedder=embedder, memory_sentences=1)
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        found = retrieved(await say(client, await new_conversation(client), QUESTION))
    assert FACT in [item["text"] for item in found["items"]]
    assert embedder.texts.count(QUESTION) == 1, embedder.texts


async def test_an_unindexed_image_caption_is_searched_as_the_index_will_hold_it(server: LiveServer) -> None:
    # The indexer embeds and keyword-indexes a shared image's caption with its turn; before
    # it runs, recall must find the turn by the caption's words too.
    async with server.client() as client:
        conversation = await new_conversation(client, "Beach")
        turns = [
            {
                "role": "user",
                "content": "Look what we found this morning!",
                "name": "Mel",
                "metadata": {"blip_caption": "a golden retriever digging in the sand"},
            },
            {"role": "assistant", "content": "What a lovely morning.", "name": "Caro"},
        ]
        imported = await client.post(f"/v1/conversations/{conversation}/import", json={"turns": turns})
        assert imported.status_code == 201, imported.text
        found = await client.post("/v1/memory/search", json={"query": "golden retriever", "k": 5})
    assert found.status_code == 200, found.text
    items = found.json()["items"]
    assert items and items[0]["text"] == "Look what we found this morning!", items
    assert items[0]["metadata"]["blip_caption"].startswith("a golden retriever")


async def test_indexed_fact_is_recalled_once_and_keywords_include_the_question(
    server: LiveServer, db: Database, make_settings: Any
) -> None:
    async with server.client() as client:
        a = await new_conversation(client, "Family")
        await say(client, a, "Which city did Ingrid choose?")
        await say(client, a, "Reykjavik, in the end.")
        result = await index_outbox(db, make_settings())
        assert result.indexed_turns >= 3
        async with db.transaction() as session:
            indexed_seq = (
                await session.execute(select(Conversation.indexed_seq).where(Conversation.id == a))
            ).scalar_one()
        assert indexed_seq == 4
        b = await new_conversation(client)
        events = await say(client, b, "What city did Ingrid choose?")
    items = retrieved(events)["items"]
    texts = [item["text"] for item in items]
    assert "Reykjavik, in the end." in texts  # found through the previous turn's words
    assert len(set(i["turn_id"] for i in items)) == len(items)


async def test_other_users_and_tenants_never_appear(start_server: Any) -> None:
    server: LiveServer = await start_server()
    secrets = {
        ("t1", "u2"): "Ingrid Reykjavik honeybees secret of user two",
        ("t2", "u1"): "Ingrid Reykjavik honeybees secret of tenant two",
    }
    for (tenant, user), secret in secrets.items():
        async with server.client(tenant, user) as other:
            await say(other, await new_conversation(other), secret)
    async with server.client() as client:
        events = await say(client, await new_conversation(client), QUESTION)
        assert retrieved(events)["items"] == []
        found = await client.post("/v1/memory/search", json={"query": "Ingrid Reykjavik honeybees secret"})
    assert found.status_code == 200, found.text
    # Only the caller's own question and the reply to it can match; nothing of the others.
    assert found.json()["items"]
    assert all("secret" not in item["text"] for item in found.json()["items"])
    assert "secret" not in reply_text(events)


async def test_scope_conversation_narrows_and_none_skips(start_server: Any) -> None:
    server: LiveServer = await start_server(context_max_turns=1)  # the window: the question only
    async with server.client() as client:
        a = await new_conversation(client, "A")
        await say(client, a, FACT)
        b = await new_conversation(client, "B")
        await say(client, b, "Ingrid also likes sailing on the fjords.")
        narrowed = await say(client, b, QUESTION, memory_scope="conversation")
        wide = await say(client, b, QUESTION)
        off = await say(client, b, QUESTION, memory_scope="none")
    narrowed_items = retrieved(narrowed)["items"]
    assert retrieved(narrowed)["scope"] == "conversation"
    assert "Ingrid also likes sailing on the fjords." in [item["text"] for item in narrowed_items]
    assert all(item["conversation_id"] == b for item in narrowed_items)
    assert FACT in [item["text"] for item in retrieved(wide)["items"]]
    assert not [e for e in off if e.event == EventName.MEMORY_RETRIEVED]


async def test_turns_in_the_prompt_window_are_not_recalled_again(start_server: Any) -> None:
    server: LiveServer = await start_server(context_max_turns=3)
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, cid, FACT)  # turns 1-2: soon outside a three-unit window
        await say(client, cid, "Ingrid sends her regards from the harbour.")  # turns 3-4
        events = await say(client, cid, QUESTION)
        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
    items = retrieved(events)["items"]
    window = set(context["window_turn_ids"])
    assert FACT in [item["text"] for item in items]  # outside the window: recalled
    assert all(item["turn_id"] not in window for item in items)
    assert "Ingrid sends her regards from the harbour." not in [item["text"] for item in items]


async def test_the_prompt_window_is_read_once_per_reply_and_shared_by_recall_and_the_first_step(
    server: LiveServer,
) -> None:
    """Recall read and built the window, then the first model step read and built it again."""
    reads: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        # memory.record.turns.RECENT_TURNS, the window's one statement (the unindexed search also walks
        # lineages)
        if "unnest(b.lineage_ids" in statement and "indexed_seq" not in statement:
            reads.append(statement)

    engine = server.services.db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        async with server.client() as client:
            cid = await new_conversation(client)
            await say(client, cid, FACT)
            reads.clear()
            events = await say(client, cid, QUESTION)
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert "error" not in retrieved(events)  # memory was recalled, from that window
    assert len(reads) == 1


async def test_forget_all_memory_is_immediate_and_survives_the_indexer(
    server: LiveServer, db: Database, make_settings: Any
) -> None:
    async with server.client() as client:
        a = await new_conversation(client)
        await say(client, a, FACT)
        await index_outbox(db, make_settings())  # indexed ...
        await say(client, a, "Ingrid's honeybees produced forty jars of Reykjavik honey.")  # ... and not yet
        assert (await client.delete("/v1/memory")).status_code == 204
        found = await client.post("/v1/memory/search", json={"query": "Ingrid Reykjavik honeybees honey"})
        assert found.json()["items"] == []
        # The queued turns reach the indexer after the delete: they stay forgotten.
        result = await index_outbox(db, make_settings())
        assert result.skipped["forgotten"] >= 2
        async with db.transaction() as session:
            rows = (await session.execute(select(MemoryItem.id))).all()
        assert rows == []
        events = await say(client, await new_conversation(client), QUESTION)
        assert retrieved(events)["items"] == []
        # The history stays visible, and what is said afterwards is remembered again.
        turns = (await client.get(f"/v1/conversations/{a}/turns")).json()["items"]
        assert FACT in [t["content"] for t in turns]
        await say(client, a, "Ingrid now keeps goats as well.")
        later = await client.post("/v1/memory/search", json={"query": "Ingrid goats"})
    assert "Ingrid now keeps goats as well." in [i["text"] for i in later.json()["items"]]


async def test_deleting_a_conversation_forgets_its_memory_now(
    server: LiveServer, db: Database, make_settings: Any
) -> None:
    async with server.client() as client:
        a = await new_conversation(client)
        await say(client, a, FACT)
        await index_outbox(db, make_settings())
        await say(client, a, "Ingrid's Reykjavik apartment overlooks the harbour.")  # unindexed
        b = await new_conversation(client)
        await say(client, b, "Ingrid visits Reykjavik museums on Sundays.")
        assert (await client.delete(f"/v1/conversations/{a}")).status_code == 204
        found = await client.post("/v1/memory/search", json={"query": "Ingrid Reykjavik"})
    conversations = {item["conversation_id"] for item in found.json()["items"]}
    assert conversations == {b}


async def test_rewritten_query_is_stored_and_announced(server: LiveServer, db: Database) -> None:
    async with server.client() as client:
        a = await new_conversation(client)
        await say(client, a, FACT)
        b = await new_conversation(client)
        await say(client, b, "Tell me about Ingrid and her honeybees.")
        events = await say(client, b, "Where is that?")
    memory = retrieved(events)
    assert memory["rewrite"] == "heuristic"  # the demo model cannot rewrite
    assert memory["rewritten_query"].startswith("Where is that?")
    assert "Ingrid" in memory["rewritten_query"]  # the pronoun got its context
    assert FACT in [item["text"] for item in memory["items"]]
    reply_id = events[0].data["reply_id"]
    async with db.transaction() as session:
        stored = (
            await session.execute(select(Turn.rewritten_query).where(Turn.id == uuid.UUID(reply_id)))
        ).scalar_one()
    assert stored == memory["rewritten_query"]


async def test_the_searched_query_is_stored_with_the_first_steps_write_not_by_statements_of_its_own(
    server: LiveServer, db: Database
) -> None:
    """Recall stored its query in the search's transaction: two more statements before the first token."""
    writes: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if re.search(r"rewritten_query\s*=", statement):  # an UPDATE that sets it
            writes.append(statement)

    engine = server.services.db.engine.sync_engine
    event.listen(engine, "before_cursor_execute", note)
    try:
        async with server.client() as client:
            await say(client, await new_conversation(client), FACT)
            writes.clear()
            events = await say(client, await new_conversation(client), QUESTION)
    finally:
        event.remove(engine, "before_cursor_execute", note)
    assert FACT in [item["text"] for item in retrieved(events)["items"]]
    assert len(writes) == 1 and "memory_use" in writes[0], writes  # one UPDATE of the reply's first turn
    async with db.transaction() as session:
        stored = (
            await session.execute(
                select(Turn.rewritten_query).where(Turn.id == uuid.UUID(events[0].data["reply_id"]))
            )
        ).scalar_one()
    assert stored == QUESTION


async def test_slow_rewrite_model_falls_back_to_the_heuristic_in_time(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
        rewrite_model="fake-rewriter",
        rewrite_timeout_seconds=1.0,  # wide enough for the rewrite in time on a loaded machine
    )
    fake_openai.script(
        Reply(text="Noted."),  # the first reply (no history: no rewrite)
        Reply(text="Ingrid city of residence", chunk_delay=8.0),  # the rewrite, too slow
        Reply(text="She lives in Reykjavik."),
        Reply(text="Ingrid honeybees Reykjavik"),  # a rewrite in time
        Reply(text="Yes."),
    )
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, cid, FACT)
        started = asyncio.get_running_loop().time()
        slow = retrieved(await say(client, cid, "And where is that?"))
        elapsed = asyncio.get_running_loop().time() - started
        fast = retrieved(await say(client, cid, "Does she still keep them?"))
    assert slow["rewrite"] == "heuristic" and slow["rewrite_fallback"]
    assert elapsed < 5.0  # the time box held; the slow rewrite (8 s) was not awaited
    assert fast["rewrite"] == "model" and fast["rewritten_query"] == "Ingrid honeybees Reykjavik"
    rewrites = [r for r in fake_openai.requests if not r.stream]
    assert [r.model for r in rewrites] == ["fake-rewriter", "fake-rewriter"]
    assert "And where is that?" in rewrites[0].messages[0]["content"]


async def test_recall_memory_tool_returns_items(server: LiveServer) -> None:
    async with server.client() as client:
        await say(client, await new_conversation(client, "Family"), FACT)
        events = await say(client, await new_conversation(client), "/remember Ingrid Reykjavik honeybees")
    results = [e.data for e in events if e.event == EventName.TOOL_RESULT]
    assert len(results) == 1 and results[0]["name"] == "recall_memory"
    assert results[0]["state"] == "succeeded"
    assert "Reykjavik last spring" in results[0]["result"]
    assert '"conversation_title": "Family"' in results[0]["result"]


async def test_conversations_with_memory_off_are_never_recalled(
    server: LiveServer, db: Database, make_settings: Any
) -> None:
    async with server.client() as client:
        private = await new_conversation(client, memory_mode="none")
        await say(client, private, FACT)
        events = await say(client, await new_conversation(client), QUESTION)
        assert retrieved(events)["items"] == []
        # Rows indexed before the switch to `none` are not recalled either.
        kept = await new_conversation(client)
        await say(client, kept, FACT)
        result = await index_outbox(db, make_settings())
        # Not indexed: the private chat's two turns, and the kept chat's demo reply, which only
        # repeats what it was shown (the question and its reply, recalled): a copy.
        assert result.indexed_turns == 3 and result.skipped["memory_off"] == 2
        assert result.skipped["repeats_what_it_was_shown"] == 1
        async with db.transaction() as session:
            await session.execute(
                update(Conversation).where(Conversation.id == kept).values(memory_mode="none")
            )
        found = await client.post("/v1/memory/search", json={"query": FACT})
    assert found.json()["items"]  # the question asked in between is found ...
    assert {item["conversation_id"] for item in found.json()["items"]}.isdisjoint({private, kept})


async def test_chinese_fact_is_recalled_by_keyword(server: LiveServer) -> None:
    async with server.client() as client:
        await say(client, await new_conversation(client), "我妹妹去年搬到了雷克雅未克，还养了很多蜜蜂。")
        await say(client, await new_conversation(client), "周末我们去看了一场电影。")
        r = await client.post("/v1/memory/search", json={"query": "我妹妹现在住在雷克雅未克吗？", "k": 1})
    assert [item["text"] for item in r.json()["items"]] == ["我妹妹去年搬到了雷克雅未克，还养了很多蜜蜂。"]


def test_heuristic_rewrite_resolves_references_and_keeps_standalone_questions() -> None:
    history = [
        HistoryLine("user", "I am planning a trip to Kyoto in April."),
        HistoryLine("assistant", "Kyoto in April has the cherry blossoms."),
    ]
    resolved = heuristic_rewrite("Is it expensive there?", history)
    assert resolved.startswith("Is it expensive there?") and "Kyoto" in resolved and "cherry" not in resolved
    standalone = "Which hotel in Osaka did Maria recommend last summer?"
    assert heuristic_rewrite(standalone, history) == standalone
    assert heuristic_rewrite("Is it expensive?", []) == "Is it expensive?"
    assert len(heuristic_rewrite("And that?", history * 10).split()) <= 2 + 8


def test_heuristic_rewrite_takes_the_users_words_never_the_assistants() -> None:
    """Found: the fallback appended the assistant's reply, a tool call written as JSON included."""
    history = [
        HistoryLine("user", "My sister Mara lives in Porto."),
        HistoryLine("assistant", 'Based on the conversation provided ```json {"name": "current_time"}```'),
    ]
    query = heuristic_rewrite("What is her name?", history)
    assert query == "What is her name? sister Mara lives Porto"
    assert not {"Based", "conversation", "json", "current_time"} & set(query.split())


async def test_a_question_that_stands_alone_is_not_rewritten(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """No model call (on a one-slot local server it would delay the reply), even with history."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", max_tool_steps=0
    )
    fake_openai.script(Reply(text="Noted."), Reply(text="In Reykjavik."))
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, cid, FACT)
        memory = retrieved(await say(client, cid, "Which city did my sister Ingrid move to?"))
    assert (memory["rewrite"] == "skipped" and memory["rewritten_query"] is None) or memory[
        "rewrite"
    ] == "skipped"
    assert all(r.stream for r in fake_openai.requests)  # no rewrite request


async def test_query_rewrite_heuristic_never_asks_the_model(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        query_rewrite="heuristic",
    )
    fake_openai.script(Reply(text="Noted."), Reply(text="There."))
    async with server.client() as client:
        cid = await new_conversation(client)
        await say(client, cid, FACT)
        memory = retrieved(await say(client, cid, "And where is that?"))
    assert memory["rewrite"] == "heuristic" and "Ingrid" in memory["rewritten_query"]
    assert all(r.stream for r in fake_openai.requests)


def test_model_answers_are_cleaned_or_refused() -> None:
    assert (
        clean_model_query('Query: "Kyoto hotel prices in April"\nBecause...') == "Kyoto hotel prices in April"
    )
    assert clean_model_query("  \n“京都四月的酒店价格”") == "京都四月的酒店价格"
    assert clean_model_query("") is None
    assert clean_model_query("x" * 501) is None


async def test_fusion_settings_reach_the_search(start_server: Any, db: Database, make_settings: Any) -> None:
    """MEMORY_FUSION picks the fusion; with rrf, MEMORY_RRF_K and MEMORY_KEYWORD_WEIGHT change its scores."""

    async def scores(server: LiveServer) -> list[float]:
        async with server.client() as client:
            found = await client.post("/v1/memory/search", json={"query": QUESTION, "k": 10})
        assert found.status_code == 200, found.text
        assert FACT in found.json()["items"][0]["text"]
        return [item["score"] for item in found.json()["items"]]

    default = await start_server()
    async with default.client() as client:
        cid = await new_conversation(client, "Family")
        await say(client, cid, FACT)
        await say(client, cid, "The weather report for tomorrow says light rain.")
    await index_outbox(db, make_settings())
    learned = await scores(default)
    before = await scores(await start_server(memory_fusion="rrf"))
    flat = await scores(
        await start_server(memory_fusion="rrf", memory_rrf_k=1000.0, memory_keyword_weight=1.0)
    )
    assert len(before) == len(flat) == len(learned) >= 2
    assert before[0] == flat[0] == 1.0  # the fact is first in both rankings whatever the fusion
    # A large k flattens the fusion: every lower-ranked item scores closer to the top.
    assert min(flat) > min(before)
    # The learned fusion's scores are its own (a probability-like value), not RRF's.
    assert 0 < learned[0] < 1 and learned != before
