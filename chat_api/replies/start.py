"""Starting a reply: a new message, a regenerated answer, or an edited message.

Each stores the reply's turns in one transaction with the conversation row locked, applies
the busy policy (reject, interrupt the running reply, or wait for it; a reply waiting for an
approval may give way, decided and ended under that same lock), reads the rows of the reply's
prompt window in that transaction too (one transaction fewer before the first token),
registers the reply in this process before commit and launches it. A reply whose process
is gone does not make the conversation busy: whatever the policy, it is ended first, as the
reaper would (`reaper.reap_if_owner_gone`), and the request goes on as after any ended
reply. A request retried with the same Idempotency-Key reattaches to the reply it started
(ended first the same way). A stop kept for the reply before it was stored (a stop of the
conversation, or of the run's key, that found nothing running yet: chat_api.replies.stop)
is taken in that transaction, and the reply starts stopped.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.admission.arrival import seconds_since_arrival
from chat_api.metrics import observe_query_ahead
from chat_api.providers.base import ModelOptions
from chat_api.replies.idempotency import check_replay
from chat_api.replies.queue import drop_if_client_leaves, in_line, until
from chat_api.replies.reaper import reap_if_owner_gone
from chat_api.replies.recall import recalls
from chat_api.replies.reply import Reply, ReplyRequest
from chat_api.replies.stop import reply_parked, stop_reply, wait_reply_done
from memory.errors import ConversationBusy, InvalidInput
from memory.events import EventName, StopReason, TurnStartedData, TurnStatus
from memory.recall.stored import NothingStored
from memory.record.branches import (
    conversation_branch,
    edit_point,
    fork_branch,
    history_newest_first,
    newest_turn,
    regenerate_point,
    user_turn_before,
)
from memory.record.conversations import Owner, get_conversation
from memory.record.outbox import record_finished_turn
from memory.record.pending_stops import take_stop
from memory.record.reply_endings import end_parked_reply, wait_for_parked_turn
from memory.record.reply_state import reply_state
from memory.record.tool_calls import ToolCall, takes_a_result, tool_calls_of
from memory.record.turns import add_turn, begin_answer, begin_reply, find_by_idempotency_key, get_turn
from memory.storage.models import Conversation, Turn

if TYPE_CHECKING:
    from chat_api.admission import AdmittedReply
    from chat_api.services import Services

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accepted:
    """A started reply: follow `reply_id`'s events; `reattached` when an Idempotency-Key found it."""

    reply_id: uuid.UUID
    user_turn_id: uuid.UUID
    reattached: bool


def hand_over(
    services: Services,
    accepted: Accepted,
    *,
    tools: tuple[dict[str, Any], ...] = (),
    options: ModelOptions | None = None,
    instructions: str | None = None,
) -> None:
    """Give the reply just started what the client asked of the model: its own tools, options
    (tool_choice, sampling, length) and instructions (shown after chatmem's system prompt).

    Call it right after `start_reply` returns, before anything awaits: the reply's task has
    been created but has not run yet. A reattached reply keeps what its first request gave it.
    """
    reply = services.registry.get(accepted.reply_id)
    if reply is not None and not accepted.reattached:
        reply.client_tools = tools
        reply.model_options = options
        reply.instructions = instructions


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
    admitted: AdmittedReply,
    on_busy: str,
    on_disconnect: str,
    idempotency_key: str | None,
    memory_scope: str,
    parked_gives_way: bool = False,
) -> Accepted:
    """Store the user turn and a streaming assistant turn, and start the reply."""

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        return await store_message(services, session, conversation, reply_id, content, idempotency_key)

    return await start_reply(
        services,
        owner,
        conversation_id,
        begin,
        admitted=admitted,
        on_busy=on_busy,
        on_disconnect=on_disconnect,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
        content=content,
        parked_gives_way=parked_gives_way,
    )


async def store_message(
    services: Services,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    content: str,
    idempotency_key: str | None = None,
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


async def answer_again(
    services: Services,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    user_turn: Turn,
    idempotency_key: str | None = None,
) -> Started:
    """A streaming reply to a user message already stored (regenerate, a resent message)."""
    await begin_answer(
        session,
        conversation,
        reply_id=reply_id,
        idempotency_key=idempotency_key,
        model=services.provider.model,
        owner_tag=services.process_id,
    )
    return user_turn, user_turn.content or ""


async def answer_tool_results(
    services: Services,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    results: Sequence[tuple[str, str]],
    meta: Mapping[str, dict[str, Any]] | None = None,
    idempotency_key: str | None = None,
) -> Started:
    """The client's results of its tool calls, stored as tool turns, and a reply that goes on from them.

    `results` are (tool call id, content); `meta` is kept on a result's turn, by call id (the
    client's own id of the message, say). A result for a call this conversation's active
    branch never made, or for one a stop cut off (the model never sees it again, so it would
    never see the result), is InvalidInput (nothing is stored); one already stored is not
    stored twice.
    """
    branch = await conversation_branch(session, conversation)
    wanted = {call_id for call_id, _ in results}
    calls: dict[str, tuple[Turn, ToolCall]] = {}
    answered: set[str | None] = set()  # a result comes after its call: the newest turns hold it
    async with aclosing(history_newest_first(session, branch)) as history:
        async for turn in history:
            if turn.role == "tool":
                answered.add(turn.tool_call_id)
            elif turn.role == "assistant":
                for call in tool_calls_of(turn.tool_calls):
                    calls.setdefault(str(call.get("id")), (turn, call))  # the newest call of an id wins
                if wanted <= calls.keys():
                    break
    for call_id, content in results:
        found = calls.get(call_id)
        if found is None:
            raise InvalidInput(
                "a tool result answers no tool call of this conversation",
                field="messages",
                tool_call_id=call_id,
            )
        made_in, call = found
        if not takes_a_result(made_in.status, call):
            raise InvalidInput(
                "this tool call was stopped (or failed) before it finished, so it takes no result: "
                "send a new message instead",
                field="messages",
                tool_call_id=call_id,
            )
        if call_id in answered:
            continue  # sent again with a later request: stored once
        answered.add(call_id)
        await add_turn(
            session,
            conversation,
            role="tool",
            status=TurnStatus.COMPLETED,
            content=content,
            tool_call_id=call_id,
            name=str(call.get("name") or ""),
            last_event_id=0,
            meta=(meta or {}).get(call_id),
        )
    user_turn = await newest_turn(session, branch, role="user")
    if user_turn is None:
        raise InvalidInput("the conversation has no user message to answer", field="messages")
    return await answer_again(services, session, conversation, reply_id, user_turn, idempotency_key)


async def regenerate_reply(
    services: Services,
    owner: Owner,
    turn: Turn,
    *,
    admitted: AdmittedReply,
    conversation_id: uuid.UUID,
    on_busy: str,
    on_disconnect: str,
    idempotency_key: str | None,
    memory_scope: str,
    parked_gives_way: bool = False,
    recorded: Callable[[BeginReply], BeginReply] | None = None,
) -> Accepted:
    """Answer the last reply's user message again, on a new active branch forked just after it.

    `recorded` wraps what is stored (an adapter's own rows go in the same transaction).
    """

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        current = await get_turn(session, owner, turn.id)  # re-read under the conversation's lock
        parent, fork_seq, user_turn = await regenerate_point(session, conversation, current)
        await fork_branch(session, conversation, parent=parent, fork_seq=fork_seq)
        return await answer_again(services, session, conversation, reply_id, user_turn, idempotency_key)

    return await start_reply(
        services,
        owner,
        conversation_id,
        recorded(begin) if recorded is not None else begin,
        admitted=admitted,
        on_busy=on_busy,
        on_disconnect=on_disconnect,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
        parked_gives_way=parked_gives_way,
    )


async def edit_message(
    services: Services,
    owner: Owner,
    turn: Turn,
    content: str,
    *,
    admitted: AdmittedReply,
    conversation_id: uuid.UUID,
    on_busy: str,
    on_disconnect: str,
    idempotency_key: str | None,
    memory_scope: str,
    parked_gives_way: bool = False,
) -> Accepted:
    """Replace a user message: a new active branch forked just before it, the new message, and a reply."""

    async def begin(session: AsyncSession, conversation: Conversation, reply_id: uuid.UUID) -> Started:
        current = await get_turn(session, owner, turn.id)  # re-read under the conversation's lock
        parent, fork_seq = await edit_point(session, conversation, current)
        await fork_branch(session, conversation, parent=parent, fork_seq=fork_seq)
        return await store_message(services, session, conversation, reply_id, content, idempotency_key)

    return await start_reply(
        services,
        owner,
        conversation_id,
        begin,
        admitted=admitted,
        on_busy=on_busy,
        on_disconnect=on_disconnect,
        idempotency_key=idempotency_key,
        memory_scope=memory_scope,
        content=content,
        parked_gives_way=parked_gives_way,
    )


async def start_reply(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    begin: BeginReply,
    *,
    admitted: AdmittedReply,
    on_busy: str,
    on_disconnect: str,
    idempotency_key: str | None,
    memory_scope: str,
    content: str | None = None,
    parked_gives_way: bool = False,
) -> Accepted:
    """Lock the conversation, apply the busy policy, store the reply's turns with `begin`, and launch it.

    With `parked_gives_way`, a reply that waits for an approval is ended (`new_message`; its
    calls never run) and this one starts, whatever `on_busy` says: for a door whose client sent
    no busy policy, new input beside a parked reply is the client's answer to it (the user
    typed, edited or regenerated instead of deciding). It is decided under the conversation's
    lock, so two requests at once cannot both take the parked reply's place.

    `admitted` is the reply's admission (chat_api.admission): it counts as running from
    the moment the reply is registered. A request retried with the same Idempotency-Key
    reattaches to the reply it started; `content` (the message's text, None for a regenerate)
    must be the same as then.
    Requests that may wait (`on_busy=enqueue`) are served in arrival order (chat_api.replies.queue);
    with `on_disconnect="stop"`, one whose client leaves while it waits is dropped before
    anything is stored, whichever door it came through.

    A stop of the conversation kept since the request arrived (it passed the door:
    chat_api.admission.arrival) starts the reply stopped (memory.record.pending_stops),
    whichever door it came through.
    """

    async def attempt() -> Accepted:
        return await _start_reply(
            services,
            owner,
            conversation_id,
            begin,
            admitted=admitted,
            on_busy=on_busy,
            idempotency_key=idempotency_key,
            memory_scope=memory_scope,
            content=content,
            parked_gives_way=parked_gives_way,
        )

    drop_if_client_leaves(on_disconnect == "stop")
    if on_busy != "enqueue":
        accepted = await attempt()
    else:
        async with in_line(
            services.queues,
            conversation_id,
            limit=services.settings.max_queued_per_conversation,
            key=idempotency_key,
        ):
            accepted = await attempt()
    if accepted.reattached:
        # A retry of a reply whose process died is answered as one of a reply the reaper
        # ended, now rather than once the dead heartbeat times out.
        await reap_if_owner_gone(services, accepted.reply_id)
    return accepted


async def _start_reply(
    services: Services,
    owner: Owner,
    conversation_id: uuid.UUID,
    begin: BeginReply,
    *,
    admitted: AdmittedReply,
    on_busy: str,
    idempotency_key: str | None,
    memory_scope: str,
    content: str | None,
    parked_gives_way: bool,
) -> Accepted:
    while True:
        # A request that waited (its line, the reply it interrupts) may find the process shutting down.
        services.admission.check_open()
        running: uuid.UUID | None = None
        deciding: uuid.UUID | None = None
        reply: Reply | None = None
        user_text = ""
        prepared: uuid.UUID | None = None
        try:
            async with services.db.transaction() as session:
                conversation = await get_conversation(session, owner, conversation_id, for_update=True)
                if idempotency_key:
                    earlier = await find_by_idempotency_key(session, conversation.id, idempotency_key)
                    if earlier is not None and earlier.reply_id is not None:
                        answered = await _answered(session, earlier)
                        check_replay(earlier, answered, content)
                        answered_id = answered.id if answered is not None else earlier.id
                        return Accepted(earlier.reply_id, answered_id, reattached=True)
                if conversation.active_reply_id is not None and parked_gives_way:
                    deciding = await _give_way_if_parked(session, conversation)
                if deciding is not None:
                    pass  # a decision on the parked reply is being written: see it through, then look again
                elif conversation.active_reply_id is not None:
                    running = conversation.active_reply_id
                else:
                    # A stop that came for this reply before it was stored (memory.record.pending_stops).
                    stopped = await take_stop(session, conversation, idempotency_key, seconds_since_arrival())
                    reply_id = uuid.uuid4()
                    # A user with nothing to recall: no query is encoded, no search made.
                    empty = await _nothing_stored(services, session, owner, conversation, memory_scope)
                    # Its query is encoded while the turns are stored (a regenerate's, once read).
                    if content is not None and empty is None:
                        prepared = _prepare_query(services, conversation, reply_id, content, memory_scope)
                    user_turn, user_text = await begin(session, conversation, reply_id)
                    if content is None and empty is None:
                        prepared = _prepare_query(services, conversation, reply_id, user_text, memory_scope)
                    reply = Reply(reply_id, owner, conversation.id, user_turn.id)
                    reply.nothing_stored = empty
                    await services.prompter.read_at_start(session, reply)
                    reply.publish(
                        EventName.TURN_STARTED,
                        TurnStartedData(
                            reply_id=str(reply_id),
                            user_turn_id=str(user_turn.id),
                            assistant_turn_id=str(reply_id),
                            conversation_id=str(conversation.id),
                            model=services.provider.model,
                        ),
                    )
                    # Registered before commit: a stop sent by another process as soon as the
                    # turn is visible must find it here.
                    services.registry.add(reply)
                    admitted.registered()  # the registry counts it now: no await in between
                    if stopped:
                        log.info("a reply was started stopped: a stop came for it before it was stored")
                        reply.request_stop(StopReason.USER)
        except BaseException:
            if reply is not None:
                services.registry.remove(reply.id)
            if prepared is not None:
                services.recaller.forget_query(prepared)
            raise
        if reply is not None:
            services.runner.launch(reply, ReplyRequest(user_text=user_text, memory_scope=memory_scope))
            return Accepted(reply.id, reply.user_turn_id, reattached=False)
        if deciding is not None:
            async with services.db.transaction() as session:
                await wait_for_parked_turn(session, deciding)  # only that turn's lock is held here
            continue
        assert running is not None
        if await reap_if_owner_gone(services, running):
            continue  # its process was gone: ended as the reaper ends it, so the conversation is free
        if on_busy == "interrupt":
            await stop_reply(services, running, reason=StopReason.NEW_MESSAGE)
            continue  # then start it, once the running reply has ended
        if await reply_parked(services, running):
            if parked_gives_way:
                continue  # parked since the check: it gives way under the lock
            # Waiting for a person can take hours; holding this request open would not help.
            raise ConversationBusy(
                "the reply in this conversation waits for a tool approval",
                running_turn_id=str(running),
                awaiting_approval=True,
            )
        if on_busy == "reject":
            raise ConversationBusy(
                "a reply is already streaming in this conversation", running_turn_id=str(running)
            )
        await until(wait_reply_done(services, running, timeout=None))  # enqueue


async def _give_way_if_parked(session: AsyncSession, conversation: Conversation) -> uuid.UUID | None:
    """End the conversation's reply if it waits for an approval (under the conversation's lock).

    Returns the reply when it is parked but a decision on it holds its turn now: the caller
    waits for that outside the conversation's lock and looks again.
    """
    running = conversation.active_reply_id
    assert running is not None
    if await reply_state(session, running) != TurnStatus.AWAITING_APPROVAL:
        return None
    if await end_parked_reply(session, running, StopReason.NEW_MESSAGE, skip_locked=True) is None:
        return running
    conversation.active_reply_id = None  # its ending released the conversation
    return None


async def _nothing_stored(
    services: Services, session: AsyncSession, owner: Owner, conversation: Conversation, memory_scope: str
) -> NothingStored | None:
    """Whether the reply will recall for a user who has nothing to recall (memory.recall.stored)."""
    if not recalls(memory_scope, conversation.use_memory):
        return None
    return await services.recaller.nothing_stored(session, owner)


def _prepare_query(
    services: Services, conversation: Conversation, reply_id: uuid.UUID, text: str, memory_scope: str
) -> uuid.UUID | None:
    """Start encoding the reply's recall query now, if the reply will recall and the text is its query.

    Whether the text is its query is the recaller's to say.
    """
    if not recalls(memory_scope, conversation.use_memory):
        return None
    if not services.recaller.prepare_query(reply_id, text):
        return None
    observe_query_ahead("started")
    return reply_id


async def _answered(session: AsyncSession, earlier: Turn) -> Turn | None:
    # A message's key is on its user turn; a regenerate's on the reply's assistant turn.
    if earlier.role == "user":
        return earlier
    return await user_turn_before(session, earlier)
