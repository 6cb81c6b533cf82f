"""GET /v1/turns/{id}/events after the fact: the reply's whole timeline, from any of its turns, and the end.

A frontend replays how a reply was produced from it: every delta, tool-call delta, tool
start and result, step, and the ending, exactly as the live stream sent them. Live
server, real Postgres; the replies are over (and out of the runner's memory) when read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from memory.events import EventName
from tests.conftest import LiveServer
from tests.sse import SSEEvent, collect, iter_sse
from tests.support import new_conversation
from tests.test_branches import turns

Frame = tuple[int | None, str, Any]


def frames(events: list[SSEEvent]) -> list[Frame]:
    return [(e.id, e.event, e.data) for e in events]


async def live(client: httpx.AsyncClient, cid: str, content: str) -> list[Frame]:
    async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": content}) as r:
        assert r.status_code == 200
        return frames(await collect(r))


async def replay(client: httpx.AsyncClient, turn_id: str) -> list[Frame]:
    async with client.stream("GET", f"/v1/turns/{turn_id}/events") as r:
        assert r.status_code == 200
        return frames(await collect(r))


async def test_a_finished_reply_with_a_tool_replays_whole_from_any_of_its_turns(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        seen = await live(client, cid, "/tool current_time {}")
        names = [name for _, name, _ in seen]
        for expected in (
            EventName.TURN_STARTED,
            EventName.TOOL_CALL_DELTA,
            EventName.TOOL_STARTED,
            EventName.TOOL_RESULT,
            EventName.STEP_STARTED,
        ):
            assert expected in names, names
        assert names[-1] == EventName.TURN_COMPLETED
        history = await turns(client, cid)
        assert [t["role"] for t in history] == ["user", "assistant", "tool", "assistant"]
        for turn in history:
            assert await replay(client, turn["id"]) == seen
        # Resuming from the middle gives exactly the rest.
        async with client.stream("GET", f"/v1/turns/{history[1]['id']}/events", params={"after": 3}) as r:
            assert frames(await collect(r)) == seen[3:]


async def test_an_interrupted_reply_replays_up_to_its_interruption(start_server: Callable[..., Any]) -> None:
    server = await start_server(demo_tokens_per_second=40.0)
    async with server.client() as client:
        cid = await new_conversation(client)
        seen: list[Frame] = []
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"}
        ) as r:
            async for event in iter_sse(r):
                seen.append((event.id, event.event, event.data))
                if sum(1 for _, name, _ in seen if name == EventName.MESSAGE_DELTA) == 3:
                    stopped = await client.post(f"/v1/turns/{seen[0][2]['reply_id']}/stop")
                    assert stopped.status_code == 200
            # The stream goes on to the ending after the stop.
        assert seen[-1][1] == EventName.TURN_INTERRUPTED
        assert seen[-1][2]["status"] == "interrupted_by_user"
        for turn in await turns(client, cid):
            assert await replay(client, turn["id"]) == seen


async def test_replies_from_before_a_branch_switch_still_replay(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        first = await live(client, cid, "tell me a fact about owls")
        old_reply = first[0][2]["assistant_turn_id"]
        async with client.stream("POST", f"/v1/turns/{old_reply}/regenerate", json={}) as r:
            second = frames(await collect(r))
        assert second[-1][1] == EventName.TURN_COMPLETED
        assert second[0][2]["assistant_turn_id"] != old_reply
        assert await replay(client, old_reply) == first
        assert await replay(client, second[0][2]["assistant_turn_id"]) == second
        r = await client.post(f"/v1/conversations/{cid}/branches/{cid}/activate")
        assert r.status_code == 200
        assert await replay(client, old_reply) == first
        assert await replay(client, second[0][2]["assistant_turn_id"]) == second
