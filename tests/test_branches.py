"""Forks, regenerate, edit and branch switching, over real HTTP with the demo model and real Postgres."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from sqlalchemy import func, select

from memory.events import EventName
from memory.storage.db import Database
from memory.storage.models import Branch, Turn
from tests.conftest import LiveServer
from tests.sse import SSEEvent, collect, iter_sse
from tests.support import new_conversation


async def send(client: httpx.AsyncClient, cid: str, content: str) -> dict[str, Any]:
    """A message and its whole reply (stream: false)."""
    r = await client.post(f"/v1/conversations/{cid}/messages", json={"content": content, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "completed"
    return r.json()  # type: ignore[no-any-return]


async def turns(client: httpx.AsyncClient, cid: str, branch: str | None = None) -> list[dict[str, Any]]:
    params = {"branch": branch} if branch else {}
    r = await client.get(f"/v1/conversations/{cid}/turns", params=params)
    assert r.status_code == 200, r.text
    return r.json()["items"]  # type: ignore[no-any-return]


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [t["id"] for t in items]


async def branches(client: httpx.AsyncClient, cid: str) -> dict[str, Any]:
    r = await client.get(f"/v1/conversations/{cid}/branches")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def context_ids(client: httpx.AsyncClient, cid: str) -> list[str]:
    r = await client.get(f"/v1/conversations/{cid}/context")
    assert r.status_code == 200, r.text
    return [str(i) for i in r.json()["window_turn_ids"]]


async def turn_rows(db: Database) -> int:
    async with db.session() as session:
        return int((await session.execute(select(func.count()).select_from(Turn))).scalar_one())


@asynccontextmanager
async def streaming_reply(client: httpx.AsyncClient, cid: str) -> AsyncIterator[dict[str, Any]]:
    """A long reply that is streaming for the duration of the block (stopped at the end)."""
    async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"}) as r:
        assert r.status_code == 200
        events = iter_sse(r)
        started = await anext(events)
        assert started.event == EventName.TURN_STARTED
        try:
            yield started.data
        finally:
            stopped = await client.post(f"/v1/turns/{started.data['reply_id']}/stop")
            assert stopped.status_code == 200, stopped.text


# --- forks ----------------------------------------------------------------------------------


async def test_fork_shares_history_up_to_the_turn_copies_no_rows_and_leaves_the_original(
    server: LiveServer, db: Database
) -> None:
    async with server.client() as client:
        original = await new_conversation(client, "Trip")
        await send(client, original, "plan a week in Kyoto")
        await send(client, original, "add a day in Nara")
        before = await turns(client, original)
        rows_before = await turn_rows(db)

        r = await client.post(f"/v1/conversations/{original}/fork", json={"turn_id": before[1]["id"]})
        assert r.status_code == 201, r.text
        fork = r.json()
        assert fork["id"] != original and fork["title"] == "Trip"
        assert fork["active_branch_id"] == fork["id"]
        assert await turn_rows(db) == rows_before  # nothing copied
        assert ids(await turns(client, fork["id"])) == ids(before[:2])
        assert await context_ids(client, fork["id"]) == ids(before[:2])

        await send(client, fork["id"], "what about Osaka instead?")
        forked = await turns(client, fork["id"])
        assert ids(forked[:2]) == ids(before[:2])
        assert [t["role"] for t in forked] == ["user", "assistant", "user", "assistant"]
        assert forked[2]["content"] == "what about Osaka instead?"
        assert [t["conversation_id"] for t in forked] == [original] * 2 + [fork["id"]] * 2
        assert await turn_rows(db) == rows_before + 2  # only the fork's own turns
        assert await turns(client, original) == before  # the original is untouched
        assert await context_ids(client, original) == ids(before)

        # A fork of the fork, at one of its own turns and at a turn it shares.
        r = await client.post(f"/v1/conversations/{fork['id']}/fork", json={"turn_id": forked[2]["id"]})
        assert r.status_code == 201, r.text
        assert ids(await turns(client, r.json()["id"])) == ids(forked[:3])
        r = await client.post(f"/v1/conversations/{fork['id']}/fork", json={"turn_id": forked[0]["id"]})
        assert r.status_code == 201, r.text
        assert ids(await turns(client, r.json()["id"])) == ids(forked[:1])


async def test_fork_answers_404_for_other_tenants_unknown_turns_and_turns_outside_the_history(
    server: LiveServer,
) -> None:
    async with server.client() as client, server.client(tenant="t2") as other:
        a = await new_conversation(client)
        await send(client, a, "first")
        b = await new_conversation(client)
        await send(client, b, "second")
        turn_a = (await turns(client, a))[0]["id"]
        turn_b = (await turns(client, b))[0]["id"]

        r = await other.post(f"/v1/conversations/{a}/fork", json={"turn_id": turn_a})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        mine = await new_conversation(other)
        r = await other.post(f"/v1/conversations/{mine}/fork", json={"turn_id": turn_a})
        assert r.status_code == 404
        r = await client.post(f"/v1/conversations/{a}/fork", json={"turn_id": str(uuid.uuid4())})
        assert r.status_code == 404
        r = await client.post(f"/v1/conversations/{a}/fork", json={"turn_id": turn_b})
        assert r.status_code == 409 and r.json()["error"]["code"] == "turn_not_on_active_branch"
        r = await client.post(f"/v1/conversations/{a}/fork", json={"turn_id": "nope"})
        assert r.status_code == 422


async def test_fork_at_a_streaming_turn_is_409(start_server: Callable[..., Any]) -> None:
    server = await start_server(demo_tokens_per_second=20.0)
    async with server.client() as client:
        cid = await new_conversation(client)
        async with streaming_reply(client, cid) as started:
            url = f"/v1/conversations/{cid}/fork"
            r = await client.post(url, json={"turn_id": started["assistant_turn_id"]})
            assert r.status_code == 409, r.text
            assert r.json()["error"]["code"] == "turn_not_finished"
            # The user message of a running reply is finished: forking there is fine.
            r = await client.post(url, json={"turn_id": started["user_turn_id"]})
            assert r.status_code == 201, r.text


async def test_a_fork_keeps_its_shared_history_when_the_original_is_deleted(server: LiveServer) -> None:
    async with server.client() as client:
        original = await new_conversation(client)
        await send(client, original, "remember the blue door")
        shared = await turns(client, original)
        fork = (
            await client.post(f"/v1/conversations/{original}/fork", json={"turn_id": shared[1]["id"]})
        ).json()
        assert (await client.delete(f"/v1/conversations/{original}")).status_code == 204

        assert ids(await turns(client, fork["id"])) == ids(shared)
        assert await context_ids(client, fork["id"]) == ids(shared)
        await send(client, fork["id"], "and the red one")
        assert len(await turns(client, fork["id"])) == 4
        # The deleted conversation itself stays gone, also through its turns' ids.
        assert (await client.get(f"/v1/conversations/{original}/turns")).status_code == 404
        assert (await client.get(f"/v1/turns/{shared[0]['id']}")).status_code == 404


# --- regenerate and edit --------------------------------------------------------------------


async def test_regenerate_makes_a_sibling_branch_and_switching_back_restores_the_history(
    server: LiveServer,
) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "tell me about otters")
        first = await turns(client, cid)
        root = (await branches(client, cid))["active_branch_id"]
        assert root == cid

        async with client.stream("POST", f"/v1/turns/{first[1]['id']}/regenerate", json={}) as r:
            assert r.status_code == 200
            events = await collect(r)
        assert events[0].event == EventName.TURN_STARTED and events[-1].event == EventName.TURN_COMPLETED
        assert events[0].data["user_turn_id"] == first[0]["id"]
        assert [e.id for e in events] == list(range(1, len(events) + 1))

        now = await turns(client, cid)
        assert ids(now) == [first[0]["id"], events[0].data["assistant_turn_id"]]
        assert now[1]["content"].startswith("[demo model] You said: “tell me about otters”")
        listed = await branches(client, cid)
        assert len(listed["items"]) == 2
        new = next(b for b in listed["items"] if b["active"])
        assert new["parent_branch_id"] == root and new["fork_seq"] == first[0]["seq"]
        assert new["head_turn_id"] == now[1]["id"] and new["own_turns"] == 1
        assert ids(await turns(client, cid, branch=root)) == ids(first)  # the old answer stays readable
        assert await context_ids(client, cid) == ids(now)

        # The old answer is off the active branch; a user message cannot be regenerated.
        r = await client.post(f"/v1/turns/{first[1]['id']}/regenerate", json={})
        assert r.status_code == 409 and r.json()["error"]["code"] == "turn_not_on_active_branch"
        r = await client.post(f"/v1/turns/{first[0]['id']}/regenerate", json={})
        assert r.status_code == 422

        r = await client.post(f"/v1/conversations/{cid}/branches/{root}/activate")
        assert r.status_code == 200 and r.json()["active_branch_id"] == root
        assert ids(await turns(client, cid)) == ids(first)
        assert await context_ids(client, cid) == ids(first)
        # New messages continue the re-activated branch.
        await send(client, cid, "and sea otters?")
        assert ids((await turns(client, cid))[:2]) == ids(first)
        assert ids(await turns(client, cid, branch=new["id"])) == ids(now)


async def test_only_the_last_reply_can_be_regenerated(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "one")
        await send(client, cid, "two")
        history = await turns(client, cid)
        r = await client.post(f"/v1/turns/{history[1]['id']}/regenerate", json={"stream": False})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_last_reply"
        r = await client.post(f"/v1/turns/{history[3]['id']}/regenerate", json={"stream": False})
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["status"] == "completed" and reply["user_turn"]["id"] == history[2]["id"]
        assert ids(await turns(client, cid))[:3] == ids(history[:3])


async def test_regenerate_of_a_reply_with_tool_calls_accepts_any_of_its_turns(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "/tool current_time {}")
        history = await turns(client, cid)
        assert [t["role"] for t in history] == ["user", "assistant", "tool", "assistant"]
        r = await client.post(f"/v1/turns/{history[2]['id']}/regenerate", json={"stream": False})
        assert r.status_code == 200, r.text
        now = await turns(client, cid)
        assert now[0]["id"] == history[0]["id"]
        assert [t["role"] for t in now] == ["user", "assistant", "tool", "assistant"]
        assert not set(ids(now[1:])) & set(ids(history))


async def test_edit_forks_before_the_message_and_editing_a_first_message_makes_a_sibling(
    server: LiveServer, db: Database
) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "I live in Lyon")
        await send(client, cid, "recommend a bakery")
        original = await turns(client, cid)

        r = await client.post(f"/v1/turns/{original[2]['id']}/edit", json={"content": "recommend a bistro"})
        assert r.status_code == 200
        async with client.stream(
            "POST", f"/v1/turns/{original[2]['id']}/edit", json={"content": "recommend a bistro"}
        ) as r:
            assert r.status_code == 409  # the original message is no longer on the active branch
        edited = await turns(client, cid)
        assert ids(edited[:2]) == ids(original[:2])
        assert [t["content"] for t in edited[2:3]] == ["recommend a bistro"]
        assert edited[3]["role"] == "assistant" and edited[3]["status"] == "completed"
        assert ids(await turns(client, cid, branch=cid)) == ids(original)

        r = await client.post(
            f"/v1/turns/{edited[0]['id']}/edit", json={"content": "I live in Nice", "stream": False}
        )
        assert r.status_code == 200, r.text
        assert [t["content"] for t in await turns(client, cid)][:1] == ["I live in Nice"]
        listed = (await branches(client, cid))["items"]
        assert len(listed) == 3
        newest = next(b for b in listed if b["active"])
        assert newest["parent_branch_id"] == cid and newest["fork_seq"] == 0

        # An edit of the first message of a branch: a sibling of that branch, not its child.
        first_of_newest = (await turns(client, cid))[0]["id"]
        r = await client.post(
            f"/v1/turns/{first_of_newest}/edit", json={"content": "I live in Metz", "stream": False}
        )
        assert r.status_code == 200, r.text
        async with db.session() as session:
            active = await session.get(Branch, uuid.UUID((await branches(client, cid))["active_branch_id"]))
        assert active is not None and active.parent_branch_id == uuid.UUID(cid)
        assert active.lineage_ids == [active.id, uuid.UUID(cid)]

        r = await client.post(f"/v1/turns/{edited[1]['id']}/edit", json={"content": "x"})
        assert r.status_code == 422
        r = await client.post(f"/v1/turns/{first_of_newest}/edit", json={"content": ""})
        assert r.status_code == 422


async def test_edit_with_an_idempotency_key_reattaches_instead_of_branching_twice(server: LiveServer) -> None:
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "hello")
        first = (await turns(client, cid))[0]["id"]
        headers = {"Idempotency-Key": "edit-1"}
        body = {"content": "hello again", "stream": False}
        one = await client.post(f"/v1/turns/{first}/edit", json=body, headers=headers)
        two = await client.post(f"/v1/turns/{first}/edit", json=body, headers=headers)
        assert one.status_code == two.status_code == 200, two.text
        assert one.json()["turns"][0]["id"] == two.json()["turns"][0]["id"]
        assert one.json()["user_turn"]["id"] == two.json()["user_turn"]["id"]
        assert len((await branches(client, cid))["items"]) == 2

        last = (await turns(client, cid))[1]["id"]
        headers = {"Idempotency-Key": "regen-1"}
        one = await client.post(f"/v1/turns/{last}/regenerate", json={"stream": False}, headers=headers)
        two = await client.post(f"/v1/turns/{last}/regenerate", json={"stream": False}, headers=headers)
        assert one.status_code == two.status_code == 200, two.text
        assert one.json()["turns"][0]["id"] == two.json()["turns"][0]["id"]
        assert two.json()["user_turn"]["content"] == "hello again"
        assert len((await branches(client, cid))["items"]) == 3


async def test_branch_changes_while_a_reply_streams_are_409(start_server: Callable[..., Any]) -> None:
    server = await start_server(demo_tokens_per_second=20.0)
    async with server.client() as client:
        cid = await new_conversation(client)
        await send(client, cid, "short one")
        history = await turns(client, cid)
        async with streaming_reply(client, cid) as started:
            for path, body in [
                (f"/v1/turns/{started['assistant_turn_id']}/regenerate", {}),
                (f"/v1/turns/{history[0]['id']}/edit", {"content": "changed"}),
                (f"/v1/conversations/{cid}/branches/{cid}/activate", None),
            ]:
                r = await client.post(path, json=body)
                assert r.status_code == 409, (path, r.text)
                assert r.json()["error"]["code"] == "conversation_busy"
        assert len((await branches(client, cid))["items"]) == 1

        # on_busy=interrupt stops the running reply, then regenerates it.
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"}
        ) as r:
            started_event: SSEEvent = await anext(iter_sse(r))
            reply = await client.post(
                f"/v1/turns/{started_event.data['assistant_turn_id']}/regenerate",
                json={"on_busy": "interrupt", "stream": False},
            )
        assert reply.status_code == 200, reply.text
        assert reply.json()["user_turn"]["id"] == started_event.data["user_turn_id"]
        assert len((await branches(client, cid))["items"]) == 2


async def test_branches_of_other_tenants_and_other_conversations_are_404(server: LiveServer) -> None:
    async with server.client() as client, server.client(tenant="t2") as other:
        a = await new_conversation(client)
        b = await new_conversation(client)
        await send(client, a, "hi")
        assert (await other.get(f"/v1/conversations/{a}/branches")).status_code == 404
        assert (await other.post(f"/v1/conversations/{a}/branches/{a}/activate")).status_code == 404
        assert (await client.post(f"/v1/conversations/{a}/branches/{b}/activate")).status_code == 404
        assert (await client.get(f"/v1/conversations/{a}/turns", params={"branch": b})).status_code == 404
        last = (await turns(client, a))[1]["id"]
        assert (await other.post(f"/v1/turns/{last}/regenerate", json={})).status_code == 404
        assert (await other.post(f"/v1/turns/{last}/edit", json={"content": "x"})).status_code == 404
