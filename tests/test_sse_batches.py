"""Events waiting for a follower go out in one write, and still parse as separate events with ids."""

from __future__ import annotations

import time
import uuid
from typing import Any

from chat_api.replies import ReplyKind, sse_frame, sse_stream
from memory.events import EventName
from tests.conftest import LiveServer
from tests.sse import SSEEvent, iter_sse, parse_sse

RATE = 50.0


async def test_a_follower_behind_catches_up_in_one_write_of_separate_events(start_server: Any) -> None:
    server: LiveServer = await start_server(demo_tokens_per_second=RATE)
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={"title": "batches"})).json()["id"]
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "batch me /long"}
        ) as response:
            assert response.status_code == 200
            stream = iter_sse(response)
            events = []
            async for event in stream:
                events.append(event)
                if event.event == EventName.MESSAGE_DELTA:
                    break
            reply_id = uuid.UUID(events[0].data["reply_id"])
            # A second follower of the same live reply, from the start: what is already in the
            # log (turn.started, memory.retrieved, the first delta) comes as one write.
            follower = sse_stream(
                server.services, reply_id, 0, on_disconnect="continue", kind=ReplyKind.FOLLOWED
            )
            writes = [await anext(follower)]
            assert len(parse_sse(writes[0])) >= 3
            # Stall the event loop, as a burst of work would: tokens fall due meanwhile and the
            # follower finds several of them waiting when it runs again.
            time.sleep(0.3)
            writes += [chunk async for chunk in follower]
            events += [event async for event in stream]
    followed = [event for chunk in writes for event in parse_sse(chunk)]
    assert [e.id for e in followed] == list(range(1, len(followed) + 1))
    assert [(e.id, e.event, e.data) for e in followed] == [(e.id, e.event, e.data) for e in events]
    assert followed[-1].event == EventName.TURN_COMPLETED
    deltas_per_write = [sum(e.event == EventName.MESSAGE_DELTA for e in parse_sse(chunk)) for chunk in writes]
    assert max(deltas_per_write[1:]) >= 5  # 0.3 s at 50 tokens/s: ~15 were due at once
    assert len(writes) < len(followed)


def test_frames_are_what_an_event_source_parses() -> None:
    data = {"text": "line one\nline two\r\n “quoted” \u2028 end", "n": 1}
    frames = sse_frame((7, EventName.MESSAGE_DELTA, data)) + sse_frame(
        (8, EventName.TURN_COMPLETED, {"status": "completed"})
    )
    assert frames.count(b"\r\n\r\n") == 2
    parsed = parse_sse(frames)
    done = {"status": "completed"}
    assert parsed == [SSEEvent(7, EventName.MESSAGE_DELTA, data), SSEEvent(8, EventName.TURN_COMPLETED, done)]
