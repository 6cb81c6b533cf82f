"""The chat path end to end over real HTTP: conversations, streaming replies, persistence."""

from __future__ import annotations

from memory.events import EventName
from tests.conftest import LiveServer
from tests.sse import collect
from tests.support import new_conversation


async def test_streamed_reply_is_persisted_with_increasing_event_ids(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "hello 👋 مرحبا"}
        ) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await collect(r)
        names = [e.event for e in events]
        assert names[0] == EventName.TURN_STARTED and names[-1] == EventName.TURN_COMPLETED
        ids = [e.id for e in events]
        assert ids == list(range(1, len(events) + 1))
        text = "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [t["role"] for t in turns] == ["user", "assistant"]
        assert turns[0]["content"] == "hello 👋 مرحبا"
        assert turns[1]["status"] == "completed" and turns[1]["content"] == text
        assert "[demo model]" in text


async def test_non_streaming_mode_returns_finished_reply(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        r = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "hi there", "stream": False}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "completed"
        assert body["user_turn"]["content"] == "hi there"
        assert body["turns"][-1]["content"].startswith("[demo model]")
