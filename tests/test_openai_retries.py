"""Retries on the OpenAI doors, sent by the `openai` SDK itself, through a gateway to two replicas.

The SDK (2 retries by default) sends a request again after a dropped connection, a 408,
409, 429 or 5xx, with the same headers (`X-Stainless-Retry-Count` counts the attempt). It
sends an `Idempotency-Key` only when the caller sets one. The gateway here is a process
edge: an httpx transport that sends each attempt to the next replica and, for the first
attempt, reads chatmem's whole answer and then tells the SDK 502 (a proxy that lost the
answer), so the retry reaches the other replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest

from memory.config import Settings
from tests.openai_support import MODEL, TENANT, conversations, ended_turns, make_key, new_user, turns
from tests.procs import ServerProcess, server_process, server_processes
from tests.support import wait_until


@pytest.fixture(scope="module")
async def replicas(pg_url: str) -> AsyncIterator[list[ServerProcess]]:
    async with server_processes(pg_url, 2, demo_tokens_per_second=100) as procs:
        yield procs


class LosingGateway(httpx.AsyncBaseTransport):
    """Attempt N goes to replica N % 2; the answers to the first `lose` attempts are read, then lost."""

    def __init__(self, replicas: list[ServerProcess], lose: int = 1) -> None:
        self.ports = [replica.port for replica in replicas]
        self.lose = lose
        self.sent: list[httpx.Headers] = []
        self.upstream = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        port = self.ports[len(self.sent) % len(self.ports)]
        self.sent.append(request.headers)
        url = request.url.copy_with(host="127.0.0.1", port=port)
        forwarded = httpx.Request(request.method, url, headers=request.headers, content=await request.aread())
        response = await self.upstream.handle_async_request(forwarded)
        if len(self.sent) > self.lose:
            return response
        await self.lose_answer(response)
        return httpx.Response(502, json={"error": {"message": "bad gateway"}})

    async def lose_answer(self, response: httpx.Response) -> None:
        await response.aread()  # the whole answer reached the gateway
        await response.aclose()


class HoldingGateway(LosingGateway):
    """The first attempt's answer is held (its connection open, nothing read) while the SDK is
    told 502 and to retry at once: the retry reaches the other replica while the reply runs."""

    def __init__(self, replicas: list[ServerProcess], running: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(replicas)
        self.running = running
        self.held: list[httpx.Response] = []
        self.running_at_retry: list[bool] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if len(self.sent) == 1:
            self.running_at_retry.append(await self.running())
        response = await super().handle_async_request(request)
        if response.status_code == 502:
            response.headers["retry-after-ms"] = "1"
        return response

    async def lose_answer(self, response: httpx.Response) -> None:
        self.held.append(response)

    async def aclose(self) -> None:
        for response in self.held:
            await response.aclose()
        await super().aclose()


def a_turn_is(replica: ServerProcess, user: str, status: str) -> Callable[[], Awaitable[bool]]:
    """Whether the user's first conversation, read on `replica`, has a turn in `status` (for wait_until)."""

    async def check() -> bool:
        found = await conversations(replica, user)
        stored = await turns(replica, user, found[0]["id"]) if found else []
        return any(t["status"] == status for t in stored)

    return check


# A chat.completion.chunk with text, or a Responses text delta.
TEXT_CAME = re.compile(r'"content": ?"[^"]|response\.output_text\.delta')


class LeavingGateway(LosingGateway):
    """The first attempt's connection drops once text has started to come: the client left."""

    def __init__(self, replicas: list[ServerProcess], ended: Callable[[], Awaitable[bool]]) -> None:
        super().__init__(replicas)
        self.ended = ended

    async def lose_answer(self, response: httpx.Response) -> None:
        async for line in response.aiter_lines():
            if TEXT_CAME.search(line):
                break
        await response.aclose()
        # As a proxy's 502 comes after the upstream connection closed: the retry finds the reply ended.
        await wait_until(self.ended, what="the left reply's ending")

    async def aclose(self) -> None:
        await self.upstream.aclose()


def client_through(gateway: LosingGateway, key: str) -> openai.AsyncOpenAI:
    # The SDK's defaults (2 retries) on a client whose connections go through the gateway.
    http = httpx.AsyncClient(transport=gateway, timeout=30)
    return openai.AsyncOpenAI(base_url="http://gateway/openai/v1", api_key=key, http_client=http)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_completion_retried_after_a_lost_answer_is_one_turn_answered_from_the_first_reply(
    replicas: list[ServerProcess], stream: bool
) -> None:
    # Without the key on this door, a first message retried made a second conversation with the
    # same message and a second reply, both remembered.
    user = new_user()
    gateway = LosingGateway(replicas)
    client = client_through(gateway, await make_key(replicas[0], user))
    key = str(uuid.uuid4())
    messages = [{"role": "user", "content": "tell me about retries"}]
    if stream:
        answer = await client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, extra_headers={"Idempotency-Key": key}
        )
        text = "".join([c.choices[0].delta.content or "" async for c in answer if c.choices])
    else:
        completion = await client.chat.completions.create(
            model=MODEL, messages=messages, extra_headers={"Idempotency-Key": key}
        )
        text = completion.choices[0].message.content or ""
    assert [h["x-stainless-retry-count"] for h in gateway.sent] == ["0", "1"]
    assert [h["idempotency-key"] for h in gateway.sent] == [key, key]
    [conversation] = await conversations(replicas[0], user)
    stored = await ended_turns(replicas[0], user, conversation["id"])
    assert [(t["role"], t["status"]) for t in stored] == [("user", "completed"), ("assistant", "completed")]
    assert "retries" in text and stored[1]["content"] == text
    # The continuation of that chat, sent whole as clients do, goes on in the same conversation.
    more = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "and more?"}]
    await client.chat.completions.create(model=MODEL, messages=more, extra_headers={"Idempotency-Key": "2nd"})
    assert len(await conversations(replicas[0], user)) == 1
    stored = await ended_turns(replicas[0], user, conversation["id"])
    assert [t["content"] for t in stored if t["role"] == "user"] == ["tell me about retries", "and more?"]


async def test_the_same_idempotency_key_with_another_message_is_a_400_that_stores_nothing(
    replicas: list[ServerProcess],
) -> None:
    user = new_user()
    client = openai.AsyncOpenAI(
        base_url=f"{replicas[0].base_url}/openai/v1", api_key=await make_key(replicas[0], user), max_retries=0
    )
    headers = {"Idempotency-Key": "k-1"}
    first = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "pay 5"}], extra_headers=headers
    )
    for content in ("pay 500", "pay 5 now"):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}], extra_headers=headers
            )
        assert refused.value.code == "idempotency_key_reused"
    again = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "pay 5"}], extra_headers=headers
    )
    assert again.headers["x-chatmem-reply-id"] == first.headers["x-chatmem-reply-id"]
    assert len(await conversations(replicas[0], user)) == 1
    stored = await turns(replicas[0], user, first.headers["x-chatmem-conversation-id"])
    assert [t["content"] for t in stored if t["role"] == "user"] == ["pay 5"]
    with pytest.raises(openai.BadRequestError):
        too_long = {"Idempotency-Key": "k" * 201}
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], extra_headers=too_long
        )


async def test_a_response_retried_after_a_lost_answer_is_one_turn_on_either_replica(
    replicas: list[ServerProcess],
) -> None:
    user = new_user()
    gateway = LosingGateway(replicas, lose=1)
    client = client_through(gateway, await make_key(replicas[0], user))
    first = await client.responses.create(
        model=MODEL, input="remember the retries", extra_headers={"Idempotency-Key": "r-1"}
    )
    gateway.lose = 3  # the continuation's first answer is lost too
    second = await client.responses.create(
        model=MODEL,
        input="and again",
        previous_response_id=first.id,
        extra_headers={"Idempotency-Key": "r-2"},
    )
    assert [h["x-stainless-retry-count"] for h in gateway.sent] == ["0", "1", "0", "1"]
    [conversation] = await conversations(replicas[0], user)
    stored = await ended_turns(replicas[0], user, conversation["id"])
    assert [(t["role"], t["content"]) for t in stored if t["role"] == "user"] == [
        ("user", "remember the retries"),
        ("user", "and again"),
    ]
    answers = [t["content"] for t in stored if t["role"] == "assistant"]
    assert answers == [first.output_text, second.output_text]
    async with replicas[1].client(TENANT, user) as api:
        assert (await api.get(f"/openai/v1/responses/{second.id}")).json()["previous_response_id"] == first.id


async def test_a_completion_retried_after_its_client_left_is_answered_again_not_replayed_cut_off(
    replicas: list[ServerProcess],
) -> None:
    # Closing the connection is the stop on this door, so the first attempt's reply ended
    # interrupted (client_disconnected); the retry was answered with that cut-off reply.
    user = new_user()
    question = "/long tell me about retries"

    gateway = LeavingGateway(replicas, a_turn_is(replicas[0], user, "interrupted_by_user"))
    client = client_through(gateway, await make_key(replicas[0], user))
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        stream=True,
        extra_headers={"Idempotency-Key": "leave-1"},
    )
    chunks = [chunk async for chunk in answer if chunk.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    assert [h["x-stainless-retry-count"] for h in gateway.sent] == ["0", "1"]
    [conversation] = await conversations(replicas[0], user)
    async with replicas[1].client(TENANT, user) as api:
        url = f"/v1/conversations/{conversation['id']}"
        stored = (await api.get(f"{url}/turns")).json()["items"]
        [left] = [b for b in (await api.get(f"{url}/branches")).json()["items"] if not b["active"]]
        cut_off = (await api.get(f"{url}/turns", params={"branch": left["id"]})).json()["items"]
    assert [(t["role"], t["status"], t["content"]) for t in stored] == [
        ("user", "completed", question),
        ("assistant", "completed", text),
    ]
    assert text.endswith("real answers.")
    # The reply its client left stays, as every stopped reply, on the branch it was made on.
    assert [(t["role"], t["status"], t["interrupt_reason"]) for t in cut_off] == [
        ("user", "completed", None),
        ("assistant", "interrupted_by_user", "client_disconnected"),
    ]
    assert text.startswith(cut_off[1]["content"])


async def test_a_response_retried_after_its_client_left_is_answered_again_and_stored_as_a_response(
    replicas: list[ServerProcess],
) -> None:
    user = new_user()
    key = await make_key(replicas[0], user)
    direct = openai.AsyncOpenAI(base_url=f"{replicas[0].base_url}/openai/v1", api_key=key, max_retries=0)
    first = await direct.responses.create(model=MODEL, input="hello")

    gateway = LeavingGateway(replicas, a_turn_is(replicas[0], user, "interrupted_by_user"))
    events = await client_through(gateway, key).responses.create(
        model=MODEL,
        input="/long and then?",
        previous_response_id=first.id,
        stream=True,
        extra_headers={"Idempotency-Key": "leave-2"},
    )
    done = [event.response async for event in events if event.type == "response.completed"]
    assert len(done) == 1 and done[0].output_text.endswith("real answers.")
    assert [h["x-stainless-retry-count"] for h in gateway.sent] == ["0", "1"]
    again = await direct.responses.retrieve(done[0].id)  # stored as a response, like the first attempt's
    assert again.status == "completed" and again.previous_response_id == first.id
    [conversation] = await conversations(replicas[0], user)
    stored = await turns(replicas[0], user, conversation["id"])
    assert [(t["role"], t["status"]) for t in stored] == [
        ("user", "completed"),
        ("assistant", "completed"),
        ("user", "completed"),
        ("assistant", "completed"),
    ]
    assert stored[2]["content"] == "/long and then?" and stored[3]["content"] == done[0].output_text


async def test_a_completion_retried_while_its_reply_runs_follows_it_live_on_the_other_replica(
    replicas: list[ServerProcess],
) -> None:
    user = new_user()

    gateway = HoldingGateway(replicas, a_turn_is(replicas[1], user, "streaming"))
    client = client_through(gateway, await make_key(replicas[0], user))
    answer = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "/long still going?"}],
        stream=True,
        extra_headers={"Idempotency-Key": "hold-1"},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in answer if c.choices])
    await gateway.aclose()
    assert [h["x-stainless-retry-count"] for h in gateway.sent] == ["0", "1"]
    [conversation] = await conversations(replicas[0], user)
    stored = await ended_turns(replicas[0], user, conversation["id"])
    assert [(t["role"], t["status"]) for t in stored] == [("user", "completed"), ("assistant", "completed")]
    assert stored[1]["content"] == text and text.endswith("real answers.")
    # Where it was meant to land: the retry came while the reply still ran on the first replica.
    assert gateway.running_at_retry == [True]


class CrashingGateway(httpx.AsyncBaseTransport):
    """First attempts go to `victim`; once text has started to come on each of `first`
    attempts, the victim is killed (SIGKILL) and each SDK is told 502, as a proxy tells it
    when its upstream dies. Retries go to `survivor`, while the dead replica's replies are
    still stored `streaming`."""

    def __init__(self, victim: ServerProcess, survivor: ServerProcess, first: int) -> None:
        self.victim, self.survivor = victim, survivor
        self.texts = asyncio.Barrier(first)
        self.sent: list[httpx.Headers] = []
        self.upstream = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.headers)
        retry = request.headers["x-stainless-retry-count"] != "0"
        port = (self.survivor if retry else self.victim).port
        url = request.url.copy_with(host="127.0.0.1", port=port)
        forwarded = httpx.Request(request.method, url, headers=request.headers, content=await request.aread())
        response = await self.upstream.handle_async_request(forwarded)
        if retry:
            return response
        lines = response.aiter_lines()  # held: a dropped iterator would close the connection
        async for line in lines:
            if TEXT_CAME.search(line):
                break
        await self.texts.wait()
        self.victim.kill()  # once: a second kill finds it dead
        with contextlib.suppress(httpx.HTTPError):
            await response.aclose()
        return httpx.Response(502, json={"error": {"message": "bad gateway"}})

    async def aclose(self) -> None:
        await self.upstream.aclose()


async def test_a_retry_after_its_replica_died_is_answered_at_once_not_after_the_heartbeat_timeout(
    pg_url: str, replicas: list[ServerProcess]
) -> None:
    # The retry reattached to the dead replica's reply, still `streaming` until the reaper's
    # heartbeat timeout (15 s), and followed it: nothing more came until then, and then only
    # the failure (an error chunk; `response.failed`). Both OpenAI doors, one crash.
    user = new_user()
    question = "/long what happens after a crash?"
    survivor = replicas[1]
    async with server_process(pg_url, demo_tokens_per_second=100) as victim:
        gateway = CrashingGateway(victim, survivor, first=2)
        http = httpx.AsyncClient(transport=gateway, timeout=30)
        client = openai.AsyncOpenAI(
            base_url="http://gateway/openai/v1", api_key=await make_key(survivor, user), http_client=http
        )

        async def completion() -> str:
            chunks = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                stream=True,
                extra_headers={"Idempotency-Key": "crash-1"},
            )
            got = [chunk async for chunk in chunks if chunk.choices]
            assert [c.choices[0].finish_reason for c in got if c.choices[0].finish_reason] == ["stop"]
            return "".join(c.choices[0].delta.content or "" for c in got)

        async def response() -> str:
            events = await client.responses.create(
                model=MODEL, input=question, stream=True, extra_headers={"Idempotency-Key": "crash-2"}
            )
            [done] = [event.response async for event in events if event.type == "response.completed"]
            return done.output_text

        started = time.monotonic()
        texts = await asyncio.gather(completion(), response())
        answered_in = time.monotonic() - started
        await gateway.aclose()
    assert sorted(h["x-stainless-retry-count"] for h in gateway.sent) == ["0", "0", "1", "1"]
    assert answered_in < Settings.model_fields["heartbeat_timeout_seconds"].default  # the replicas' own
    for conversation in await conversations(survivor, user):
        async with survivor.client(TENANT, user) as api:
            url = f"/v1/conversations/{conversation['id']}"
            stored = (await api.get(f"{url}/turns")).json()["items"]
            [dead] = [b for b in (await api.get(f"{url}/branches")).json()["items"] if not b["active"]]
            cut_off = (await api.get(f"{url}/turns", params={"branch": dead["id"]})).json()["items"]
        # Answered again, as a retry of a reply the reaper ended is: one user message, a whole answer.
        assert [(t["role"], t["status"], t["content"]) for t in stored] == [
            ("user", "completed", question),
            ("assistant", "completed", stored[1]["content"]),
        ]
        assert stored[1]["content"] in texts and stored[1]["content"].endswith("real answers.")
        # The dead replica's reply got the reaper's one ending, with what it had checkpointed.
        assert [(t["role"], t["status"]) for t in cut_off] == [
            ("user", "completed"),
            ("assistant", "interrupted_by_error"),
        ]
        assert cut_off[1]["error"]["code"] == "process_died"
        assert stored[1]["content"].startswith(cut_off[1]["content"])
    assert len(await conversations(survivor, user)) == 2
