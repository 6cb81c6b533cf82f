"""One turn: read it, stop its reply, (re)follow its events, or decide its waiting tool calls."""

from __future__ import annotations

import json
import uuid
from typing import Annotated

from fastapi import Body, Header, Path, Query
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from chat_api.admission import Admission, AdmissionDep, check_text, door_router
from chat_api.deps import OwnerDep, ServicesDep, StopOwnerDep
from chat_api.replies import ReplyKind, decide, sse_stream, stop_reply, wait_reply_done
from chat_api.response_headers import STREAM_HEADERS
from chat_api.schemas import ApproveIn, DecisionOut, RejectIn, StopOut, TurnOut
from memory.errors import InvalidInput
from memory.events import StopReason, TurnStatus
from memory.record.approvals import Decision
from memory.record.conversations import Owner
from memory.record.turns import get_turn, reply_turns

router = door_router(prefix="/v1/turns", tags=["turns"])

# Event ids are Postgres integers: a larger position would fail the query mid-stream.
MAX_EVENT_ID = 2**31 - 1


@router.get("/{turn_id}")
async def read_turn(turn_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> TurnOut:
    async with services.db.session() as session:
        return TurnOut.of(await get_turn(session, owner, turn_id))


@router.post("/{turn_id}/stop", response_model=StopOut, responses={202: {"model": StopOut}})
async def stop(turn_id: uuid.UUID, owner: StopOwnerDep, services: ServicesDep) -> StopOut | JSONResponse:
    """Stop the reply this turn belongs to, on whichever process runs it. Idempotent.

    200 with the reply's final turn once it has ended (also when it had ended before);
    202 if the process running it has not confirmed within STOP_WAIT_SECONDS.
    """
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    reply_id = turn.reply_id or turn.id
    ended = await stop_reply(services, reply_id, reason=StopReason.USER)
    async with services.db.session() as session:
        turns = await reply_turns(session, reply_id)
    last = turns[-1] if turns else turn
    body = StopOut(status=last.status, turn=TurnOut.of(last))
    if not ended or last.status == TurnStatus.STREAMING:
        return JSONResponse(body.model_dump(mode="json"), status_code=202)
    return body


@router.get("/{turn_id}/events", response_class=EventSourceResponse)
async def events(
    turn_id: uuid.UUID,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    after: Annotated[int | None, Query(ge=0, le=MAX_EVENT_ID)] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
) -> EventSourceResponse:
    """Replay the reply's events after `Last-Event-ID` (or `?after=`), then follow it live to the end."""
    position = after or 0
    if last_event_id is not None and after is None:
        text = last_event_id.strip()
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_EVENT_ID:
            raise InvalidInput(
                f"Last-Event-ID must be an integer from 0 to {MAX_EVENT_ID}", field="Last-Event-ID"
            )
        position = int(text)
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    slot = admission.admit_stream(owner)
    stream = sse_stream(
        services, turn.reply_id or turn.id, position, on_disconnect="continue", kind=ReplyKind.FOLLOWED
    )
    return EventSourceResponse(slot.hold(stream), headers=STREAM_HEADERS, ping=15)


CallId = Annotated[str, Path(min_length=1, max_length=128)]


@router.post(
    "/{turn_id}/tool_calls/{call_id}/approve",
    response_model=None,
    responses={200: {"description": "SSE stream of the resumed reply, or the decision (stream=false)"}},
)
async def approve(
    turn_id: uuid.UUID,
    call_id: CallId,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    body: Annotated[ApproveIn | None, Body()] = None,
) -> EventSourceResponse | DecisionOut:
    """Approve a waiting tool call (optionally with edited arguments); the last decision resumes the reply.

    The call runs once, here, and the reply streams from the approval on (the stream
    starts with `tool_call.approved`). 404 for a turn or call that is not yours; 409 when
    the call is not waiting (already decided, stopped, or never needed approval).
    """
    body = body or ApproveIn.model_validate({})
    arguments = None
    if body.arguments is not None:
        arguments = json.dumps(body.arguments, ensure_ascii=False)
        if len(arguments) > services.settings.max_message_chars:
            raise InvalidInput("arguments are too long", field="arguments")
    decision = Decision(approved=True, by="user", arguments=arguments)
    return await _decided(turn_id, call_id, decision, body.stream, owner, services, admission)


@router.post(
    "/{turn_id}/tool_calls/{call_id}/reject",
    response_model=None,
    responses={200: {"description": "SSE stream of the resumed reply, or the decision (stream=false)"}},
)
async def reject(
    turn_id: uuid.UUID,
    call_id: CallId,
    owner: OwnerDep,
    services: ServicesDep,
    admission: AdmissionDep,
    body: Annotated[RejectIn | None, Body()] = None,
) -> EventSourceResponse | DecisionOut:
    """Reject a waiting tool call: it never runs, and the model is told, with the reason, as its result."""
    body = body or RejectIn.model_validate({})
    check_text(body.reason, field="reason", allow_empty=True)  # a NUL here was a 500 when stored
    decision = Decision(approved=False, by="user", reason=body.reason)
    return await _decided(turn_id, call_id, decision, body.stream, owner, services, admission)


async def _decided(
    turn_id: uuid.UUID,
    call_id: str,
    decision: Decision,
    stream: bool,
    owner: Owner,
    services: ServicesDep,
    admission: Admission,
) -> EventSourceResponse | DecisionOut:
    # Admitted before the decision is stored, so a 429 leaves the call waiting.
    with admission.admit_reply(owner, stream=stream) as admitted:
        decided = await decide(services, owner, turn_id, call_id, decision, admitted=admitted)
    if stream:
        # A decision's body has no on_disconnect: leaving never stops the reply it resumed.
        events = sse_stream(
            services, decided.reply_id, decided.after, on_disconnect="continue", kind=ReplyKind.RESUMED
        )
        return EventSourceResponse(admitted.stream(events), headers=STREAM_HEADERS, ping=15)
    if decided.resumed:
        await wait_reply_done(services, decided.reply_id, timeout=None)
    async with services.db.session() as session:
        turns = await reply_turns(session, decided.reply_id)
    status = next((t.status for t in reversed(turns) if t.role == "assistant"), TurnStatus.FAILED)
    return DecisionOut(status=status, resumed=decided.resumed, turns=[TurnOut.of(t) for t in turns])
