"""Long chats on the doors whose clients send the whole history with every message.

`DefaultChatTransport` (AI SDK) sends every message, `HttpAgent` (AG-UI) the whole thread on
run and connect, and Open WebUI or LibreChat every message on chat completions. Held to
MAX_BODY_BYTES (1 MB), such a chat stopped working after a few hundred turns of code answers:
every message was a 413. These doors take MAX_HISTORY_BODY_BYTES, read only after the door,
and answer past it with their own 413 before any stream, with nothing written. Each client is
the real one: the openai SDK here, `ai` and @ag-ui/client in tests/js/long_history.test.mjs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from openai.types.responses import Response
from sqlalchemy import event

from memory.storage.models import Turn
from tests.conftest import LiveServer, token_for
from tests.support import run_node_tests
from tests.test_door import head, raw_request

MAX_BODY = 1_000_000
MAX_HISTORY_BODY = 3_000_000
# A history between the two limits, and one past the history limit.
OVER_BODY = 1_500_000
OVER_HISTORY = 3_500_000
MODEL = "chatmem-demo"
JS_DIR = Path(__file__).parent / "js"
NODE = shutil.which("node")
# A code answer of a few KB, as real chats have them.
ANSWER = "def double(x):\n    return x * 2  # and why it works\n" * 70
QUESTION = "Why does this fail, and how do I fix it? "
# An answer of as many words as a few KB hold.
SHORT_WORDS_ANSWER = "So it is: if we do it as I say, it is ok and we go on. " * 64
# A page of a branch's history read oldest first (memory.record.branches.BRANCH_HISTORY_FROM).
HISTORY_PAGE = re.compile(r"t\.seq > \$\d+ AND t\.seq <= l\.max_seq")
HISTORY_DOORS = (
    "/v1/ai-sdk/chat",
    "/v1/ag-ui",
    "/v1/ag-ui/some-thread/connect",
    "/openai/v1/chat/completions",
)


@pytest.fixture
async def server(start_server: Any) -> LiveServer:
    live: LiveServer = await start_server(
        max_body_bytes=MAX_BODY, max_history_body_bytes=MAX_HISTORY_BODY, import_turns_per_hour=0
    )
    return live


def openai_client(server: LiveServer, user: str = "u1") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.base_url}/openai/v1", api_key=token_for(user=user), max_retries=0)


# Where the bounds on the event loop's CPU between two events of another stream were set (45 ms),
# a one-message chat completion answered beside that stream cost 10-13 ms of it: the reply's own
# work. A slower machine spends more on everything, so the bound grows by its own one-message
# figure over that one (it never shrinks): it still catches the same multiple of the reply's own
# work (the stalls these tests guard against were 4-10 times it).
LOOP_CPU_BOUND = 0.045
REFERENCE_ONE_MESSAGE_CPU = 0.012
CALIBRATION_USER = "loop-calibration"  # another user's conversations: a test's own are counted
_machine_bound: list[float] = []  # measured once a test run: the machine does not change


async def loop_cpu_bound(server: LiveServer) -> float:
    """LOOP_CPU_BOUND for this machine: scaled by the least of three one-message gaps on `server`
    (the first time; the same figure after)."""
    if _machine_bound:
        return _machine_bound[0]
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    measured = []
    async with openai_client(server, CALIBRATION_USER) as client:
        for _ in range(3):
            gaps, response = await gaps_while(
                server, client, "/openai/v1/chat/completions", body, user=CALIBRATION_USER
            )
            assert response.status_code == 200, response.text[:300]
            measured.append(gaps.cpu)
    _machine_bound.append(LOOP_CPU_BOUND * max(1.0, min(measured) / REFERENCE_ONE_MESSAGE_CPU))
    return _machine_bound[0]


def openai_history(
    size: int, last: str = "the newest question", answer: str = ANSWER
) -> list[ChatCompletionMessageParam]:
    turns = (size // (len(answer) + len(QUESTION) + 60) + 1) * 2  # a question and its answer each
    history: list[ChatCompletionMessageParam] = [
        {"role": "assistant", "content": answer} if i % 2 else {"role": "user", "content": QUESTION}
        for i in range(turns)
    ]
    return [*history, {"role": "user", "content": last}]


async def test_a_whole_chat_completions_history_past_max_body_bytes_gets_its_reply(
    server: LiveServer,
) -> None:
    messages = openai_history(OVER_BODY)
    assert len(json.dumps(messages)) > OVER_BODY
    async with openai_client(server) as client:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            extra_headers={"X-Chatmem-Chat-Key": "long-chat"},
        )
        assert "the newest question" in (reply.choices[0].message.content or "")
        # And the next message of the same chat, the history one reply longer, too.
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "and one more"}]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            extra_headers={"X-Chatmem-Chat-Key": "long-chat"},
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert "and one more" in text


async def test_a_whole_responses_history_past_max_body_bytes_was_a_413(server: LiveServer) -> None:
    """A Responses client that keeps no server state (store off, as Codex) sends the whole chat each
    time, as a chat completions client does: held to the history limit, not MAX_BODY_BYTES."""
    history = openai_history(OVER_BODY)
    async with openai_client(server) as client:
        reply = await client.responses.create(model=MODEL, input=history)  # type: ignore[arg-type]
        assert "the newest question" in reply.output_text
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(model=MODEL, input=openai_history(OVER_HISTORY), stream=True)  # type: ignore[arg-type]
        assert refused.value.status_code == 413
        assert refused.value.body["code"] == "payload_too_large"  # type: ignore[index]


async def test_a_chat_completions_history_past_the_history_limit_is_openais_413_and_stores_nothing(
    server: LiveServer,
) -> None:
    async with openai_client(server) as client:
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as refused:
                history = openai_history(OVER_HISTORY)
                await client.chat.completions.create(model=MODEL, messages=history, stream=stream)
            assert refused.value.status_code == 413
            assert refused.value.body["type"] == "invalid_request_error"  # type: ignore[index]
            assert refused.value.body["code"] == "payload_too_large"  # type: ignore[index]
    async with server.client() as api:
        assert (await api.get("/v1/conversations")).json()["items"] == []


async def test_a_message_inside_a_large_history_is_still_held_to_max_message_chars(
    server: LiveServer, make_settings: Any
) -> None:
    too_long = "x" * (make_settings().max_message_chars + 1)
    messages = openai_history(OVER_BODY)
    messages[2] = {"role": "user", "content": too_long}
    async with openai_client(server) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=MODEL, messages=messages)
    assert refused.value.status_code == 400, refused.value
    body: dict[str, Any] = refused.value.body  # type: ignore[assignment]
    assert body["code"] == "invalid_input" and "32000 characters" in body["message"], body
    async with server.client() as api:
        assert (await api.get("/v1/conversations")).json()["items"] == []


async def test_an_unauthenticated_large_body_on_a_history_door_is_a_401_before_it_is_read(
    server: LiveServer,
) -> None:
    for path in HISTORY_DOORS:
        # 2 MB announced (past MAX_BODY_BYTES, within the history limit), 10 bytes sent: the
        # answer comes without waiting for the rest, and it is the door's, not the body limit's.
        for token in (None, "not-a-token"):
            answer = await raw_request(server, head("POST", path, 2_000_000, token), b'{"messages')
            assert answer.startswith(b"HTTP/1.1 401"), (path, answer[:200])
        # Past the history limit: refused by its length alone, signed in or not.
        answer = await raw_request(server, head("POST", path, OVER_HISTORY, token_for()), b'{"messages')
        assert answer.startswith(b"HTTP/1.1 413"), (path, answer[:200])
        assert b'"payload_too_large"' in answer
    # Every other route keeps MAX_BODY_BYTES.
    answer = await raw_request(server, head("POST", "/v1/conversations", 2_000_000, token_for()), b"{")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


async def test_a_chunked_history_past_the_history_limit_is_the_doors_413_not_a_500(
    server: LiveServer,
) -> None:
    """A body sent without a Content-Length (chunked, as `fetch` sends a stream) passes the limit
    only as it arrives: raised from receive() inside the route, the OpenAI door's error mapping
    did not know it and answered 500 `server_error` (and logged a failure)."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"messages": ['
        for _ in range(OVER_HISTORY // 100_000):
            yield b'{"role": "user", "content": "' + b"x" * 100_000 + b'"},'
        yield b'{"role": "user", "content": "the newest question"}]}'

    async with server.client() as api:
        for path in HISTORY_DOORS:
            answer = await api.post(path, content=chunks(), headers={"Content-Type": "application/json"})
            assert answer.status_code == 413, (path, answer.text[:300])
            error = answer.json()["error"]
            assert error["code"] == "payload_too_large", (path, error)
            assert f"over {MAX_HISTORY_BODY} bytes" in error["message"], (path, error)
            if path.startswith("/openai"):
                assert error["type"] == "invalid_request_error", error
        assert (await api.get("/v1/conversations")).json()["items"] == []


@pytest.mark.skipif(NODE is None, reason="node is not installed")
async def test_the_ai_sdk_and_ag_ui_clients_sending_a_whole_long_history_get_their_reply(
    server: LiveServer,
) -> None:
    assert (JS_DIR / "node_modules" / "ai").is_dir(), "run `npm ci` in tests/js (make js-deps)"
    env = {
        **os.environ,
        "CHATMEM_URL": server.base_url,
        "CHATMEM_TOKEN": token_for("t1", "u1"),
        "CHATMEM_OVER_BODY": str(OVER_BODY),
        "CHATMEM_OVER_HISTORY": str(OVER_HISTORY),
    }
    await run_node_tests(JS_DIR, "long_history.test.mjs", env, timeout=120)


@pytest.mark.parametrize("door", ["chat-completions", "responses"])
async def test_another_streams_events_keep_flowing_while_an_8_mb_history_is_read_and_matched(
    start_server: Any, door: str
) -> None:
    """A chat completions request sends its whole history; the door compares it with the stored
    one to find the conversation, and again under its lock. Done on the event loop, each of the
    two passes over an 8 MB history of short words held the loop for 70-150 ms of its own CPU
    between two events of another reply (wall-clock gaps of 90-200 ms on 2 busy cores); off the
    loop, the loop's thread spends 20-40 ms of CPU between two events. A Responses request
    without `previous_response_id` sends its whole history too, and is mapped the same way; its
    door read the body into a request (validated, its input items made into messages, its texts
    checked) and encoded the input items it stores as JSON, on the event loop: 50-65 ms of the
    loop's CPU between two events for 8 MB, 20-30 ms with both in the chat completions door's
    worker thread.

    The bound is on the CPU the loop's thread spends between two events, not on the wall-clock
    gap: on a shared machine a gap also holds the time the process was not scheduled, and the
    wall-clock gaps of the two codes overlapped. What the CPU bound does not see is another
    thread holding the GIL (the door's JSON parse of the body does, ~10-60 ms): a wall-clock
    bound loose enough to hold on a busy machine is kept for a stall of that kind grown large.
    The answers are short words, so that making the history into units (what must stay off the
    loop) is large next to parsing the body's JSON (which still holds the loop up)."""
    server: LiveServer = await start_server(import_turns_per_hour=0, demo_tokens_per_second=50.0)
    bound = await loop_cpu_bound(server)
    messages = openai_history(7_300_000, answer=SHORT_WORDS_ANSWER)
    async with openai_client(server) as client:
        # The chat so far: its whole history stored (imported by its first request).
        if door == "responses":
            path = "/openai/v1/responses"
            made = await client.responses.with_raw_response.create(model=MODEL, input=messages)  # type: ignore[arg-type]
            answer, headers = made.parse().output_text, made.headers
        else:
            path = "/openai/v1/chat/completions"
            raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
            answer, headers = raw.parse().choices[0].message.content or "", raw.headers
        messages += [{"role": "assistant", "content": answer}]
        messages += [{"role": "user", "content": "and one more"}]
        history = {"input": messages} if door == "responses" else {"messages": messages}
        body = json.dumps({"model": MODEL, **history}).encode()
        assert len(body) > 7_300_000
        with frozen_startup_objects():
            gaps, conversation, answer = await _gaps_while(server, client, path, body)
            assert conversation == headers["X-Chatmem-Conversation-Id"], (
                "the chat went on: its history matched"
            )
            if gaps.cpu >= bound:
                # Once more, the chat one turn longer: work the door does on the loop stalls every
                # time (the code before, 50-65 ms each time), a busy machine's outlier (a slow
                # write of the stored row, 58-86 ms, ~1 in 9 at load 4) seldom twice.
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "and again"},
                ]
                history = {"input": messages} if door == "responses" else {"messages": messages}
                body = json.dumps({"model": MODEL, **history}).encode()
                again, conversation, _ = await _gaps_while(server, client, path, body)
                assert conversation == headers["X-Chatmem-Conversation-Id"], "the chat went on again"
                gaps = min(gaps, again, key=lambda g: g.cpu)
    assert gaps.cpu < bound, (
        f"the event loop spent {gaps.cpu * 1000:.0f} ms between two events of another stream "
        f"(at most {bound * 1000:.0f} ms on this machine)"
    )
    assert gaps.wall < 0.5, f"another stream waited {gaps.wall * 1000:.0f} ms for its next event"


@contextlib.contextmanager
def frozen_startup_objects() -> Iterator[None]:
    """The collector as `chatmem serve` runs it: what the process loaded is frozen, out of reach
    of a full collection (else one walks it all, a pause of its own, whatever triggers it)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class Gaps:
    """The largest gap between two events of a stream: in wall-clock time, and in CPU time of
    the thread running the event loop (which the server and this test share)."""

    wall: float
    cpu: float


async def _gaps_while(
    server: LiveServer, client: AsyncOpenAI, path: str, body: bytes
) -> tuple[Gaps, str, str]:
    """The largest gaps between another reply's events while `body` was answered (see
    `gaps_while`), the conversation `body` went to, and its answer."""
    gaps, response = await gaps_while(server, client, path, body)
    assert response.status_code == 200, response.text[:300]
    made = response.json()
    if path.endswith("/responses"):
        answer = Response.model_validate(made).output_text
    else:
        answer = ChatCompletion.model_validate(made).choices[0].message.content or ""
    return gaps, response.headers["X-Chatmem-Conversation-Id"], answer


async def gaps_while(
    server: LiveServer, client: AsyncOpenAI, path: str, body: bytes, *, user: str = "u1"
) -> tuple[Gaps, httpx.Response]:
    """Stream a long reply in another conversation, send `body` to `path` once it streams, and return the
    largest gaps between that reply's events while `body` was answered, and the answer."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "/long another chat" + " word" * 1000}],
        stream=True,
    )
    loop = asyncio.get_running_loop()
    arrivals: list[tuple[float, float]] = []
    async with stream, server.client(user=user) as api:
        chunks = aiter(stream)
        await anext(chunks)  # streaming
        headers = {"Content-Type": "application/json"}
        sending = asyncio.ensure_future(api.post(path, content=body, headers=headers))
        started = (loop.time(), time.thread_time())
        while not sending.done():
            await anext(chunks)  # the reply lasts longer than the request: it ends with an error if not
            arrivals.append((loop.time(), time.thread_time()))
        answered = (loop.time(), time.thread_time())
        response = await sending
    during = [started, *[a for a in arrivals if a[0] <= answered[0]], answered]
    gaps = Gaps(
        wall=max(b[0] - a[0] for a, b in itertools.pairwise(during)),
        cpu=max(b[1] - a[1] for a, b in itertools.pairwise(during)),
    )
    return gaps, response


async def test_the_history_that_chose_a_chat_completions_conversation_is_not_read_again(
    start_server: Any,
) -> None:
    """The stored history compared to choose the conversation was read again, and compared
    again, under its lock: twice the work for the same answer when nothing happened in between."""
    server: LiveServer = await start_server()
    reads: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if HISTORY_PAGE.search(statement):
            reads.append(statement)

    engine = server.services.db.engine.sync_engine
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "the first question"}]
    async with openai_client(server) as client:
        first = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        messages += [{"role": "assistant", "content": first.parse().choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "the second question"}]
        event.listen(engine, "before_cursor_execute", count)
        try:
            second = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        finally:
            event.remove(engine, "before_cursor_execute", count)
    conversation = first.headers["X-Chatmem-Conversation-Id"]
    assert second.headers["X-Chatmem-Conversation-Id"] == conversation  # chosen by its history
    assert len(reads) == 1, f"the history was read {len(reads)} times"
    async with server.client() as api:
        turns = (await api.get(f"/v1/conversations/{conversation}/turns")).json()["items"]
    assert [t["content"] for t in turns if t["role"] == "user"] == [
        "the first question",
        "the second question",
    ]


async def test_matching_a_sent_history_makes_no_orm_object_of_each_stored_turn(start_server: Any) -> None:
    """Each page of the stored history the door compares with the sent one was made into Turn
    objects on the event loop: ~8 ms of its CPU for a page of 512 turns (a row of the five
    columns compared: ~1 ms), every request of a long chat, twice when the history changed
    under the lock."""
    server: LiveServer = await start_server(import_turns_per_hour=0)
    messages = openai_history(300_000)
    stored_turns = len(messages)
    loaded: list[Turn] = []

    def count(turn: Turn, _context: Any) -> None:
        loaded.append(turn)

    async with openai_client(server) as client:
        first = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        messages += [{"role": "assistant", "content": first.parse().choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "and one more"}]
        event.listen(Turn, "load", count)
        try:
            second = await client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        finally:
            event.remove(Turn, "load", count)
    assert second.headers["X-Chatmem-Conversation-Id"] == first.headers["X-Chatmem-Conversation-Id"]
    assert stored_turns > 100
    assert len(loaded) < 10, f"{len(loaded)} Turn objects made to match a history of {stored_turns} turns"
