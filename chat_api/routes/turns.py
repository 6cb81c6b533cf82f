"""One turn: read it, stop its reply, or (re)follow its events."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from chat_api.control import stop_reply
from chat_api.deps import OwnerDep, ServicesDep
from chat_api.ratelimit import RateLimitsDep, held_while_streaming
from chat_api.routes.messages import SSE_HEADERS
from chat_api.schemas import StopOut, TurnOut
from chat_api.streaming import sse_stream
from memory.errors import InvalidInput
from memory.models import TurnStatus
from memory.turns import get_turn, reply_turns

router = APIRouter(prefix="/v1/turns", tags=["turns"])


@router.get("/{turn_id}")
async def read_turn(turn_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> TurnOut:
    async with services.db.session() as session:
        return TurnOut.of(await get_turn(session, owner, turn_id))


@router.post("/{turn_id}/stop", response_model=StopOut, responses={202: {"model": StopOut}})
async def stop(turn_id: uuid.UUID, owner: OwnerDep, services: ServicesDep) -> StopOut | JSONResponse:
    """Stop the reply this turn belongs to, on whichever process runs it. Idempotent.

    200 with the reply's final turn once it has ended (also when it had ended before);
    202 if the process running it has not confirmed within STOP_WAIT_SECONDS.
    """
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    reply_id = turn.reply_id or turn.id
    ended = await stop_reply(services, reply_id, reason="user")
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
    limits: RateLimitsDep,
    after: Annotated[int | None, Query(ge=0)] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
) -> EventSourceResponse:
    """Replay the reply's events after `Last-Event-ID` (or `?after=`), then follow it live to the end."""
    position = after or 0
    if last_event_id is not None and after is None:
        if not last_event_id.strip().isdigit():
            raise InvalidInput("Last-Event-ID must be a non-negative integer", field="Last-Event-ID")
        position = int(last_event_id.strip())
    async with services.db.session() as session:
        turn = await get_turn(session, owner, turn_id)
    slot = limits.streams.acquire(owner)
    stream = sse_stream(services, turn.reply_id or turn.id, position, stop_on_disconnect=False)
    return EventSourceResponse(held_while_streaming(slot, stream), headers=SSE_HEADERS, ping=15)
