"""AG-UI's endpoints: what `@ag-ui/client`'s HttpAgent, CopilotKit and assistant-ui's AG-UI runtime call.

- `POST /v1/ag-ui`: a `RunAgentInput`; answers the run as AG-UI events over SSE
  (`run.py` beside this module translates the reply's events).
- `POST /v1/ag-ui/{threadId}/stop`: stop the thread's running run, on any replica.
- `POST /v1/ag-ui/{threadId}/connect`: join the thread's running run after a reload or a
  dropped connection (a snapshot of the thread, then the run's events live).

The thread id is a client chat id (`memory/record/ai_sdk_chats.py`): one of the caller's
conversations, made on first use. The stored history is the truth: of `messages` only the
last one (and the id before it) is read. Everything that can be refused is refused before
the stream starts, in chatmem's error body; nothing is stored for a refused request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Annotated, Any

from ag_ui.core import (
    BaseEvent,
    RunFinishedEvent,
)
from fastapi import Body, Path, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.admission import AdmissionDep, check_prompt_room_off_loop, checked, door_router
from chat_api.admission.lists import is_long
from chat_api.deps import OwnerDep, ServicesDep, StopOwnerDep
from chat_api.protocols.ag_ui.input import LISTS, RunAgentInput, RunRequest, check_ids, read_run
from chat_api.protocols.ag_ui.interrupts import (
    active_history,
    checked_answers,
    interrupt_again,
    parked_turn,
    resume,
    steered_away,
)
from chat_api.protocols.ag_ui.run import (
    MEDIA_TYPE,
    RunTranslator,
    encode,
    now_ms,
    speaks_1_0,
)
from chat_api.protocols.ag_ui.streams import idempotency_key, joined_stream, run_key, start_and_stream
from chat_api.protocols.ag_ui.thread import (
    CLIENT_MESSAGE_ID,
    RUN_ID,
    snapshot,
    thread_messages,
)
from chat_api.response_headers import STREAM_HEADERS
from chat_api.services import Services
from memory.errors import DomainError, InvalidInput, NotFound
from memory.events import TurnStatus
from memory.record.ai_sdk_chats import CHAT_ID, find_chat, names_a_turn, remember_message_id, stop_of_chat
from memory.record.branches import (
    conversation_branch,
    fork_branch,
    history_newest_first,
    load_branch,
    user_turn_before,
    user_turn_named,
)
from memory.record.reply_state import reply_state
from memory.storage.models import Branch, Conversation, Turn

# isort: split
# The reply lifecycle's public seam, in this one block so that a move of those modules is one edit here.
from chat_api.replies import (
    NamedRun,
    RunNamed,
    Started,
    Stopped,
    answer_again,
    answer_tool_results,
    stop_conversation,
    store_message,
)

router = door_router(prefix="/v1/ag-ui", tags=["ag-ui"])


ThreadId = Annotated[str, Path(min_length=1, max_length=128, pattern=CHAT_ID.pattern)]
STREAM_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"description": "AG-UI events over SSE (`data: {event}`)", "content": {MEDIA_TYPE: {}}}
}


@router.post("", response_model=None, responses=STREAM_RESPONSE)
async def run(
    body: RunAgentInput, owner: OwnerDep, services: ServicesDep, admission: AdmissionDep
) -> Response:
    """Run the agent on the thread: answer its new message, client tool results, or interrupts."""
    body = await checked(body, *LISTS)
    # Reading the run walks its lists (49,000 context entries joined into the system text held the
    # event loop ~45-80 ms on 2 cores): with a long list, in a worker thread, as `checked` does.
    read = partial(read_run, body, max_message_chars=services.settings.max_message_chars)
    long_list = any(is_long(getattr(body, name)) for name in LISTS)
    request = await asyncio.to_thread(read) if long_list else read()
    user_text = request.user_message[1] if request.user_message is not None else None
    await check_prompt_room_off_loop(
        services.prompter,
        request.instructions,
        user_text,
        instructions_field=request.instructions_field,
        message_field=f"messages[{len(body.messages) - 1}].content",
    )
    steer_away = bool(request.answers) and request.user_message is not None
    before: list[BaseEvent] = []
    if request.answers and not steer_away:
        return await resume(request, owner, services, admission)
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, request.thread_id)
        if steer_away:
            # Every open interrupt cancelled and a new message instead: the waiting reply is
            # stopped (its calls never run) and the message is answered, as on_busy=interrupt does.
            if conversation is None:
                raise NotFound("thread not found", thread_id=request.thread_id)
            open_answers = await checked_answers(session, owner, conversation, request)
            if any(not a.cancelled for a, _ in open_answers):
                raise InvalidInput(
                    "a new message beside resume entries needs every interrupt cancelled",
                    field="resume",
                )
            request = replace(request, answers=(), on_busy="interrupt")
            before = steered_away(request, await active_history(session, conversation), open_answers)
        elif conversation is not None and conversation.active_reply_id is not None:
            parked = await parked_turn(session, conversation)
            if parked is not None:
                # The tool never runs without its answer: the waiting calls are asked again.
                history = thread_messages(await active_history(session, conversation))
                return interrupt_again(request.thread_id, request.run_id, request.modern, history, parked)
    if request.tool_results:
        if conversation is None:
            raise NotFound("thread not found", thread_id=request.thread_id)
        results = [(r.tool_call_id, r.content) for r in request.tool_results]
        ids = {r.tool_call_id: {CLIENT_MESSAGE_ID: r.message_id} for r in request.tool_results}

        async def begin_results(session: AsyncSession, locked: Conversation, reply_id: uuid.UUID) -> Started:
            started = await answer_tool_results(services, session, locked, reply_id, results, ids)
            await remember_message_id(session, started[0].id, RUN_ID, request.run_id)
            return started

        return await start_and_stream(services, owner, admission, request, conversation, begin_results, None)
    assert request.user_message is not None
    text = request.user_message[1]

    async def begin(session: AsyncSession, locked: Conversation, reply_id: uuid.UUID) -> Started:
        return await _begin_message(services, session, locked, reply_id, request)

    return await start_and_stream(services, owner, admission, request, conversation, begin, text, before)


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
    again = await user_turn_named(session, active, CLIENT_MESSAGE_ID, message_id)
    if again is not None:
        # The client sent a message chatmem already has as its last one: answer it again (a reload).
        parent = await load_branch(session, again.branch_id)
        await fork_branch(session, conversation, parent=parent, fork_seq=again.seq)
        started = await answer_again(services, session, conversation, reply_id, again)
    else:
        fork_seq = await _fork_point(session, active, request.previous_id)
        if fork_seq is not None:
            await fork_branch(session, conversation, parent=active, fork_seq=fork_seq)
        started = await store_message(
            services, session, conversation, reply_id, text, idempotency_key(request)
        )
        await remember_message_id(session, started[0].id, CLIENT_MESSAGE_ID, message_id)
    await remember_message_id(session, started[0].id, RUN_ID, request.run_id)
    return started


async def _fork_point(session: AsyncSession, active: Branch, previous_id: str | None) -> int | None:
    """Where the client's history ends, if before chatmem's: the seq a new branch keeps up to.

    None: the client's history ends where chatmem's does, or names nothing chatmem knows (a
    client that sends only the new message, say): the stored history wins, and the new
    message continues the active branch. Read newest first, so a long thread is not read
    whole (nor made AG-UI messages of) for every message.
    """
    if previous_id is None:
        return None
    newest: int | None = None
    reply_end: dict[uuid.UUID, int] = {}  # a reply's message ends with its last turn
    async with aclosing(history_newest_first(session, active)) as history:
        async for turn in history:
            newest = turn.seq if newest is None else newest
            if turn.role != "user" and turn.reply_id is not None:
                reply_end.setdefault(turn.reply_id, turn.seq)
                end = reply_end[turn.reply_id]
            else:
                end = turn.seq
            if previous_id in (message.id for message in thread_messages([turn])):  # the newest wins
                return None if end >= newest else end
    return None


@router.post("/{thread_id}/connect", response_model=None, responses=STREAM_RESPONSE)
async def connect(
    thread_id: ThreadId,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> Response:
    """Join the thread's running run: its RUN_STARTED, a snapshot of the thread, then its events live.

    The body is the RunAgentInput the client would send; only its `runId` and
    `protocolVersion` are read. When nothing runs, the run finishes at once (with the
    interrupts of a reply that waits for a person).
    """
    body = body or {}
    run_id = body.get("runId", str(uuid.uuid4()))
    if not isinstance(run_id, str):  # 5 or {} was read as "5", 0 or false as no run id
        raise InvalidInput("runId must be a string", field="runId")
    check_ids(thread_id, run_id)
    declared = body.get("protocolVersion")
    modern = speaks_1_0(declared if isinstance(declared, str) else None)
    async with services.db.session() as session:
        conversation = await find_chat(session, owner, thread_id)
        if conversation is None:
            raise NotFound("thread not found", thread_id=thread_id)
        turns = await active_history(session, conversation)
        reply_id = conversation.active_reply_id
        state = await reply_state(session, reply_id) if reply_id is not None else None
        parked = await parked_turn(session, conversation) if state == TurnStatus.AWAITING_APPROVAL else None
    if state is None or reply_id is None:
        translator = RunTranslator(thread_id, run_id, modern=modern)
        finished = RunFinishedEvent(thread_id=thread_id, run_id=run_id, timestamp=now_ms())
        body_bytes = encode([translator.run_started(), snapshot(thread_messages(turns)), finished])
        return Response(body_bytes, media_type=MEDIA_TYPE, headers=STREAM_HEADERS)
    reply_run_id = _run_id_of(turns, reply_id) or str(reply_id)
    if parked is not None:
        return interrupt_again(thread_id, reply_run_id, modern, thread_messages(turns), parked)
    slot = admission.admit_stream(owner)
    translator = RunTranslator(thread_id, reply_run_id, modern=modern)
    before = [t for t in turns if t.reply_id != reply_id or t.role == "user"]
    events = joined_stream(services, reply_id, translator, thread_messages(before))
    return StreamingResponse(slot.hold(events), media_type=MEDIA_TYPE, headers=STREAM_HEADERS)


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


class StopResult(BaseModel):
    success: bool = Field(description="True once the run's ending is stored (also when none was running).")


async def _run_id_named(request: Request) -> str | None:
    """The `runId` of a stop's JSON body, if it names one (any other body is accepted and ignored)."""
    if not await request.body():
        return None
    try:
        body = await request.json()
    except (DomainError, ValueError):
        return None
    run_id = body.get("runId") if isinstance(body, dict) else None
    return run_id if isinstance(run_id, str) else None


def _named_run(conversation: Conversation, run_id: str) -> RunNamed:
    """Where the run `run_id` names stands: driving the thread's running reply (the run kept on
    the user turn it answers, as `connect` finds it, or the reply's own id, which `connect`
    gives a reply started elsewhere), stored as an earlier run of the thread (kept on its user
    turn, or as its idempotency key), or not stored yet."""

    async def named(session: AsyncSession, running: uuid.UUID | None) -> NamedRun:
        if running is not None and (run_id == str(running) or await _drives(session, running, run_id)):
            return NamedRun.RUNNING
        if await names_a_turn(session, conversation.id, RUN_ID, run_id, run_key(run_id)):
            return NamedRun.ENDED
        return NamedRun.NOT_STORED

    return named


async def _drives(session: AsyncSession, reply_id: uuid.UUID, run_id: str) -> bool:
    """Whether `run_id` is the run that drives the reply now (a reload or a resume after an
    approval moves it onto the user turn the reply answers)."""
    reply = await session.get(Turn, reply_id)  # the reply's first turn: its id is the reply's
    asked = await user_turn_before(session, reply) if reply is not None else None
    return asked is not None and (asked.meta or {}).get(RUN_ID) == run_id


@router.post(
    "/{thread_id}/stop",
    response_model=StopResult,
    responses={
        202: {
            "model": StopResult,
            "description": "Accepted, not confirmed: the run's process did not confirm in time, or the "
            "stop is kept for a run not stored yet (a runId of no stored run, or a thread id the caller "
            "has not used yet), or the thread's conversation was deleted.",
        },
    },
)
async def stop(
    thread_id: ThreadId, request: Request, owner: StopOwnerDep, services: ServicesDep
) -> StopResult | JSONResponse:
    """Stop the thread's running (or waiting) run on whichever process runs it. Idempotent.

    A run that has ended answers 200 and stops nothing, also while a newer run of the thread
    streams.

    The open stream closes its text message and tool calls, answers every unanswered call,
    and ends with RUN_FINISHED (outcome `cancelled`); the stored reply holds exactly what it
    carried. 202 with `success: false` if the process running it did not confirm within
    STOP_WAIT_SECONDS. Any body is accepted; a JSON `{"runId": …}` naming a run of this
    thread still waiting in line (`on_busy: enqueue`) drops that run (its request answers
    409 `stopped_while_waiting`, nothing stored) and leaves the run ahead of it going.

    A stop can come before the run it means is stored, on any process: the client picked the
    runId. A `runId` of no stored run is kept for the thread's next run and answers 202 with
    `success: false` (accepted, not confirmed): if that run is the one starting, it starts
    stopped (RUN_FINISHED `cancelled`, stored `interrupted_by_user` and empty); any other run
    clears it. Without a runId, a stop that finds no run running is kept the same way for a
    run whose request had arrived before it, and answers 200. A thread id the caller has not
    used yet (another user's answers the same) may be the thread of a first run not served
    yet: the stop, with its runId if named, is kept for that thread's first run for a short
    while and answers 202 `success: false`. A thread whose conversation was deleted answers
    the same (nothing is kept for it): a stop never tells a deleted thread from one never used.
    """
    run_id = await _run_id_named(request)
    key = run_key(run_id) if run_id is not None else None
    async with services.db.transaction() as session:
        conversation = await stop_of_chat(session, owner, thread_id, key)
    if conversation is None:
        return JSONResponse(StopResult(success=False).model_dump(), status_code=202)
    if key is not None and services.queues.stop_waiting(conversation.id, key):
        return StopResult(success=True)  # dropped from the line here: nothing of it is stored
    stopped = await stop_conversation(
        services, conversation.id, key=key, named=_named_run(conversation, run_id) if run_id else None
    )
    if stopped is Stopped.ENDED:
        return StopResult(success=True)
    return JSONResponse(StopResult(success=False).model_dump(), status_code=202)
