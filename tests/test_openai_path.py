"""The chat path through the real OpenAI client against a fake OpenAI-compatible server."""

from __future__ import annotations

import json
from typing import Any

import httpx

from memory.events import EventName
from tests.conftest import LiveServer
from tests.fake_openai import FakeOpenAI, Reply, ToolCall
from tests.sse import SSEEvent, iter_sse

# These tests script the chat model's replies; the query rewrite would take one of them.
NO_RECALL = {"memory_scope": "none"}


async def test_stop_mid_tool_arguments_then_next_prompt_is_accepted(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    """The classic failure: half a JSON argument must never reach the model again."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="test", llm_model="fake-model"
    )
    fake_openai.script(
        Reply(
            text="Let me check. ",
            tool_calls=[ToolCall("current_time", {"timezone": "Europe/Paris", "note": "x" * 60})],
            chunk_delay=0.05,
        ),
        Reply(text="Fine, we can talk about something else."),
    )
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        events: list[SSEEvent] = []
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "time?", **NO_RECALL}
        ) as r:
            stream = iter_sse(r)
            async for event in stream:
                events.append(event)
                if (
                    event.event == EventName.TOOL_CALL_DELTA
                    and len(
                        "".join(e.data["arguments"] for e in events if e.event == EventName.TOOL_CALL_DELTA)
                    )
                    > 10
                ):
                    break
            stop = await client.post(f"/v1/turns/{events[0].data['reply_id']}/stop")
            events += [e async for e in stream]
        assert stop.json()["status"] == "interrupted_by_user"
        first_request = fake_openai.requests[0]
        assert await first_request.wait_disconnected(within=5), "stop must close the upstream stream"
        stored = stop.json()["turn"]
        assert stored["tool_calls"][0]["state"] == "streaming"
        assert stored["content"] == "Let me check. "

        r = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "never mind", "stream": False, **NO_RECALL}
        )
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "completed"
        second = fake_openai.requests[-1]
        assert second.status == 200  # the fake refuses invalid sequences with 400, as the real API does
        roles = [m["role"] for m in second.messages]
        assert "tool" not in roles and all("tool_calls" not in m for m in second.messages)
        assert {"role": "assistant", "content": "Let me check. "} in second.messages


async def test_provider_error_mid_stream_keeps_what_was_streamed(
    start_server: Any, fake_openai: FakeOpenAI
) -> None:
    server: LiveServer = await start_server(
        llm_provider="openai",
        llm_base_url=fake_openai.base_url,
        llm_api_key="test",
        llm_max_retries=2,
        llm_retry_base_seconds=0.01,
    )
    fake_openai.script(Reply(text="partial answer that breaks", drop_after_chunks=3))
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        async with client.stream(
            "POST", f"/v1/conversations/{cid}/messages", json={"content": "go", **NO_RECALL}
        ) as r:
            events = [e async for e in iter_sse(r)]
        assert events[-1].event == EventName.TURN_INTERRUPTED
        assert events[-1].data["status"] == "interrupted_by_error"
        text = "".join(e.data["text"] for e in events if e.event == EventName.MESSAGE_DELTA)
        turn = (await client.get(f"/v1/turns/{events[0].data['reply_id']}")).json()
        assert turn["status"] == "interrupted_by_error" and turn["content"] == text and text
        assert len(fake_openai.requests) == 1  # never retried after the first token

        fake_openai.script(Reply(fail_status=500), Reply(fail_status=500), Reply(fail_status=500))
        r = await client.post(
            f"/v1/conversations/{cid}/messages", json={"content": "again", "stream": False, **NO_RECALL}
        )
        assert r.json()["status"] == "failed"
        assert r.json()["turns"][-1]["error"]["code"] == "provider_error"


async def test_the_providers_own_error_text_reaches_operators_not_users(
    start_server: Any, fake_openai: FakeOpenAI, caplog: Any
) -> None:
    """Found: a refused operator key's text (masked key, organisation, project) reached users verbatim."""
    server: LiveServer = await start_server(
        llm_provider="openai", llm_base_url=fake_openai.base_url, llm_api_key="sk-proj-abc", llm_max_retries=0
    )
    secret = "Incorrect API key provided: sk-proj-****wxyz. Organization org-SECRET, project proj_SECRET."
    fake_openai.script(*[Reply(fail_status=401, fail_message=secret)] * 3)
    async with server.client() as client:
        cid = (await client.post("/v1/conversations", json={})).json()["id"]
        url = f"/v1/conversations/{cid}/messages"
        async with client.stream("POST", url, json={"content": "hi", **NO_RECALL}) as r:
            events = [e async for e in iter_sse(r)]
        stored = await client.post(url, json={"content": "again", "stream": False, **NO_RECALL})
        async with httpx.AsyncClient(base_url=f"{server.base_url}/openai/v1", headers=client.headers) as oa:
            body = {"model": server.services.provider.model, "messages": [{"role": "user", "content": "hi"}]}
            answered = await oa.post("/chat/completions", json=body)
    seen_by_users = json.dumps([e.data for e in events]) + stored.text + answered.text
    for word in ("sk-proj", "org-SECRET", "proj_SECRET", "Incorrect API key"):
        assert word not in seen_by_users, word
    assert events[-1].data["error"]["code"] == "provider_error"
    assert stored.json()["turns"][-1]["error"]["code"] == "provider_error"
    assert answered.status_code == 500 and answered.json()["error"]["type"] == "server_error"
    assert "org-SECRET" in caplog.text  # the operator still reads what the provider said
