"""Starting a reply, and stopping or waiting for one, on whichever process runs it."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.approvals import end_parked_reply
from chat_api.metrics import observe_stop
from chat_api.reaper import end_stale_turns
from chat_api.replies import Reply
from chat_api.runner import ReplyRequest
from chat_api.services import Services
from chat_api.signals import Signals
from memory.branches import activate_branch, create_branch, edit_point, regenerate_point, user_turn_before
from memory.conversations import Owner, get_conversation
from memory.errors import ConversationBusy
from memory.models import Conversation, Turn, TurnStatus
from memory.outbox import record_finished_turn
from memory.turns import begin_answer, begin_reply, find_by_idempotency_key, get_turn

POLL_SECONDS = 0.25


@dataclass(frozen=True)
class Accepted:
    reply_id: uuid.UUID
    user_turn_id: uuid.UUID
    reattached: bool


# Stores a reply's turns in the locked conversation: (session, conversation, reply id) ->
# (the user turn the reply answers, the text recall searches with).
Started = tuple[Turn, str]
BeginReply = Callable[[AsyncSession, Conversation, uuid.UUID], Awaitable[Started]]


async def accept_message(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    content: str,
    *,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
) -> Accepted:
    """Store the user turn and a streaming assistant turn, and start the reply."""

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        return await _store_message(services, session, conversation, reply_id, content, idempotency_key)

    return await start_reply(
        services,
        owner,
        conversation_id,
        begin,
        on_busy=on_busy,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
    )


async def _store_message(
    services: Services,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    content: str,
    idempotency_key: str | None,
) -> Started:
    """The user's message (recorded for memory) and the reply's streaming turn, on the active branch."""
    user_turn, _ = await begin_reply(
        session,
        conversation,
        content=content,
        reply_id=reply_id,
        idempotency_key=idempotency_key,
        model=services.provider.model,
        owner_tag=services.process_id,
    )
    await record_finished_turn(session, user_turn)
    return user_turn, content


async def regenerate_reply(
    services: Services,
    owner: Owner,
    turn: Turn,
    *,
    conversation_id: uuid.UUID,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
) -> Accepted:
    """Answer the last reply's user message again, on a new active branch forked just after it."""

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        current = await get_turn(session, owner, turn.id)  # re-read under the conversation's lock
        parent, fork_seq, user_turn = await regenerate_point(session, conversation, current)
        branch = await create_branch(session, conversation, parent=parent, fork_seq=fork_seq)
        await activate_branch(session, conversation, branch)
        await begin_answer(
            session,
            conversation,
            reply_id=reply_id,
            idempotency_key=idempotency_key,
            model=services.provider.model,
            owner_tag=services.process_id,
        )
        return user_turn, user_turn.content or ""

    return await start_reply(
        services,
        owner,
        conversation_id,
        begin,
        on_busy=on_busy,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
    )


async def edit_message(
    services: Services,
    owner: Owner,
    turn: Turn,
    content: str,
    *,
    conversation_id: uuid.UUID,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
) -> Accepted:
    """Replace a user message: a new active branch forked just before it, the new message, and a reply."""

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        current = await get_turn(session, owner, turn.id)  # re-read under the conversation's lock
        parent, fork_seq = await edit_point(session, conversation, current)
        branch = await create_branch(session, conversation, parent=parent, fork_seq=fork_seq)
        await activate_branch(session, conversation, branch)
        return await _store_message(services, session, conversation, reply_id, content, idempotency_key)

    return await start_reply(
        services,
        owner,
        conversation_id,
        begin,
        on_busy=on_busy,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
    )


async def start_reply(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    begin: BeginReply,
    *,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
) -> Accepted:
    """Lock the conversation, apply the busy policy, store the reply's turns with `begin`, and launch it.

    A request retried with the same Idempotency-Key reattaches to the reply it started.
    """
    while True:
        running: uuid.UUID | None = None
        reply: Reply | None = None
        user_text = ""
        try:
            async with services.db.transaction() as session:
                conversation = await get_conversation(session, owner, conversation_id, for_update=True)
                if idempotency_key:
                    earlier = await find_by_idempotency_key(session, conversation.id, idempotency_key)
                    if earlier is not None and earlier.reply_id is not None:
                        return Accepted(earlier.reply_id, await _answered(session, earlier), reattached=True)
                if conversation.active_reply_id is not None:
                    running = conversation.active_reply_id
                else:
                    reply_id = uuid.uuid4()
                    user_turn, user_text = await begin(session, conversation, reply_id)
                    reply = Reply(reply_id, owner, conversation.id, user_turn.id)
                    reply.publish(
                        "turn.started",
                        {
                            "reply_id": str(reply_id),
                            "user_turn_id": str(user_turn.id),
                            "assistant_turn_id": str(reply_id),
                            "conversation_id": str(conversation.id),
                            "model": services.provider.model,
                        },
                    )
                    # Registered before commit: a stop sent by another process as soon as the
                    # turn is visible must find it here.
                    services.registry.add(reply)
        except BaseException:
            if reply is not None:
                services.registry.remove(reply.id)
            raise
        if reply is not None:
            services.runner.launch(reply, ReplyRequest(user_text=user_text, memory_scope=memory_scope))
            return Accepted(reply.id, reply.user_turn_id, reattached=False)
        assert running is not None
        if on_busy == "reject":
            raise ConversationBusy(
                "a reply is already streaming in this conversation", running_turn_id=str(running)
            )
        if on_busy == "interrupt":
            await stop_reply(services, running, reason="new_message")
        else:  # enqueue
            if await reply_parked(services, running):
                # Waiting for a person can take hours; holding this request open would not help.
                raise ConversationBusy(
                    "the reply in this conversation waits for a tool approval",
                    running_turn_id=str(running),
                    awaiting_approval=True,
                )
            await wait_reply_done(services, running, timeout=None)


async def _answered(session: AsyncSession, earlier: Turn) -> uuid.UUID:
    # A message's key is on its user turn; a regenerate's on the reply's assistant turn.
    if earlier.role == "user":
        return earlier.id
    user_turn = await user_turn_before(session, earlier)
    return user_turn.id if user_turn is not None else earlier.id


async def reply_streaming(services: Services, reply_id: uuid.UUID) -> bool:
    async with services.db.session() as session:
        row = await session.execute(
            select(Turn.id).where(Turn.reply_id == reply_id, Turn.status == TurnStatus.STREAMING).limit(1)
        )
        return row.first() is not None


async def reply_parked(services: Services, reply_id: uuid.UUID) -> bool:
    """True while the reply waits for a tool approval."""
    async with services.db.session() as session:
        row = await session.execute(
            select(Turn.id)
            .where(Turn.reply_id == reply_id, Turn.status == TurnStatus.AWAITING_APPROVAL)
            .limit(1)
        )
        return row.first() is not None


async def wait_reply_done(services: Services, reply_id: uuid.UUID, timeout: float | None) -> bool:
    """Wait until the reply has ended (any process); False if the timeout passed first."""
    local = services.registry.get(reply_id)
    if local is not None:
        try:
            await asyncio.wait_for(local.finished.wait(), timeout)
        except TimeoutError:
            return False
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    waiter = services.signals.done_waiter(reply_id)
    try:
        while await reply_streaming(services, reply_id):
            remaining = POLL_SECONDS if deadline is None else min(POLL_SECONDS, deadline - time.monotonic())
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), remaining)
        return True
    finally:
        services.signals.forget_waiter(reply_id, waiter)


async def stop_reply(services: Services, reply_id: uuid.UUID, *, reason: str = "user") -> bool:
    """Stop the reply wherever it runs; True once it has ended (by this stop or before it)."""
    started = time.monotonic()
    ended = await _stop_reply(services, reply_id, reason)
    observe_stop(time.monotonic() - started, ended=ended)
    return ended


async def _stop_reply(services: Services, reply_id: uuid.UUID, reason: str) -> bool:
    local = services.registry.get(reply_id)
    if local is not None:
        local.request_stop(reason)
    elif await end_parked_reply(services, reply_id, reason):
        return True  # it waited for an approval: no process runs it, the ending is written here
    elif await reply_streaming(services, reply_id):
        await Signals.send_stop(services.db, reply_id, reason)
    else:
        return True
    if await wait_reply_done(services, reply_id, services.settings.stop_wait_seconds):
        return True
    # Nobody answered: if the owner stopped heartbeating it is dead, and the stop is ours to store.
    async with services.db.transaction() as session:
        await end_stale_turns(
            session,
            older_than_seconds=services.settings.heartbeat_timeout_seconds,
            status=TurnStatus.INTERRUPTED_BY_USER,
            reply_id=reply_id,
            reason=reason,
        )
    return not await reply_streaming(services, reply_id)
