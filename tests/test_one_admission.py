"""One admission for every door that costs work: replies, imports and MCP under the same limits.

Found (each door had added the limits it thought of): the OpenAI adapter imported a
history it could not match with none of the import limits (25,602 turns from one
request, and 1,002 more from a user whose `/import` was already refused); AI SDK posts
that hung up, and non-streamed OpenAI requests, ran past the running-reply cap; `/mcp`
had no request rate, no stream cap and no failed-auth throttle, and refused API keys.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import httpx2
import openai
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from openai import AsyncOpenAI
from sqlalchemy import or_, select

from memory.record.conversations import Owner
from memory.storage.models import Turn
from tests.conftest import LiveServer, token_for
from tests.support import new_conversation, wait_until

SLOW = {"demo_tokens_per_second": 20}
MODEL = "chatmem-demo"
BAD_TOKEN = {"Authorization": "Bearer not-a-token"}


def openai_client(server: LiveServer, key: str | None = None) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"{server.base_url}/openai/v1", api_key=key or token_for(), max_retries=0, timeout=30
    )


def history(pairs: int) -> list[dict[str, str]]:
    """A history of `pairs` questions and answers chatmem has never seen, then a new question."""
    messages: list[dict[str, str]] = []
    for i in range(pairs):
        messages += [
            {"role": "user", "content": f"unseen question {i}"},
            {"role": "assistant", "content": f"unseen answer {i}"},
        ]
    return [*messages, {"role": "user", "content": "and now?"}]


async def stored_conversations(server: LiveServer, user: str = "u1") -> list[dict[str, Any]]:
    async with server.client(user=user) as api:
        return list((await api.get("/v1/conversations")).json()["items"])


def running(server: LiveServer) -> int:
    return sum(1 for reply in server.services.registry.all() if not reply.finished.is_set())


# --- import admission ------------------------------------------------------------------


async def test_openai_unmatched_history_is_held_to_the_per_request_turn_limit(start_server: Any) -> None:
    server: LiveServer = await start_server(import_max_turns=6)
    async with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=history(4))  # 8 turns to import
        assert refused.value.body["code"] == "invalid_input"  # type: ignore[index]
        assert refused.value.body["param"] == "messages"  # type: ignore[index]
        assert await stored_conversations(server) == []  # nothing stored, not even a conversation
        answer = await client.chat.completions.create(model=MODEL, messages=history(3))  # 6: fits
        assert answer.choices[0].message.content


async def test_responses_history_over_the_turn_limit_was_refused_naming_turns_not_input(
    start_server: Any,
) -> None:
    """The Responses API has no `turns`: its history comes in `input`, and the 400 names that."""
    server: LiveServer = await start_server(import_max_turns=6)
    async with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input=history(4))  # type: ignore[arg-type]
        assert refused.value.body["code"] == "invalid_input"  # type: ignore[index]
        assert refused.value.body["param"] == "input"  # type: ignore[index]
        assert await stored_conversations(server) == []
        # Continuing a response, the history it imports is refused the same way.
        first = await client.responses.create(model=MODEL, input="hello")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=MODEL,
                input=history(4),  # type: ignore[arg-type]
                previous_response_id=first.id,
            )
        assert refused.value.body["param"] == "input"  # type: ignore[index]


async def test_openai_unmatched_history_is_held_to_the_per_message_size_limit(start_server: Any) -> None:
    server: LiveServer = await start_server(max_message_chars=100)
    messages = history(1)
    messages[1]["content"] = "x" * 101  # the assistant's answer of the history
    async with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=messages)
        assert refused.value.status_code == 400
        assert await stored_conversations(server) == []


async def test_a_history_message_over_the_size_limit_was_named_by_its_index_among_the_imported_turns(
    start_server: Any,
) -> None:
    """`turns[1].content` (and param `content`) for the client's `messages[2]`: the system message
    the import never sees, and the new question, shifted the index the client had to look for."""
    server: LiveServer = await start_server(max_message_chars=100)
    too_long = "x" * 101
    async with openai_client(server) as client:
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "unseen question"},
            {"role": "assistant", "content": too_long},
            {"role": "user", "content": "and now?"},
        ]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=MODEL, messages=messages, stream=stream)  # type: ignore[arg-type]
            body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
            assert body["param"] == "messages[2].content", body
            assert body["message"].startswith("messages[2].content: ") and "100 characters" in body["message"]
        items = [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "unseen question"},
            {"role": "assistant", "content": too_long},
            {"role": "user", "content": "and now?"},
        ]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input=items)  # type: ignore[arg-type]
        assert refused.value.body["param"] == "input[2].content", refused.value.body  # type: ignore[index]
        assert await stored_conversations(server) == []
        # Continuing a response, the history it imports is named the same way.
        first = await client.responses.create(model=MODEL, input="hello")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, input=items[1:], previous_response_id=first.id)  # type: ignore[arg-type]
        assert refused.value.body["param"] == "input[1].content", refused.value.body  # type: ignore[index]


async def test_a_new_message_over_the_size_limit_was_named_messages_whatever_the_door(
    start_server: Any,
) -> None:
    """param `messages` on the Responses API, which has no such field, and on chat completions
    without the index of the message at fault."""
    server: LiveServer = await start_server(max_message_chars=100)
    too_long = "x" * 101
    async with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": too_long}],
            )
        assert refused.value.body["param"] == "messages[1].content", refused.value.body  # type: ignore[index]
        for sent, param in (
            (too_long, "input"),
            ([{"role": "user", "content": too_long}], "input[0].content"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, input=sent)  # type: ignore[arg-type]
            assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
            assert "100 characters" in refused.value.body["message"]  # type: ignore[index]
    assert await stored_conversations(server) == []


WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


async def test_a_client_tool_result_longer_than_a_message_was_stored(start_server: Any) -> None:
    """AG-UI held a tool result to MAX_MESSAGE_CHARS; the OpenAI doors stored any length as a tool
    turn and showed it to the model with every later step."""
    server: LiveServer = await start_server(max_message_chars=100)
    question = {"role": "user", "content": '/tool get_weather {"city": "Paris"}'}
    async with openai_client(server) as client:
        asked = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[question],  # type: ignore[list-item]
            tools=[{"type": "function", "function": WEATHER}],  # type: ignore[list-item]
        )
        calls = asked.parse().choices[0].message.tool_calls or []
        call = {"id": calls[0].id, "type": "function", "function": calls[0].function.model_dump()}  # type: ignore[union-attr]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL,
                messages=[
                    question,
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": "y" * 101},
                ],  # type: ignore[list-item]
                tools=[{"type": "function", "function": WEATHER}],  # type: ignore[list-item]
            )
        assert refused.value.body["param"] == "messages[2].content", refused.value.body  # type: ignore[index]

        response = await client.responses.create(
            model=MODEL,
            input=question["content"],
            tools=[{"type": "function", **WEATHER}],  # type: ignore[list-item]
        )
        function_call = next(item for item in response.output if item.type == "function_call")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model=MODEL,
                previous_response_id=response.id,
                input=[
                    {"type": "function_call_output", "call_id": function_call.call_id, "output": "y" * 101}
                ],  # type: ignore[union-attr]
                tools=[{"type": "function", **WEATHER}],  # type: ignore[list-item]
            )
        assert refused.value.body["param"] == "input[0].output", refused.value.body  # type: ignore[index]
    async with server.client() as api:
        conversations = await stored_conversations(server)
        assert len(conversations) == 2  # each door's first exchange
        for conversation in conversations:
            stored = (await api.get(f"/v1/conversations/{conversation['id']}/turns")).json()["items"]
            assert "tool" not in [turn["role"] for turn in stored], stored


async def test_the_output_token_bound_was_a_constant_not_a_setting(start_server: Any) -> None:
    """128,000 was written in the code: a deployment whose model writes fewer could not say so."""
    server: LiveServer = await start_server(max_output_tokens=100)
    hi = [{"role": "user", "content": "hi"}]
    async with openai_client(server) as client:
        for stream in (False, True):
            for param in ("max_tokens", "max_completion_tokens"):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.chat.completions.create(
                        model=MODEL,
                        messages=hi,  # type: ignore[arg-type]
                        stream=stream,
                        **{param: 101},  # type: ignore[arg-type]
                    )
                assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]
                assert "at most 100" in refused.value.body["message"]  # type: ignore[index]
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model=MODEL, input="hi", max_output_tokens=101, stream=stream)
            assert refused.value.body["param"] == "max_output_tokens", refused.value.body  # type: ignore[index]
        assert await stored_conversations(server) == []
        answered = await client.chat.completions.create(model=MODEL, messages=hi, max_tokens=100)  # type: ignore[arg-type]
        assert answered.choices[0].message.content
        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=100)
        assert response.max_output_tokens == 100


async def test_openai_history_import_shares_the_hourly_import_quota(start_server: Any) -> None:
    server: LiveServer = await start_server(import_turns_per_hour=10)
    async with server.client() as api:
        cid = await new_conversation(api)
        turns = [{"role": "user", "content": f"t{i}"} for i in range(8)]
        assert (await api.post(f"/v1/conversations/{cid}/import", json={"turns": turns})).status_code == 201
    async with openai_client(server) as client:
        # 4 unseen turns, with 2 left of the hour's 10: OpenAI's 429, with Retry-After.
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model=MODEL, messages=history(2))
        assert refused.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert len(await stored_conversations(server)) == 1  # only the import's
        # A history that fits what is left is imported (and charged).
        first = await client.chat.completions.with_raw_response.create(model=MODEL, messages=history(1))
        cid2 = first.headers["x-chatmem-conversation-id"]
        # Continuing it imports nothing, so the spent quota does not hold the chat up.
        answer = first.parse().choices[0].message.content or ""
        again = [*history(1), {"role": "assistant", "content": answer}, {"role": "user", "content": "more?"}]
        second = await client.chat.completions.with_raw_response.create(model=MODEL, messages=again)
        assert second.headers["x-chatmem-conversation-id"] == cid2
    async with server.client() as api:
        refused_import = await api.post(f"/v1/conversations/{cid}/import", json={"turns": turns[:1]})
        assert refused_import.status_code == 429, refused_import.text


# --- reply admission -------------------------------------------------------------------


async def test_ai_sdk_replies_whose_clients_hung_up_are_held_to_the_running_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_running_replies_per_user=2, **SLOW)

    def chat(n: int) -> dict[str, Any]:
        message = {"id": f"m{n}", "role": "user", "parts": [{"type": "text", "text": "/long go"}]}
        return {"id": f"chat-{n}", "trigger": "submit-message", "messages": [message]}

    async with server.client() as api:
        for n in range(2):
            async with api.stream("POST", "/v1/ai-sdk/chat", json=chat(n)) as r:
                assert r.status_code == 200
                await anext(r.aiter_bytes())  # the stream started; hang up
        await wait_until(lambda: running(server), what="the replies to run")
        refused = await api.post("/v1/ai-sdk/chat", json=chat(3))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert (await api.get("/v1/ai-sdk/chat/chat-3/messages")).json() == []
        assert running(server) == 2


def ag_ui_run(n: int, text: str = "/long go") -> dict[str, Any]:
    message = {"id": f"m{n}", "role": "user", "content": text}
    return {
        "threadId": f"thread-{n}",
        "runId": f"run-{n}",
        "messages": [message],
        "tools": [],
        "context": [],
        "state": {},
        "forwardedProps": {},
    }


async def test_ag_ui_runs_whose_clients_hung_up_are_held_to_the_running_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_running_replies_per_user=2, **SLOW)
    async with server.client() as api:
        for n in range(2):
            async with api.stream("POST", "/v1/ag-ui", json=ag_ui_run(n)) as r:
                assert r.status_code == 200
                await anext(r.aiter_bytes())  # the stream started; hang up
        await wait_until(lambda: running(server) == 2, what="the replies to run")
        refused = await api.post("/v1/ag-ui", json=ag_ui_run(3))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "rate_limited"
        # Nothing was made for the refused run, not even its thread.
        assert (await api.post("/v1/ag-ui/thread-3/connect", json={})).status_code == 404
        assert running(server) == 2


async def test_ag_ui_connect_is_held_to_the_stream_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_streams_per_user=1, **SLOW)
    async with server.client() as api:
        async with api.stream("POST", "/v1/ag-ui", json=ag_ui_run(0)) as r:
            assert r.status_code == 200
            frames = r.aiter_bytes()
            await anext(frames)  # the run streams (and its stream is held open: `frames` is kept)
            refused = await api.post("/v1/ag-ui/thread-0/connect", json={"runId": "again"})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "rate_limited"
        # The run's stream gave its slot back when it closed: connect is admitted now.
        await wait_until(lambda: server.services.admission.streams.open_count(Owner("t1", "u1")) == 0)
        async with api.stream("POST", "/v1/ag-ui/thread-0/connect", json={"runId": "again"}) as joined:
            assert joined.status_code == 200
            assert b"RUN_STARTED" in await anext(joined.aiter_bytes())


async def test_non_streamed_openai_requests_are_held_to_the_running_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_running_replies_per_user=2, **SLOW)
    async with openai_client(server) as client:

        async def ask(n: int) -> Any:
            messages = [{"role": "user", "content": f"/long question {n}"}]
            return await client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]

        asking = [asyncio.create_task(ask(n)) for n in range(2)]
        await wait_until(lambda: running(server) == 2, what="two replies to run")
        with pytest.raises(openai.RateLimitError):
            await ask(3)
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)


async def test_reply_starts_racing_each_other_never_pass_the_running_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_running_replies_per_user=2, **SLOW)
    async with server.client() as api:
        cids = [await new_conversation(api) for _ in range(6)]

        async def start(cid: str) -> int:
            body = {"content": "/long go", "stream": False}
            r = await api.post(f"/v1/conversations/{cid}/messages", json=body, timeout=60)
            return r.status_code

        tasks = [asyncio.create_task(start(cid)) for cid in cids]
        await wait_until(lambda: sum(t.done() for t in tasks) >= 4, what="the refusals")
        assert [t.result() for t in tasks if t.done()] == [429] * 4
        await wait_until(lambda: running(server) == 2, what="the two admitted replies to run")
        for reply in server.services.registry.all():
            reply.request_stop("user")
        assert sorted(await asyncio.gather(*tasks)) == [200, 200, 429, 429, 429, 429]


# --- MCP -------------------------------------------------------------------------------


async def mcp_session(server: LiveServer, headers: dict[str, str]) -> Any:
    http = httpx2.AsyncClient(headers=headers, timeout=30)
    return http, Client(streamable_http_client(f"{server.base_url}/mcp", http_client=http))


async def test_mcp_accepts_an_api_key_like_every_other_door(server: LiveServer) -> None:
    async with server.client() as api:
        key = (await api.post("/v1/keys", json={"name": "mcp"})).json()["key"]
    http, client = await mcp_session(server, {"Authorization": f"Bearer {key}"})
    async with http, client:
        item = (await client.call_tool("remember", {"fact": "I keep bees."})).structured_content
        assert item is not None and item["text"] == "I keep bees."


async def test_mcp_calls_are_held_to_the_request_rate(start_server: Any) -> None:
    server: LiveServer = await start_server(rate_limit_per_minute=8)
    http, client = await mcp_session(server, {"Authorization": f"Bearer {token_for()}"})
    statuses: list[int] = []

    async def seen(response: httpx2.Response) -> None:
        statuses.append(response.status_code)

    async with http:
        http.event_hooks["response"].append(seen)
        with pytest.raises(Exception):  # noqa: B017  the SDK raises on the refused request
            async with client:
                for _ in range(20):
                    await client.call_tool("search_memory", {"query": "bees"})
    assert 429 in statuses and statuses.index(429) <= 8, statuses


async def test_mcp_streams_are_held_to_the_stream_cap(start_server: Any) -> None:
    server: LiveServer = await start_server(max_streams_per_user=2)
    headers = {
        "Authorization": f"Bearer {token_for()}",
        "Accept": "text/event-stream",
        "MCP-Protocol-Version": "2025-06-18",
    }
    async with httpx.AsyncClient(base_url=server.base_url, headers=headers, timeout=30) as http:
        async with http.stream("GET", "/mcp") as first, http.stream("GET", "/mcp") as second:
            assert (first.status_code, second.status_code) == (200, 200)
            async with asyncio.timeout(10), http.stream("GET", "/mcp") as third:
                assert third.status_code == 429
                assert json.loads(await third.aread())["error"]["code"] == "rate_limited"
        # Closed streams give their slots back.
        await wait_until(lambda: server.services.admission.streams.open_count(Owner("t1", "u1")) == 0)
        async with http.stream("GET", "/mcp") as again:
            assert again.status_code == 200


async def test_mcp_refuses_an_address_the_failed_auth_throttle_holds(start_server: Any) -> None:
    server: LiveServer = await start_server(auth_failures_per_minute=3)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as http:
        for _ in range(3):
            assert (await http.get("/v1/conversations", headers=BAD_TOKEN)).status_code == 401
        good = {"Authorization": f"Bearer {token_for()}", "Accept": "application/json, text/event-stream"}
        held = await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=good)
        assert held.status_code == 429, held.text
    # And guesses at /mcp count against the same allowance.
    other: LiveServer = await start_server(auth_failures_per_minute=3)
    async with httpx.AsyncClient(base_url=other.base_url, timeout=30) as http:
        for _ in range(3):
            assert (await http.post("/mcp", json={}, headers=BAD_TOKEN)).status_code == 401
        assert (await http.get("/v1/conversations", headers=BAD_TOKEN)).status_code == 429


# --- a stop is never refused by the request rate ----------------------------------------


async def spend_the_request_rate(api: httpx.AsyncClient) -> None:
    """Cheap requests until the user's RATE_LIMIT_PER_MINUTE answers 429."""
    for _ in range(50):
        if (await api.get("/v1/conversations")).status_code == 429:
            return
    raise AssertionError("the request rate never ran out")


async def stored_status(server: LiveServer, reply_id: uuid.UUID) -> str:
    """The status of the reply's last turn, read from the database (the API would answer 429)."""
    async with server.services.db.session() as session:
        rows = await session.execute(
            select(Turn.status)
            .where(or_(Turn.id == reply_id, Turn.reply_id == reply_id))
            .order_by(Turn.seq.desc())
            .limit(1)
        )
        return str(rows.scalar_one())


@pytest.mark.parametrize("door", ["chatmem", "ai-sdk", "ag-ui"])
async def test_a_user_at_the_request_rate_limit_can_still_stop_a_streaming_reply(
    start_server: Any, door: str
) -> None:
    server: LiveServer = await start_server(rate_limit_per_minute=5, **SLOW)
    async with server.client() as api:
        cid = await new_conversation(api)
        if door == "chatmem":
            start = api.stream("POST", f"/v1/conversations/{cid}/messages", json={"content": "/long go"})
        elif door == "ai-sdk":
            message = {"id": "m1", "role": "user", "parts": [{"type": "text", "text": "/long go"}]}
            chat = {"id": cid, "trigger": "submit-message", "messages": [message]}
            start = api.stream("POST", "/v1/ai-sdk/chat", json=chat)
        else:
            start = api.stream("POST", "/v1/ag-ui", json={**ag_ui_run(0), "threadId": cid})
        async with start as streaming:
            assert streaming.status_code == 200, await streaming.aread()
            frames = streaming.aiter_bytes()
            await anext(frames)  # the reply streams, and its stream stays open
            (reply,) = server.services.registry.all()
            await spend_the_request_rate(api)
            if door == "chatmem":
                stopped = await api.post(f"/v1/turns/{reply.turn_id}/stop")
            else:
                stopped = await api.post(f"/v1/{door}{'/chat' if door == 'ai-sdk' else ''}/{cid}/stop")
            assert stopped.status_code == 200, stopped.text
        # The rate was spent all along: only the stop got through.
        assert (await api.get("/v1/conversations")).status_code == 429
    assert await stored_status(server, reply.id) == "interrupted_by_user"


async def test_a_user_at_the_request_rate_limit_can_still_cancel_a_background_response(
    start_server: Any,
) -> None:
    server: LiveServer = await start_server(rate_limit_per_minute=5, **SLOW)
    client = openai_client(server)
    started = await client.responses.create(model=MODEL, input="/long a long story", background=True)
    async with server.client() as api:
        await spend_the_request_rate(api)
    cancelled = await client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"


async def test_stops_have_their_own_allowance_apart_from_the_request_rate(start_server: Any) -> None:
    server: LiveServer = await start_server(rate_limit_per_minute=100, stops_per_minute=3)
    async with server.client() as api:
        # A thread never used keeps the stop for its first run (202), which spends the allowance
        # as a stop that stopped a run does.
        answers = [(await api.post("/v1/ag-ui/no-such-thread/stop")).status_code for _ in range(4)]
        assert answers == [202, 202, 202, 429]
        assert (await api.get("/v1/conversations")).status_code == 200  # the request rate is untouched


async def test_a_responses_websocket_over_the_request_rate_was_refused_as_a_bad_credential(
    start_server: Any,
) -> None:
    """The HTTP door answers a spent request rate with OpenAI's 429 and Retry-After; the
    WebSocket handshake was closed as a 403, which a client reads as a credential refused."""
    import websockets

    server: LiveServer = await start_server(rate_limit_per_minute=5)
    async with server.client() as api:
        await spend_the_request_rate(api)
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with client.responses.connect() as connection:
            await connection.response.create(model="chatmem-demo", input="hi")
            await connection.recv()
    answer = refused.value.response
    assert answer.status_code == 429, answer
    assert json.loads(answer.body)["error"]["code"] == "rate_limit_exceeded"
    assert int(answer.headers["Retry-After"]) >= 1


async def test_idle_responses_websockets_took_no_stream_slot(start_server: Any) -> None:
    """A user held any number of WebSocket-mode connections open (40 on a cap of 10), where
    every other held stream (a follower's SSE, GET /mcp) takes a slot of MAX_STREAMS_PER_USER."""
    import websockets

    server: LiveServer = await start_server(max_streams_per_user=2)
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    owner = Owner("t1", "u1")
    async with client.responses.connect() as first, client.responses.connect():
        assert server.services.admission.streams.open_count(owner) == 2
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with client.responses.connect():
                pass
        assert refused.value.response.status_code == 429
        assert json.loads(refused.value.response.body)["error"]["code"] == "rate_limit_exceeded"
        # A response streams in its connection's slot: it takes no other.
        await first.response.create(model="chatmem-demo", input="hi")
        async for event in first:
            if event.type in ("response.completed", "response.failed", "error"):
                assert event.type == "response.completed", event
                break
    await wait_until(lambda: server.services.admission.streams.open_count(owner) == 0)
    async with client.responses.connect():
        pass


async def test_an_idle_responses_websocket_held_its_stream_slot_past_its_time_limit(
    start_server: Any,
) -> None:
    """The connection's time limit was checked only when a message came: an idle connection was
    never closed by the server, and held one of its user's stream slots for good."""
    server: LiveServer = await start_server(max_streams_per_user=1, responses_websocket_seconds=1)
    client = AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(), max_retries=0)
    owner = Owner("t1", "u1")
    async with client.responses.connect() as idle:
        assert server.services.admission.streams.open_count(owner) == 1
        async with asyncio.timeout(30):  # the server closes it: iterating ends at its close frame
            events = [event async for event in idle]
    assert [(e.type, getattr(e, "status", None)) for e in events] == [("error", 400)], events
    assert events[0].error.code == "websocket_connection_limit_reached"  # type: ignore[union-attr]
    await wait_until(lambda: server.services.admission.streams.open_count(owner) == 0)
    async with client.responses.connect():  # the slot is free again: no 429 on a cap of 1
        pass
