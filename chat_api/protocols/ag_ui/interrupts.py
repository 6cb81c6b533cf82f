"""Tool calls waiting for a person, as AG-UI interrupts: asked (again), answered by `resume`, cancelled.

A resume is checked whole before anything is recorded; its answers are chatmem's approve and
reject (`chat_api.replies.decide`), and the last one resumes the reply, streamed from there.
"""

from __future__ import annotations

import uuid

from ag_ui.core import (
    BaseEvent,
    Message,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    ToolCallResultEvent,
    UserMessage,
)
from fastapi import Response
from fastapi.responses import StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.admission import Admission
from chat_api.protocols.ag_ui.input import Answer, RunRequest
from chat_api.protocols.ag_ui.run import (
    MEDIA_TYPE,
    RunTranslator,
    encode,
    now_ms,
    stopped_result,
    stopped_result_id,
)
from chat_api.protocols.ag_ui.thread import (
    RUN_ID,
    snapshot,
    thread_messages,
    waiting_interrupts,
)
from chat_api.response_headers import STREAM_HEADERS
from chat_api.services import Services
from memory.errors import InvalidInput, NotAwaitingApproval, NotFound
from memory.events import ToolCallState, TurnStatus
from memory.record.ai_sdk_chats import find_chat, remember_message_id
from memory.record.approvals import Decision
from memory.record.branches import (
    branch_history,
    conversation_branch,
    user_turn_before,
)
from memory.record.conversations import Owner
from memory.record.reply_state import reply_state
from memory.record.turns import get_turn
from memory.storage.models import Conversation, Turn

# isort: split
# The reply lifecycle's public seam, in this one block so that a move of those modules is one edit here.
from chat_api.protocols.ag_ui.streams import run_stream
from chat_api.replies import (
    ReplyKind,
    decide,
)


async def parked_turn(session: AsyncSession, conversation: Conversation) -> Turn | None:
    """The turn of the thread's reply that waits for a person, if it does."""
    reply_id = conversation.active_reply_id
    if reply_id is None or await reply_state(session, reply_id) != TurnStatus.AWAITING_APPROVAL:
        return None
    for turn in reversed(await active_history(session, conversation)):
        if turn.reply_id == reply_id and turn.status == TurnStatus.AWAITING_APPROVAL:
            return turn
    return None


async def active_history(session: AsyncSession, conversation: Conversation) -> list[Turn]:
    return await branch_history(session, await conversation_branch(session, conversation))


def interrupt_again(
    thread_id: str, run_id: str, modern: bool, history: list[Message], parked: Turn
) -> Response:
    """A whole run at once: the thread as stored, then the interrupts its reply waits on."""
    translator = RunTranslator(thread_id, run_id, modern=modern)
    outcome = RunFinishedInterruptOutcome(interrupts=waiting_interrupts(parked))
    finished = RunFinishedEvent(thread_id=thread_id, run_id=run_id, outcome=outcome, timestamp=now_ms())
    body = encode([translator.run_started(), snapshot(history), finished])
    return Response(body, media_type=MEDIA_TYPE, headers=STREAM_HEADERS)


async def checked_answers(
    session: AsyncSession, owner: Owner, conversation: Conversation, request: RunRequest
) -> list[tuple[Answer, Turn]]:
    """The answers that decide an open interrupt, each with its turn; every one checked, none recorded.

    An unknown interrupt is InvalidInput; one already decided or stopped is NotAwaitingApproval,
    except a `cancelled` answer, which stays true of it (a replayed resume is safe). A resume
    must answer every open interrupt of the run.
    """
    checked: list[tuple[Answer, Turn]] = []
    turns: dict[uuid.UUID, Turn] = {}
    for answer in request.answers:
        turn = turns.get(answer.turn_id)
        if turn is None:
            try:
                turn = await get_turn(session, owner, answer.turn_id)
            except NotFound as exc:
                raise _unknown(answer) from exc
            if turn.conversation_id != conversation.id:
                raise _unknown(answer)
            turns[turn.id] = turn
        call = next((c for c in turn.tool_calls or [] if c.get("id") == answer.call_id), None)
        if call is None:
            raise _unknown(answer)
        if (
            turn.status == TurnStatus.AWAITING_APPROVAL
            and call.get("state") == ToolCallState.AWAITING_APPROVAL
        ):
            checked.append((answer, turn))
        elif not answer.cancelled:
            raise NotAwaitingApproval(
                "this interrupt is not open (its call was decided, or its run ended)",
                interrupt_id=answer.interrupt_id,
                turn_status=turn.status,
                call_state=call.get("state"),
            )
    answered = {(a.turn_id, a.call_id) for a in request.answers}
    for turn in {t.id: t for _, t in checked}.values():
        left = [i.id for i in waiting_interrupts(turn) if (turn.id, i.tool_call_id) not in answered]
        if left:
            raise InvalidInput(
                "a resume must answer every open interrupt of the run", field="resume", unanswered=left
            )
    return checked


def steered_away(
    request: RunRequest, turns: list[Turn], cancelled: list[tuple[Answer, Turn]]
) -> list[BaseEvent]:
    """What the client is told of the reply it steered away from: each cancelled call's result.

    The stop that ends that reply answers its calls (as every stop does); the snapshot lets
    the client (and any validator) know the calls those results answer, and holds the new
    message under the client's id, which the reply about to start answers.
    """
    assert request.user_message is not None
    message_id, text = request.user_message
    history = [*thread_messages(turns), UserMessage(id=message_id, content=text)]
    results = [
        ToolCallResultEvent(
            message_id=stopped_result_id(answer.call_id),
            tool_call_id=answer.call_id,
            content=stopped_result(),
            role="tool",
            timestamp=now_ms(),
        )
        for answer, _ in cancelled
    ]
    return [snapshot(history), *results]


def _unknown(answer: Answer) -> InvalidInput:
    return InvalidInput("unknown interrupt id", field="resume", interrupt_id=answer.interrupt_id)


async def resume(request: RunRequest, owner: Owner, services: Services, admission: Admission) -> Response:
    """Record the answers to the thread's interrupts; the last one resumes the reply, streamed from there."""
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, request.thread_id)
        if conversation is None:
            raise NotFound("thread not found", thread_id=request.thread_id)
        checked = await checked_answers(session, owner, conversation, request)
        # Read before any decision: the snapshot is the parked reply as the client last saw it.
        turns = await active_history(session, conversation)
    history = thread_messages(turns)
    if not checked:
        # Only cancellations of interrupts already closed: nothing to decide, the thread as it is.
        translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
        finished = RunFinishedEvent(thread_id=request.thread_id, run_id=request.run_id, timestamp=now_ms())
        body = encode([translator.run_started(), snapshot(history), finished])
        return Response(body, media_type=MEDIA_TYPE, headers=STREAM_HEADERS)
    parked = {turn.id: turn for _, turn in checked}
    # Admitted before any decision is stored: the last one resumes the reply.
    with admission.admit_reply(owner, stream=True) as admitted:
        async with services.db.transaction() as session:
            user_turn = await user_turn_before(session, next(iter(parked.values())))
            if user_turn is not None:  # where connect finds the run that drives the reply now
                await remember_message_id(session, user_turn.id, RUN_ID, request.run_id)
        decided = None
        for answer, _ in checked:
            decision = Decision(
                approved=answer.approved, by="user", reason=answer.reason, arguments=answer.arguments
            )
            outcome = await decide(
                services, owner, answer.turn_id, answer.call_id, decision, admitted=admitted
            )
            decided = decided or outcome
        assert decided is not None
    translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
    translator.know_calls(
        (str(c.get("id")), str(c.get("name") or "tool"), str(turn.id))
        for turn in parked.values()
        for c in turn.tool_calls or []
    )
    prefix = [translator.run_started(), snapshot(history)]
    events = run_stream(
        services,
        decided.reply_id,
        decided.after,
        translator,
        prefix,
        on_disconnect=request.on_disconnect,
        kind=ReplyKind.RESUMED,
    )
    return StreamingResponse(admitted.stream(events), media_type=MEDIA_TYPE, headers=STREAM_HEADERS)
