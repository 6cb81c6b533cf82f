"""AG-UI's endpoints: what `@ag-ui/client`'s HttpAgent, CopilotKit and assistant-ui's AG-UI runtime call.

- `POST /v1/ag-ui`: a `RunAgentInput`; answers the run as AG-UI events over SSE
  (`run.py` beside this module translates the reply's events).
- `POST /v1/ag-ui/{threadId}/stop`: stop the thread's running run, on any replica.
- `POST /v1/ag-ui/{threadId}/connect`: join the thread's running run after a reload or a
  dropped connection (a snapshot of the thread, then the run's events live).

The thread id is a client chat id (`memory/ai_sdk_chats.py`): one of the caller's
conversations, made on first use. The stored history is the truth: of `messages` only the
last one (and the id before it) is read. Everything that can be refused is refused before
the stream starts, in chatmem's error body; nothing is stored for a refused request.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Annotated, Any

from ag_ui.core import (
    BaseEvent,
    Message,
    RunAgentInput,
    RunFinishedEvent,
    RunFinishedInterruptOutcome,
    ToolCallResultEvent,
    UserMessage,
)
from fastapi import APIRouter, Body, Path, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.deps import OwnerDep, ServicesDep
from chat_api.protocols.ag_ui.input import Answer, RunRequest, check_ids, read_run
from chat_api.protocols.ag_ui.run import (
    CLIENT_MESSAGE_ID,
    HEADERS,
    MEDIA_TYPE,
    MEMORY_EVENT,
    RUN_ID,
    RunTranslator,
    encode,
    now_ms,
    snapshot,
    speaks_1_0,
    stopped_result,
    stopped_result_id,
    thread_messages,
    user_message_id,
    waiting_interrupts,
)
from chat_api.ratelimit import RateLimits, RateLimitsDep, held_while_streaming
from chat_api.services import Services
from memory.ai_sdk_chats import CHAT_ID, chat_conversation, find_chat, remember_message_id
from memory.approvals import Decision
from memory.branches import (
    activate_branch,
    branch_history,
    conversation_branch,
    create_branch,
    load_branch,
    user_turn_before,
)
from memory.conversations import Owner
from memory.errors import InvalidInput, NotAwaitingApproval, NotFound
from memory.models import Conversation, ToolCallState, Turn, TurnStatus
from memory.reply_state import Event, reply_state
from memory.turns import get_turn

# isort: split
# The reply lifecycle's public seam, in this one block so that a move of those modules is one edit here.
from chat_api.replies import (
    Accepted,
    Started,
    answer_again,
    answer_tool_results,
    decide,
    follow_reply,
    start_reply,
    stop_reply,
    store_message,
)

router = APIRouter(prefix="/v1/ag-ui", tags=["ag-ui"])

ThreadId = Annotated[str, Path(min_length=1, max_length=128, pattern=CHAT_ID.pattern)]
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "AG-UI events over SSE (`data: {event}`)", "content": {MEDIA_TYPE: {}}}
}


@router.post("", response_model=None, responses=STREAM_RESPONSE)
async def run(body: RunAgentInput, owner: OwnerDep, services: ServicesDep, limits: RateLimitsDep) -> Response:
    """Run the agent on the thread: answer its new message, client tool results, or interrupts."""
    request = read_run(body, max_message_chars=services.settings.max_message_chars)
    steer_away = bool(request.answers) and request.user_message is not None
    before: list[BaseEvent] = []
    if request.answers and not steer_away:
        return await _resume(request, owner, services, limits)
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, request.thread_id)
        if steer_away:
            # Every open interrupt cancelled and a new message instead: the waiting reply is
            # stopped (its calls never run) and the message is answered, as on_busy=interrupt does.
            if conversation is None:
                raise NotFound("thread not found", thread_id=request.thread_id)
            open_answers = await _checked_answers(session, owner, conversation, request)
            if any(not a.cancelled for a, _ in open_answers):
                raise InvalidInput(
                    "a new message beside resume entries needs every interrupt cancelled",
                    field="resume",
                )
            request = replace(request, answers=(), on_busy="interrupt")
            before = _steered_away(request, await _active_history(session, conversation), open_answers)
        elif conversation is not None and conversation.active_reply_id is not None:
            parked = await _parked_turn(session, conversation)
            if parked is not None:
                # The tool never runs without its answer: the waiting calls are asked again.
                history = thread_messages(await _active_history(session, conversation))
                return _interrupt_again(request.thread_id, request.run_id, request.modern, history, parked)
    if request.tool_results:
        if conversation is None:
            raise NotFound("thread not found", thread_id=request.thread_id)
        results = [(r.tool_call_id, r.content) for r in request.tool_results]
        ids = {r.tool_call_id: {CLIENT_MESSAGE_ID: r.message_id} for r in request.tool_results}

        async def begin_results(session: AsyncSession, locked: Conversation, reply_id: uuid.UUID) -> Started:
            started = await answer_tool_results(services, session, locked, reply_id, results, ids)
            await remember_message_id(session, started[0].id, RUN_ID, request.run_id)
            return started

        return await _reply_stream(services, owner, limits, request, conversation, begin_results, None)
    assert request.user_message is not None
    text = request.user_message[1]

    async def begin(session: AsyncSession, locked: Conversation, reply_id: uuid.UUID) -> Started:
        return await _begin_message(services, session, locked, reply_id, request)

    return await _reply_stream(services, owner, limits, request, conversation, begin, text, before)


async def _begin_message(
    services: Services,
    session: AsyncSession,
    conversation: Conversation,
    reply_id: uuid.UUID,
    request: RunRequest,
) -> Started:
    """Under the conversation lock: continue, edit (a branch after the client's last message), regenerate."""
    assert request.user_message is not None
    message_id, text = request.user_message
    active = await conversation_branch(session, conversation)
    turns = await branch_history(session, active)
    again = next((t for t in turns if t.role == "user" and user_message_id(t) == message_id), None)
    if again is not None:
        # The client sent a message chatmem already has as its last one: answer it again (a reload).
        parent = await load_branch(session, again.branch_id)
        branch = await create_branch(session, conversation, parent=parent, fork_seq=again.seq)
        await activate_branch(session, conversation, branch)
        started = await answer_again(services, session, conversation, reply_id, again)
    else:
        fork_seq = _fork_point(turns, request.previous_id)
        if fork_seq is not None:
            branch = await create_branch(session, conversation, parent=active, fork_seq=fork_seq)
            await activate_branch(session, conversation, branch)
        started = await store_message(services, session, conversation, reply_id, text, _key(request))
        await remember_message_id(session, started[0].id, CLIENT_MESSAGE_ID, message_id)
    await remember_message_id(session, started[0].id, RUN_ID, request.run_id)
    return started


def _fork_point(turns: Sequence[Turn], previous_id: str | None) -> int | None:
    """Where the client's history ends, if before chatmem's: the seq a new branch keeps up to.

    None: the client's history ends where chatmem's does (or names nothing chatmem knows:
    the stored history wins), so the new message continues the active branch.
    """
    if not turns:
        return None
    if previous_id is None:
        return 0  # the client's history is only the new message: an edit of the first one
    ends = {}  # AG-UI message id -> the seq its message ends at (a reply ends with its last turn)
    reply_end: dict[uuid.UUID, int] = {}
    for turn in turns:
        if turn.reply_id is not None and turn.role != "user":
            reply_end[turn.reply_id] = turn.seq
    for turn in turns:
        end = reply_end.get(turn.reply_id, turn.seq) if turn.role != "user" and turn.reply_id else turn.seq
        for message in thread_messages([turn]):
            ends[message.id] = end
    found = ends.get(previous_id)
    if found is None or found >= turns[-1].seq:
        return None
    return found


def _key(request: RunRequest) -> str:
    # A retried input (the same runId) reattaches to the reply it started.
    return f"ag-ui:{request.run_id}"


async def _reply_stream(
    services: Services,
    owner: Owner,
    limits: RateLimits,
    request: RunRequest,
    conversation: Conversation | None,
    begin: Any,
    content: str | None,
    before: Sequence[BaseEvent] = (),
) -> Response:
    """Start the reply with `begin` and stream it; `before` goes out right after RUN_STARTED."""
    # Taken before anything is stored, so a 429 leaves nothing behind.
    slot = limits.streams.acquire(owner)
    try:
        if conversation is None:
            async with services.db.transaction() as session:
                conversation = await chat_conversation(session, owner, request.thread_id)
        accepted: Accepted = await start_reply(
            services,
            owner,
            conversation.id,
            begin,
            on_busy=request.on_busy or services.settings.on_busy_default,
            idempotency_key=_key(request) if content is not None else None,
            memory_scope=request.memory_scope or services.settings.memory_scope,
            content=content,
        )
        reply = services.registry.get(accepted.reply_id)
        if reply is not None and not accepted.reattached:
            # Set before anything awaits: the reply's task has been created but has not run yet.
            reply.client_tools = request.tools
    except BaseException:
        slot.release()
        raise
    translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
    stop = request.on_disconnect == "stop"
    prefix = [translator.run_started(), *before]
    events = _run_stream(services, accepted.reply_id, 0, translator, prefix, stop=stop)
    return StreamingResponse(held_while_streaming(slot, events), media_type=MEDIA_TYPE, headers=HEADERS)


async def _run_stream(
    services: Services,
    reply_id: uuid.UUID,
    after: int,
    translator: RunTranslator,
    prefix: list[BaseEvent],
    *,
    stop: bool,
    batches: AsyncIterator[list[Any]] | None = None,
) -> AsyncIterator[bytes]:
    """The reply's events after `after` as AG-UI SSE frames, one write per batch, until the run ends."""
    try:
        if prefix:
            yield encode(prefix)
        async for batch in batches or follow_reply(services, reply_id, after):
            out = [event for item in batch for event in translator.translate(item)]
            if out:
                yield encode(out)
            if translator.ended:
                break
        if not translator.ended:
            yield encode(translator.end())
    finally:
        if stop and not translator.ended:
            reply = services.registry.get(reply_id)
            if reply is not None:
                reply.request_stop("client_disconnected")


# --- interrupts --------------------------------------------------------------------------


async def _parked_turn(session: AsyncSession, conversation: Conversation) -> Turn | None:
    """The turn of the thread's reply that waits for a person, if it does."""
    reply_id = conversation.active_reply_id
    if reply_id is None or await reply_state(session, reply_id) != TurnStatus.AWAITING_APPROVAL:
        return None
    for turn in reversed(await _active_history(session, conversation)):
        if turn.reply_id == reply_id and turn.status == TurnStatus.AWAITING_APPROVAL:
            return turn
    return None


async def _active_history(session: AsyncSession, conversation: Conversation) -> list[Turn]:
    return await branch_history(session, await conversation_branch(session, conversation))


def _interrupt_again(
    thread_id: str, run_id: str, modern: bool, history: list[Message], parked: Turn
) -> Response:
    """A whole run at once: the thread as stored, then the interrupts its reply waits on."""
    translator = RunTranslator(thread_id, run_id, modern=modern)
    outcome = RunFinishedInterruptOutcome(interrupts=waiting_interrupts(parked))
    finished = RunFinishedEvent(thread_id=thread_id, run_id=run_id, outcome=outcome, timestamp=now_ms())
    body = encode([translator.run_started(), snapshot(history), finished])
    return Response(body, media_type=MEDIA_TYPE, headers=HEADERS)


async def _checked_answers(
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


def _steered_away(
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


async def _resume(request: RunRequest, owner: Owner, services: Services, limits: RateLimits) -> Response:
    """Record the answers to the thread's interrupts; the last one resumes the reply, streamed from there."""
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, request.thread_id)
        if conversation is None:
            raise NotFound("thread not found", thread_id=request.thread_id)
        checked = await _checked_answers(session, owner, conversation, request)
        # Read before any decision: the snapshot is the parked reply as the client last saw it.
        turns = await _active_history(session, conversation)
    history = thread_messages(turns)
    if not checked:
        # Only cancellations of interrupts already closed: nothing to decide, the thread as it is.
        translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
        finished = RunFinishedEvent(thread_id=request.thread_id, run_id=request.run_id, timestamp=now_ms())
        return Response(
            encode([translator.run_started(), snapshot(history), finished]), media_type=MEDIA_TYPE
        )
    parked = {turn.id: turn for _, turn in checked}
    slot = limits.streams.acquire(owner)
    try:
        async with services.db.transaction() as session:
            user_turn = await user_turn_before(session, next(iter(parked.values())))
            if user_turn is not None:  # where connect finds the run that drives the reply now
                await remember_message_id(session, user_turn.id, RUN_ID, request.run_id)
        decided = None
        for answer, _ in checked:
            decision = Decision(
                approved=answer.approved, by="user", reason=answer.reason, arguments=answer.arguments
            )
            outcome = await decide(services, owner, answer.turn_id, answer.call_id, decision)
            decided = decided or outcome
        assert decided is not None
    except BaseException:
        slot.release()
        raise
    translator = RunTranslator(request.thread_id, request.run_id, modern=request.modern)
    translator.know_calls(
        (str(c.get("id")), str(c.get("name") or "tool"), str(turn.id))
        for turn in parked.values()
        for c in turn.tool_calls or []
    )
    prefix = [translator.run_started(), snapshot(history)]
    events = _run_stream(services, decided.reply_id, decided.after, translator, prefix, stop=False)
    return StreamingResponse(held_while_streaming(slot, events), media_type=MEDIA_TYPE, headers=HEADERS)


# --- connect and stop ---------------------------------------------------------------------


@router.post("/{thread_id}/connect", response_model=None, responses=STREAM_RESPONSE)
async def connect(
    thread_id: ThreadId,
    owner: OwnerDep,
    services: ServicesDep,
    limits: RateLimitsDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> Response:
    """Join the thread's running run: its RUN_STARTED, a snapshot of the thread, then its events live.

    The body is the RunAgentInput the client would send; only its `runId` and
    `protocolVersion` are read. When nothing runs, the run finishes at once (with the
    interrupts of a reply that waits for a person).
    """
    body = body or {}
    run_id = str(body.get("runId") or uuid.uuid4())
    check_ids(thread_id, run_id)
    declared = body.get("protocolVersion")
    modern = speaks_1_0(declared if isinstance(declared, str) else None)
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, thread_id)
        if conversation is None:
            raise NotFound("thread not found", thread_id=thread_id)
        turns = await _active_history(session, conversation)
        reply_id = conversation.active_reply_id
        state = await reply_state(session, reply_id) if reply_id is not None else None
        parked = await _parked_turn(session, conversation) if state == TurnStatus.AWAITING_APPROVAL else None
    if state is None or reply_id is None:
        translator = RunTranslator(thread_id, run_id, modern=modern)
        finished = RunFinishedEvent(thread_id=thread_id, run_id=run_id, timestamp=now_ms())
        body_bytes = encode([translator.run_started(), snapshot(thread_messages(turns)), finished])
        return Response(body_bytes, media_type=MEDIA_TYPE, headers=HEADERS)
    reply_run_id = _run_id_of(turns, reply_id) or str(reply_id)
    if parked is not None:
        return _interrupt_again(thread_id, reply_run_id, modern, thread_messages(turns), parked)
    slot = limits.streams.acquire(owner)
    translator = RunTranslator(thread_id, reply_run_id, modern=modern)
    before = [t for t in turns if t.reply_id != reply_id or t.role == "user"]
    events = _joined_stream(services, reply_id, translator, thread_messages(before))
    return StreamingResponse(held_while_streaming(slot, events), media_type=MEDIA_TYPE, headers=HEADERS)


def _run_id_of(turns: Sequence[Turn], reply_id: uuid.UUID) -> str | None:
    """The AG-UI run that drives the reply now, kept on the user turn it answers (None: no AG-UI run)."""
    asked: Turn | None = None
    for turn in turns:
        if turn.reply_id == reply_id and turn.role != "user":
            break
        if turn.role == "user":
            asked = turn
    value = (asked.meta or {}).get(RUN_ID) if asked is not None else None
    return value if isinstance(value, str) else None


async def _joined_stream(
    services: Services, reply_id: uuid.UUID, translator: RunTranslator, history: list[Message]
) -> AsyncIterator[bytes]:
    """Connect's stream: the reply's log so far folded into a snapshot, then the rest live."""
    batches = follow_reply(services, reply_id, 0)
    try:
        first: list[Event] = await anext(batches, [])
        folded = [event for item in first for event in translator.translate(item)]
        prefix: list[BaseEvent] = [
            translator.run_started(),
            snapshot([*history, *translator.settled_messages()]),
        ]
        if translator.ended:
            yield encode([*prefix, folded[-1]])  # it ended meanwhile: its outcome, nothing else
            return
        prefix += [e for e in folded if getattr(e, "name", None) == MEMORY_EVENT][-1:]
        prefix += translator.open_parts()
        async for frame in _run_stream(
            services, reply_id, 0, translator, prefix, stop=False, batches=batches
        ):
            yield frame
    finally:
        await batches.aclose()  # type: ignore[attr-defined]


class StopResult(BaseModel):
    success: bool = Field(description="True once the run's ending is stored (also when none was running).")


@router.post("/{thread_id}/stop", response_model=StopResult, responses={202: {"model": StopResult}})
async def stop(thread_id: ThreadId, owner: OwnerDep, services: ServicesDep) -> StopResult | JSONResponse:
    """Stop the thread's running (or waiting) run on whichever process runs it. Idempotent.

    The open stream closes its text message and tool calls, answers every unanswered call,
    and ends with RUN_FINISHED (outcome `cancelled`); the stored reply holds exactly what it
    carried. 202 with `success: false` if the process running it did not confirm within
    STOP_WAIT_SECONDS. Any body is accepted and not read.
    """
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, thread_id)
    if conversation is None or conversation.active_reply_id is None:
        return StopResult(success=True)
    if not await stop_reply(services, conversation.active_reply_id, reason="user"):
        return JSONResponse(StopResult(success=False).model_dump(), status_code=202)
    return StopResult(success=True)
