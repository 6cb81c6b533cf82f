"""Tool calls that wait for a person: parking, approving, rejecting, stopping, timeouts, restarts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import func, select

from chat_api.app import create_app
from chat_api.replies.approve import ApprovalTimeouts
from chat_api.tools import Tool, ToolConfigError, ToolRegistry, configured_registry, default_registry
from memory.events import EventName
from memory.storage.db import Database
from memory.storage.models import ToolInvocation, Turn
from tests.conftest import TEST_SECRET, LiveServer, free_port, token_for
from tests.fake_openai import FakeOpenAI, ToolCall
from tests.fake_openai import Reply as FakeReply
from tests.procs import ServerProcess
from tests.sse import SSEEvent, collect
from tests.support import new_conversation, wait_until

ASK = '/tool transfer_funds {"amount": 5, "to": "bob"}'
ASKED_ARGUMENTS = '{"amount": 5, "to": "bob"}'


def transfer_tools(runs: list[dict[str, Any]], timeout: float | None = None) -> ToolRegistry:
    """The shipped tools plus a side-effecting one that needs approval; `runs` records each run."""

    async def transfer(args: dict[str, Any], _ctx: Any) -> Any:
        runs.append(args)
        return {"transferred": args.get("amount"), "to": args.get("to")}

    tools = default_registry()
    tools.register(
        Tool(
            "transfer_funds",
            "moves money",
            {"type": "object"},
            transfer,
            side_effects=True,
            requires_approval=True,
            approval_timeout_seconds=timeout,
        )
    )
    return tools


async def park(client: httpx.AsyncClient, cid: str, content: str = ASK) -> list[SSEEvent]:
    """Send a message whose reply calls the approval tool; the stream ends parked."""
    async with client.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": content}) as r:
        assert r.status_code == 200, await r.aread()
        events = await collect(r)
    assert events[-1].event == EventName.TURN_AWAITING_APPROVAL, [e.event for e in events]
    return events


def required(events: list[SSEEvent]) -> dict[str, Any]:
    [event] = [e for e in events if e.event == EventName.TOOL_CALL_APPROVAL_REQUIRED]
    return event.data  # type: ignore[no-any-return]


async def decide_streaming(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[SSEEvent]:
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        return await collect(r)


def approve_url(ask: dict[str, Any], verb: str = "approve") -> str:
    return f"/v1/turns/{ask['turn_id']}/tool_calls/{ask['call_id']}/{verb}"


async def test_a_call_needing_approval_parks_the_turn_and_runs_nothing(
    start_server: Any, db: Database
) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        events = await park(client, cid)
        ask = required(events)
        assert ask["name"] == "transfer_funds"
        assert ask["arguments"] == ASKED_ARGUMENTS  # complete, as the model sent it
        assert [e.id for e in events] == list(range(1, len(events) + 1))
        assert events[-1].data["call_ids"] == [ask["call_id"]]
        turn = (await client.get(f"/v1/turns/{ask['turn_id']}")).json()
        assert turn["status"] == "awaiting_approval"
        assert turn["tool_calls"][0]["state"] == "awaiting_approval"
        assert turn["tool_calls"][0]["approval"] == {"required": True, "expires_at": None}
        # The conversation is held: nothing is appended behind a reply that is not finished.
        busy = await client.post(f"/v1/conversations/{cid}/messages", json={"content": "hi", "stream": False})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"
        queued = await client.post(
            f"/v1/conversations/{cid}/messages",
            json={"content": "hi", "stream": False, "on_busy": "enqueue"},
        )
        assert queued.status_code == 409, queued.text
        assert queued.json()["error"]["details"]["awaiting_approval"] is True
        # The unanswered call never reaches a prompt.
        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
        assert not any(m.get("tool_calls") for m in context["messages"])
        # Non-streaming mode reports the parked reply too.
        other = await new_conversation(client)
        r = await client.post(f"/v1/conversations/{other}/messages", json={"content": ASK, "stream": False})
        assert r.status_code == 200 and r.json()["status"] == "awaiting_approval"
    assert runs == []
    async with db.transaction() as session:
        assert (await session.execute(select(func.count()).select_from(ToolInvocation))).scalar_one() == 0


async def test_approve_runs_the_tool_once_and_the_reply_streams_on(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        parked = await park(client, cid)
        ask = required(parked)
        resumed = await decide_streaming(client, approve_url(ask), {})
        names = [e.event for e in resumed]
        assert names[0] == EventName.TOOL_CALL_APPROVED and names[-1] == EventName.TURN_COMPLETED
        assert {
            EventName.TOOL_STARTED,
            EventName.TOOL_RESULT,
            EventName.STEP_STARTED,
            EventName.MESSAGE_DELTA,
        } <= set(names)
        # Event ids go on from the parked log with no gap.
        assert [e.id for e in resumed] == list(range(len(parked) + 1, len(parked) + len(resumed) + 1))
        result = next(e for e in resumed if e.event == EventName.TOOL_RESULT)
        assert json.loads(result.data["result"]) == {"transferred": 5, "to": "bob"}
        again = await client.post(approve_url(ask), json={})
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "tool_call_not_awaiting_approval"
        turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        assert [(t["role"], t["status"]) for t in turns] == [
            ("user", "completed"),
            ("assistant", "completed"),
            ("tool", "completed"),
            ("assistant", "completed"),
        ]
        call = turns[1]["tool_calls"][0]
        assert call["state"] == "succeeded" and call["approval"]["decision"] == "approved"
        assert call["approval"]["by"] == "user"
        assert "The tool answered" in turns[3]["content"]
        # The whole timeline, after the fact: parked, approved, and the rest, once each.
        async with client.stream("GET", f"/v1/turns/{ask['turn_id']}/events") as r:
            timeline = await collect(r)
        assert [(e.id, e.event) for e in timeline] == [(e.id, e.event) for e in parked + resumed]
        metrics = (await client.get("/metrics")).text
        assert 'chatmem_tool_approval_decisions_total{by="user",decision="approved"}' in metrics
        # The conversation is free again.
        thanks = {"content": "thanks", "stream": False}
        r = await client.post(f"/v1/conversations/{cid}/messages", json=thanks)
        assert r.status_code == 200 and r.json()["status"] == "completed"
    assert runs == [{"amount": 5, "to": "bob"}]


async def test_approve_with_edited_arguments_runs_those_and_keeps_what_the_model_sent(
    start_server: Any,
) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        edited = {"amount": 1, "to": "carol ✓"}
        r = await client.post(approve_url(ask), json={"arguments": edited, "stream": False})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "completed" and r.json()["resumed"] is True
        call = r.json()["turns"][0]["tool_calls"][0]
        assert json.loads(call["arguments"]) == edited
        assert call["received_arguments"] == ASKED_ARGUMENTS
        assert call["approval"]["arguments_edited"] is True
        # What the model sees again is what ran.
        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
        [sent] = [m for m in context["messages"] if m.get("tool_calls")]
        assert json.loads(sent["tool_calls"][0]["function"]["arguments"]) == edited
    assert runs == [edited]


async def test_reject_gives_the_model_the_reason_and_runs_nothing(start_server: Any, db: Database) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        r = await client.post(approve_url(ask, "reject"), json={"reason": "too much", "stream": False})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "completed"
        assistant, tool, final = body["turns"]
        assert assistant["tool_calls"][0]["state"] == "rejected"
        assert assistant["tool_calls"][0]["approval"]["reason"] == "too much"
        assert json.loads(tool["content"]) == {
            "error": "the user did not approve this tool call",
            "reason": "too much",
        }
        assert "did not approve" in final["content"]
        assert (await client.post(approve_url(ask), json={})).status_code == 409
    assert runs == []
    async with db.transaction() as session:
        assert (await session.execute(select(func.count()).select_from(ToolInvocation))).scalar_one() == 0


async def test_decisions_answer_404_for_others_and_409_for_calls_not_waiting(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        for tenant, user in (("t2", "u1"), ("t1", "u2")):
            async with server.client(tenant, user) as stranger:
                r = await stranger.post(approve_url(ask), json={})
                assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
                assert (await stranger.post(approve_url(ask, "reject"), json={})).status_code == 404
        unknown_call = f"/v1/turns/{ask['turn_id']}/tool_calls/call_nope/approve"
        assert (await client.post(unknown_call, json={})).status_code == 404
        unknown_turn = "/v1/turns/00000000-0000-0000-0000-000000000000/tool_calls/x/approve"
        assert (await client.post(unknown_turn, json={})).status_code == 404
        for bad in ({"arguments": [1, 2]}, {"arguments": "{}"}, {"surprise": 1}):
            r = await client.post(approve_url(ask), json=bad)
            assert r.status_code == 422, (bad, r.text)
        r = await client.post(approve_url(ask, "reject"), json={"reason": "x" * 2001})
        assert r.status_code == 422
        # Still waiting after all that.
        assert (await client.get(f"/v1/turns/{ask['turn_id']}")).json()["status"] == "awaiting_approval"
        # A call that never needed approval is not waiting.
        plain = await new_conversation(client)
        r = await client.post(
            f"/v1/conversations/{plain}/messages",
            json={"content": '/tool current_time {"timezone": "UTC"}', "stream": False},
        )
        first = r.json()["turns"][0]
        call_id = first["tool_calls"][0]["id"]
        r = await client.post(f"/v1/turns/{first['id']}/tool_calls/{call_id}/approve", json={})
        assert r.status_code == 409
    assert runs == []


async def test_stopping_a_parked_turn_ends_it_as_interrupted_by_user(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        stop = await client.post(f"/v1/turns/{ask['turn_id']}/stop")
        assert stop.status_code == 200, stop.text
        assert stop.json()["status"] == "interrupted_by_user"
        turn = stop.json()["turn"]
        assert turn["interrupt_reason"] == "user"
        assert turn["tool_calls"][0]["state"] == "cancelled"
        assert turn["tool_calls"][0]["side_effect_may_have_happened"] is False
        assert (await client.post(approve_url(ask), json={})).status_code == 409
        assert (await client.post(f"/v1/turns/{ask['turn_id']}/stop")).json()["status"] == (
            "interrupted_by_user"
        )
        async with client.stream("GET", f"/v1/turns/{ask['turn_id']}/events") as r:
            timeline = await collect(r)
        assert timeline[-1].event == EventName.TURN_INTERRUPTED
        never_mind = {"content": "never mind", "stream": False}
        r = await client.post(f"/v1/conversations/{cid}/messages", json=never_mind)
        assert r.status_code == 200 and r.json()["status"] == "completed"
        context = (await client.get(f"/v1/conversations/{cid}/context")).json()
        assert not any(m.get("tool_calls") for m in context["messages"])
        assert context["dropped"].get("tool_call_of_interrupted_turn") == 1
    assert runs == []


async def test_a_new_message_with_interrupt_ends_a_parked_reply(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        r = await client.post(
            f"/v1/conversations/{cid}/messages",
            json={"content": "forget it", "stream": False, "on_busy": "interrupt"},
        )
        assert r.status_code == 200 and r.json()["status"] == "completed"
        parked = (await client.get(f"/v1/turns/{ask['turn_id']}")).json()
        assert parked["status"] == "interrupted_by_user" and parked["interrupt_reason"] == "new_message"
    assert runs == []


async def test_a_call_nobody_decides_in_time_counts_as_rejected(start_server: Any) -> None:
    runs: list[dict[str, Any]] = []
    tools = transfer_tools(runs, timeout=0.3)
    server: LiveServer = await start_server(tools=tools, approval_sweep_seconds=0.1)
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        assert ask["expires_at"] is not None

        async def finished() -> list[dict[str, Any]] | None:
            items = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
            return items if items[-1]["status"] == "completed" and len(items) == 4 else None

        turns = await wait_until(finished)
        assert turns[1]["tool_calls"][0]["state"] == "rejected"
        assert turns[1]["tool_calls"][0]["approval"]["by"] == "timeout"
        assert json.loads(turns[2]["content"])["error"] == "nobody approved this tool call in time"
        async with client.stream("GET", f"/v1/turns/{ask['turn_id']}/events") as r:
            timeline = await collect(r)
        [rejected] = [e for e in timeline if e.event == EventName.TOOL_CALL_REJECTED]
        assert rejected.data["by"] == "timeout"
        assert (await client.post(approve_url(ask), json={})).status_code == 409
    assert runs == []


async def test_approval_on_another_replica_and_two_racing_approvals_run_the_tool_once(
    start_server: Any,
) -> None:
    runs: list[dict[str, Any]] = []
    tools = transfer_tools(runs)
    a: LiveServer = await start_server(tools=tools)
    b: LiveServer = await start_server(tools=tools)
    async with a.client() as on_a, b.client() as on_b:
        cid = await new_conversation(on_a)
        ask = required(await park(on_a, cid))
        first, second = await asyncio.gather(
            on_a.post(approve_url(ask), json={"stream": False}),
            on_b.post(approve_url(ask), json={"stream": False}),
        )
        codes = sorted([first.status_code, second.status_code])
        assert codes == [200, 409], (first.text, second.text)
        winner = first if first.status_code == 200 else second
        assert winner.json()["status"] == "completed"
        # Park again and approve on the replica that did not start the reply.
        ask = required(await park(on_a, cid))
        resumed = await decide_streaming(on_b, approve_url(ask), {})
        assert resumed[-1].event == EventName.TURN_COMPLETED
    assert len(runs) == 2


async def test_an_approval_survives_every_process_being_killed(
    pg_url: str, db: Database, tmp_path: Path
) -> None:
    """Park a turn, SIGKILL every server, start new ones, approve: the reply completes, the tool ran once."""
    log = tmp_path / "runs.jsonl"
    env = {
        "tool_modules": '["tests.approval_tools"]',
        "tools_requiring_approval": '["transfer_funds"]',
        "approval_tool_log": str(log),
        "demo_tokens_per_second": 200,
    }
    first, second = ServerProcess(pg_url, **env), ServerProcess(pg_url, **env)
    try:
        await asyncio.gather(first.start(), second.start())
        async with first.client() as client:
            cid = await new_conversation(client)
            ask = required(await park(client, cid))
    finally:
        first.kill()
        second.kill()
    assert not log.exists()
    fresh = ServerProcess(pg_url, **env)
    try:
        await fresh.start()
        async with fresh.client() as client:
            resumed = await decide_streaming(client, approve_url(ask), {})
            assert resumed[-1].event == EventName.TURN_COMPLETED, [e.event for e in resumed]
            result = next(e for e in resumed if e.event == EventName.TOOL_RESULT)
            assert json.loads(result.data["result"]) == {"transferred": 5, "to": "bob"}
            assert (await client.post(approve_url(ask))).status_code == 409  # no body at all
            turns = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"]
            assert [t["status"] for t in turns] == ["completed"] * 4
    finally:
        fresh.terminate()
    runs = log.read_text().splitlines()
    assert len(runs) == 1 and json.loads(runs[0])["args"] == {"amount": 5, "to": "bob"}


async def test_several_calls_wait_for_every_decision_and_reach_the_model_in_order(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """Two calls need approval, one does not: nothing runs until both are decided; the prompt stays valid."""
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(
        tools=transfer_tools(runs),
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
    )
    fake_openai.script(
        FakeReply(
            text="Two transfers. ",
            tool_calls=[
                ToolCall("transfer_funds", {"amount": 1, "to": "ann"}, id="call_a"),
                ToolCall("transfer_funds", {"amount": 2, "to": "ben"}, id="call_b"),
                ToolCall("current_time", {"timezone": "UTC"}, id="call_c"),
            ],
        ),
        FakeReply(text="One done, one refused."),
    )
    async with server.client() as client:
        cid = await new_conversation(client)
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "pay", "memory_scope": "none"}
        ) as r:
            parked = await collect(r)
        asks = [e.data for e in parked if e.event == EventName.TOOL_CALL_APPROVAL_REQUIRED]
        assert [a["call_id"] for a in asks] == ["call_a", "call_b"]
        assert parked[-1].event == EventName.TURN_AWAITING_APPROVAL
        assert not any(e.event == EventName.TOOL_STARTED for e in parked)
        first = await client.post(approve_url(asks[0]), json={"stream": False})
        assert first.status_code == 200, first.text
        assert first.json()["status"] == "awaiting_approval" and first.json()["resumed"] is False
        assert runs == []
        states = [c["state"] for c in first.json()["turns"][0]["tool_calls"]]
        assert states == ["ready", "awaiting_approval", "ready"]
        last = await client.post(approve_url(asks[1], "reject"), json={"reason": "no", "stream": False})
        assert last.status_code == 200, last.text
        assert last.json()["status"] == "completed" and last.json()["resumed"] is True
        states = [c["state"] for c in last.json()["turns"][0]["tool_calls"]]
        assert states == ["succeeded", "rejected", "succeeded"]
    assert runs == [{"amount": 1, "to": "ann"}]
    follow_up = fake_openai.requests[-1]
    assert follow_up.status == 200  # the fake refuses an invalid message list, as the real API does
    roles = [m["role"] for m in follow_up.messages]
    assert roles[-4:] == ["assistant", "tool", "tool", "tool"]
    assert [m["tool_call_id"] for m in follow_up.messages[-3:]] == ["call_a", "call_b", "call_c"]


def test_tool_settings_are_applied_and_bad_ones_stop_the_start(make_settings: Any) -> None:
    registry = configured_registry(
        make_settings(
            tool_modules=["tests.approval_tools"],
            tools_requiring_approval=["transfer_funds"],
            tool_approval_timeouts={"transfer_funds": 60},
        )
    )
    tool = registry.get("transfer_funds")
    assert tool is not None and tool.requires_approval and tool.approval_timeout_seconds == 60
    current_time = registry.get("current_time")
    assert current_time is not None and not current_time.requires_approval
    for bad, message in (
        ({"tools_requiring_approval": ["nope"]}, "unknown tools: nope"),
        ({"tool_approval_timeouts": {"nope": 5}}, "unknown tools: nope"),
        ({"tool_modules": ["tests.no_such_module"]}, "cannot be imported"),
        ({"tool_modules": ["tests.sse"]}, "no register"),
    ):
        with pytest.raises(ToolConfigError, match=message):
            create_app(make_settings(**bad))


def test_serve_reports_a_bad_tool_setting_in_one_line(pg_url: str) -> None:
    env = {**os.environ, "DATABASE_URL": pg_url, "JWT_SECRET": TEST_SECRET}
    env["TOOLS_REQUIRING_APPROVAL"] = '["nope"]'
    done = subprocess.run(
        [sys.executable, "-m", "chat_api.cli", "serve", "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "chatmem: approval settings name unknown tools: nope"


async def test_a_regenerated_reply_resumes_with_the_user_message_of_its_own_branch(start_server: Any) -> None:
    """After an edit put a newer user turn on another branch, the resume still answers its own message."""
    runs: list[dict[str, Any]] = []
    server: LiveServer = await start_server(tools=transfer_tools(runs))
    async with server.client() as client:
        cid = await new_conversation(client)
        ask = required(await park(client, cid))
        await client.post(f"/v1/turns/{ask['turn_id']}/stop")
        user_turn = (await client.get(f"/v1/conversations/{cid}/turns")).json()["items"][0]
        edited = await client.post(
            f"/v1/turns/{user_turn['id']}/edit", json={"content": "something else", "stream": False}
        )
        assert edited.status_code == 200, edited.text
        r = await client.post(f"/v1/conversations/{cid}/branches/{cid}/activate")
        assert r.status_code == 200, r.text
        async with client.stream("POST", f"/v1/turns/{ask['turn_id']}/regenerate", json={}) as r:
            assert r.status_code == 200, await r.aread()
            parked = await collect(r)
        assert parked[-1].event == EventName.TURN_AWAITING_APPROVAL
        resumed = await decide_streaming(client, approve_url(required(parked)), {})
        [recalled] = [e for e in resumed if e.event == EventName.MEMORY_RETRIEVED]
        assert recalled.data["query"] == ASK
        assert resumed[-1].event == EventName.TURN_COMPLETED
    assert len(runs) == 1


async def test_a_timeout_does_not_resume_a_reply_in_a_deleted_conversation(start_server: Any) -> None:
    """A rejection resumes the reply; in a deleted conversation nothing may run any more."""
    runs: list[dict[str, Any]] = []
    # The server's own sweep runs once at start, then not for an hour: the test sweeps itself.
    server: LiveServer = await start_server(
        tools=transfer_tools(runs, timeout=0.01), approval_sweep_seconds=3600
    )
    async with server.client() as client:
        deleted, kept = await new_conversation(client), await new_conversation(client)
        gone = required(await park(client, deleted))
        waiting = required(await park(client, kept))
        assert (await client.delete(f"/v1/conversations/{deleted}")).status_code == 204

        async def both_expired() -> bool:
            async with server.services.db.session() as session:
                late = await session.execute(
                    select(func.count()).where(Turn.approval_expires_at <= func.now())
                )
                return late.scalar_one() == 2

        await wait_until(both_expired)
        assert await ApprovalTimeouts(server.services, interval_seconds=3600).sweep_once() == 1
        resumed = (await client.get(f"/v1/turns/{waiting['turn_id']}")).json()
        assert resumed["tool_calls"][0]["state"] == "rejected"
    async with server.services.db.session() as session:
        parked = await session.get(Turn, uuid.UUID(gone["turn_id"]))
        assert parked is not None and parked.status == "awaiting_approval"
    assert runs == []


async def test_a_reply_resumed_after_an_approval_keeps_the_clients_instructions_tools_and_options(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """The app's instructions, its own tools and its sampling hold for the whole reply, not its first step."""
    server: LiveServer = await start_server(
        tools=transfer_tools([]),
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_model="fake-model",
    )
    fake_openai.script(
        FakeReply(tool_calls=[ToolCall("transfer_funds", {"amount": 5, "to": "bob"}, id="call_t")]),
        FakeReply(text="Aye, sent."),
    )
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    raw = await client.responses.with_raw_response.create(
        model="fake-model",
        instructions="Answer like a ship's captain.",
        input="send bob 5",
        tools=[weather],  # type: ignore[list-item]
        temperature=0.3,
        max_output_tokens=64,
    )
    response = raw.parse()
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "awaiting_approval"
    cid = raw.headers["x-chatmem-conversation-id"]
    async with server.client() as api:
        turns = (await api.get(f"/v1/conversations/{cid}/turns")).json()["items"]
        [parked] = [t for t in turns if t["status"] == "awaiting_approval"]
        url = f"/v1/turns/{parked['id']}/tool_calls/call_t/approve"
        decided = await api.post(url, json={"stream": False})
        assert decided.status_code == 200, decided.text
        assert decided.json()["status"] == "completed"
    first, resumed = fake_openai.requests
    for sent in (first, resumed):
        assert sent.messages[0]["content"].endswith("Answer like a ship's captain.")
        assert "get_weather" in [tool["function"]["name"] for tool in sent.tools or []]
        assert (sent.body["temperature"], sent.body["max_tokens"]) == (0.3, 64)


async def test_on_disconnect_stop_makes_a_hang_up_a_stop_in_an_ai_sdk_reply_resumed_after_an_approval(
    start_server: Any,
) -> None:
    """Found: the approval's request ignored its `on_disconnect: stop`: hung up on, the reply went on."""
    server: LiveServer = await start_server(
        tool_modules=["tests.approval_tools"],
        tools_requiring_approval=["transfer_funds"],
        demo_tokens_per_second=10,
    )
    chat_id = str(uuid.uuid4())
    ask = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": ASK}]}
    async with server.client() as api:
        first = await api.post(
            "/v1/ai-sdk/chat", json={"id": chat_id, "trigger": "submit-message", "messages": [ask]}
        )
        assert first.status_code == 200, first.text
        messages = (await api.get(f"/v1/ai-sdk/chat/{chat_id}/messages")).json()
        [part] = [p for p in messages[-1]["parts"] if p.get("state") == "approval-requested"]
        part.update(state="approval-responded", approval={**part["approval"], "approved": True})
        body = {"id": chat_id, "trigger": "submit-message", "messages": messages, "on_disconnect": "stop"}
        async with api.stream("POST", "/v1/ai-sdk/chat", json=body) as response:
            async for line in response.aiter_lines():
                if '"text-delta"' in line:
                    break  # the client goes away

        async def ended() -> str | None:
            status = (await api.get(f"/v1/ai-sdk/chat/{chat_id}/messages")).json()[-1]["metadata"]["status"]
            return None if status == "streaming" else str(status)

        assert await wait_until(ended, timeout=10) == "interrupted_by_user"
