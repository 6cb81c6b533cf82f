"""The admission's limits on their own: one token bucket, stream slots, the running cap, the import quota.

The clock is injected, so time moves without sleeping.
"""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from chat_api.admission import Admission
from chat_api.admission.bucket import TokenBuckets
from chat_api.errors import RateLimited
from chat_api.replies import Reply
from chat_api.replies.registry import ReplyRegistry
from memory.config import get_settings
from memory.errors import InvalidInput
from memory.record.conversations import Owner

ALICE = Owner("t1", "alice")
BOB = Owner("t1", "bob")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock | None = None, **limits: Any) -> Admission:
    settings = get_settings(jwt_secret="x" * 40, **limits)
    return Admission(settings, ReplyRegistry(), clock=clock or Clock())


def test_request_rate_allows_a_burst_then_answers_with_the_wait() -> None:
    clock = Clock()
    gate = admission(clock, rate_limit_per_minute=3)
    for _ in range(3):
        gate.admit_request(ALICE)
    with pytest.raises(RateLimited) as refused:
        gate.admit_request(ALICE)
    assert refused.value.retry_after == 20  # one request every 20 s at 3 per minute
    gate.admit_request(BOB)  # another user's allowance is untouched
    clock.now += 19.0
    with pytest.raises(RateLimited) as again:
        gate.admit_request(ALICE)
    assert again.value.retry_after == 1
    clock.now += 1.0
    gate.admit_request(ALICE)


def test_zero_turns_a_limit_off() -> None:
    gate = admission(rate_limit_per_minute=0, auth_failures_per_minute=0)
    for _ in range(1000):
        gate.admit_request(ALICE)
        gate.failed_authentication("127.0.0.1")
    gate.check_address("127.0.0.1")


def test_failed_authentications_are_counted_per_address_and_heal() -> None:
    clock = Clock()
    gate = admission(clock, auth_failures_per_minute=2)
    gate.check_address("10.0.0.1")  # an address never seen costs nothing
    for _ in range(2):
        gate.failed_authentication("10.0.0.1")
    with pytest.raises(RateLimited) as refused:
        gate.check_address("10.0.0.1")
    assert refused.value.retry_after == 30
    gate.check_address("10.0.0.2")
    clock.now += 30
    gate.check_address("10.0.0.1")


def test_a_bucket_forgets_full_keys_once_it_tracks_too_many() -> None:
    clock = Clock()
    buckets: TokenBuckets[str] = TokenBuckets(2, 60, clock=clock, max_keys=3)
    for key in "abc":
        buckets.take(key)
    clock.now += 60  # all full again
    buckets.take("d")
    assert buckets.wait("a") == 0 and len(buckets._levels) == 1


async def _items(n: int) -> AsyncIterator[int]:
    for i in range(n):
        yield i


async def test_stream_limit_counts_open_streams_per_user() -> None:
    gate = admission(max_streams_per_user=2)
    first = gate.admit_stream(ALICE)
    gate.admit_stream(ALICE)
    with pytest.raises(RateLimited) as refused:
        gate.admit_stream(ALICE)
    assert refused.value.retry_after > 0
    gate.admit_stream(BOB)
    first.release()
    first.release()  # twice is once
    assert gate.streams.open_count(ALICE) == 1
    third = gate.admit_stream(ALICE)
    # A stream that runs to its end gives its slot back.
    assert [i async for i in third.hold(_items(3))] == [0, 1, 2]
    assert gate.streams.open_count(ALICE) == 1


async def test_stream_slot_is_released_when_the_response_never_started() -> None:
    gate = admission(max_streams_per_user=1)
    stream = gate.admit_stream(ALICE).hold(_items(3))
    assert gate.streams.open_count(ALICE) == 1
    del stream
    gc.collect()
    assert gate.streams.open_count(ALICE) == 0


async def test_stream_slot_is_released_when_the_stream_is_cancelled() -> None:
    gate = admission(max_streams_per_user=1)
    started = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        while True:
            started.set()
            yield 1
            await asyncio.sleep(3600)

    async def consume() -> None:
        async for _ in gate.admit_stream(ALICE).hold(endless()):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.streams.open_count(ALICE) == 0


def test_a_reply_counts_from_admission_to_its_end_exactly_once() -> None:
    gate = admission(max_running_replies_per_user=2, max_streams_per_user=5)
    reply = Reply(uuid.uuid4(), ALICE, uuid.uuid4(), uuid.uuid4())
    with gate.admit_reply(ALICE, stream=True) as started:
        gate.running.registry.add(reply)  # what start_reply does, then tells the admission
        started.registered()
        assert gate.running.count(ALICE) == 1
    assert gate.running.count(ALICE) == 1 and gate.streams.open_count(ALICE) == 1
    with gate.admit_reply(ALICE, stream=False):  # reattached: nothing is registered
        assert gate.running.count(ALICE) == 2
        with pytest.raises(RateLimited):
            gate.admit_reply(ALICE, stream=False)
        gate.admit_reply(BOB, stream=False).release()  # another user's cap is their own
    assert gate.running.count(ALICE) == 1
    with pytest.raises(ValueError), gate.admit_reply(ALICE, stream=True):  # the start failed
        raise ValueError
    assert gate.running.count(ALICE) == 1 and gate.streams.open_count(ALICE) == 1
    reply.finish("completed")
    assert gate.running.count(ALICE) == 0


async def test_imports_are_charged_whole_and_given_back_what_was_not_created() -> None:
    gate = admission(import_turns_per_hour=10)
    turns = [{"role": "user", "content": f"t{i}"} for i in range(12)]
    with await gate.admit_import(ALICE, turns[:6]) as admitted:
        admitted.settle(2)  # four were there already: 8 left
    with pytest.raises(InvalidInput):  # more than an hour allows at all
        await gate.admit_import(ALICE, turns)
    with await gate.admit_import(ALICE, turns[:8]):
        pass  # the import failed: all 8 come back
    with pytest.raises(RateLimited) as refused:
        await gate.admit_import(ALICE, turns[:9])
    assert refused.value.retry_after == 360  # one turn comes back every 6 minutes
    with pytest.raises(InvalidInput):  # the per-message limit (MAX_MESSAGE_CHARS)
        await gate.admit_import(ALICE, [{"role": "user", "content": "x" * 40_000}])
    with await gate.admit_import(BOB, turns[:10]):
        pass
