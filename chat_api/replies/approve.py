"""Deciding tool calls that wait for a person, and resuming their replies on this process.

A parked reply has no process: its state is the turn row and the stored event log. Any
process that receives a decision (or finds a timeout passed) takes the row lock, records
the decision as an event of the reply, and, once no call is left waiting, takes the
turn back to `streaming` under its own process id and runs the rest of the reply here,
exactly as if it had never stopped: the calls run (or their rejection becomes the
result), the next model step streams, and event ids go on from the stored log. So a
decision made after every process restarted works the same as one made a second later.

Stopping a parked reply needs no runner at all: `memory.record.reply_endings.end_parked_reply`
writes the ending under the same row lock, so a stop and an approval racing each other
leave exactly one outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.metrics import observe_approval
from chat_api.replies.reply import ASKED_OF_MODEL, Reply, ReplyRequest
from memory.events import Event, EventName, ToolCallDecidedData
from memory.json_values import JsonObject
from memory.record.approvals import (
    Decision,
    decide_call,
    expired_call_ids,
    expired_turns,
    lock_turn,
    take_for_resume,
    waiting_calls,
)
from memory.record.branches import user_turn_before
from memory.record.conversations import Owner
from memory.record.tool_calls import tool_calls_of
from memory.record.turns import append_events, load_events
from memory.storage.models import Turn

if TYPE_CHECKING:
    from chat_api.admission import AdmittedReply
    from chat_api.services import Services

log = logging.getLogger(__name__)


# A reply rebuilt from its parked turn, and what its runner needs to continue it.
Resumed = tuple[Reply, ReplyRequest]


@dataclass(frozen=True)
class Decided:
    """The outcome of one decision: the reply resumed here, or still waits for other calls."""

    reply_id: uuid.UUID
    turn_id: uuid.UUID
    after: int  # the reply's last event id before the decision: stream from here
    resumed: bool


async def decide(
    services: Services,
    owner: Owner,
    turn_id: uuid.UUID,
    call_id: str,
    decision: Decision,
    *,
    admitted: AdmittedReply,
) -> Decided:
    """Record a person's decision on one call; the last decision resumes the reply here.

    `admitted` is the admission of the reply this may resume (chat_api.admission).
    """
    resumed: Resumed | None = None
    try:
        async with services.db.transaction() as session:
            turn = await lock_turn(session, owner, turn_id)
            after = turn.last_event_id
            await _record(session, turn, [call_id], decision)
            resumed = await _resume_if_decided(services, session, turn)
            if resumed is not None:
                admitted.registered()  # the registry counts it now: no await in between
    except BaseException:
        if resumed is not None:
            services.registry.remove(resumed[0].id)
        raise
    if resumed is not None:
        services.runner.launch(*resumed, resumed=True)
    return Decided(turn.reply_id or turn.id, turn.id, after, resumed=resumed is not None)


async def _record(session: AsyncSession, turn: Turn, call_ids: list[str], decision: Decision) -> None:
    """Decide the calls and append one event per decision to the reply's stored log."""
    events = []
    for call_id in call_ids:
        call = decide_call(turn, call_id, decision)
        data = ToolCallDecidedData(
            reply_id=str(turn.reply_id or turn.id),
            turn_id=str(turn.id),
            call_id=call_id,
            name=call.get("name"),
            by=decision.by,
        )
        if decision.approved:
            data["arguments"] = call.get("arguments")
            data["arguments_edited"] = bool(call["approval"].get("arguments_edited"))
        else:
            data["reason"] = decision.reason or ""
        turn.last_event_id += 1
        observe_approval("approved" if decision.approved else "rejected", decision.by)
        name = EventName.TOOL_CALL_APPROVED if decision.approved else EventName.TOOL_CALL_REJECTED
        events.append(Event(turn.last_event_id, name, cast(JsonObject, data)))
    await append_events(session, turn.reply_id or turn.id, Owner(turn.tenant_id, turn.user_id), events)


async def _resume_if_decided(services: Services, session: AsyncSession, turn: Turn) -> Resumed | None:
    """No call left waiting: take the turn back to streaming and rebuild its reply here."""
    if waiting_calls(tool_calls_of(turn.tool_calls)):
        return None
    take_for_resume(turn, services.process_id)
    await session.flush()
    reply_id = turn.reply_id or turn.id
    events = await load_events(session, reply_id, 0)
    user_turn = await _user_turn(session, turn)
    reply = Reply(reply_id, Owner(turn.tenant_id, turn.user_id), turn.conversation_id, user_turn.id)
    reply.restore(events, turn.id, turn.content or "", tool_calls_of(turn.tool_calls))
    reply.usage = dict(turn.usage or {})
    reply.restore_asked_of_model((turn.meta or {}).get(ASKED_OF_MODEL))
    scope = (turn.meta or {}).get("memory_scope") or services.settings.memory_scope
    # Registered before commit, like a new reply: a stop sent the moment the turn is
    # visible as streaming again must find it here.
    services.registry.add(reply)
    return reply, ReplyRequest(user_text=user_turn.content or "", memory_scope=scope)


async def _user_turn(session: AsyncSession, turn: Turn) -> Turn:
    """The user message this reply answers, on the turn's own branch (a regenerated reply's is older)."""
    found = await user_turn_before(session, turn)
    if found is None:
        raise RuntimeError(f"turn {turn.id} answers no user message")
    return found


class ApprovalTimeouts:
    """The periodic loop that rejects calls nobody decided in time, and resumes their replies."""

    def __init__(self, services: Services, *, interval_seconds: float) -> None:
        self.services = services
        self.interval = interval_seconds

    async def sweep_once(self) -> int:
        """Reject every expired waiting call now; returns how many calls."""
        if self.services.drain.draining:
            # A reply resumed here now would be stopped as a shutdown at the drain's end: the
            # sweep of another replica (or of this deployment's next start) resumes it instead.
            return 0
        resumed: list[Resumed] = []
        rejected = 0
        try:
            async with self.services.db.transaction() as session:
                now = (await session.execute(select(func.now()))).scalar_one()
                for turn in await expired_turns(session):
                    call_ids = expired_call_ids(turn, now)
                    if not call_ids:
                        continue
                    decision = Decision(approved=False, by="timeout", reason="no decision within the timeout")
                    await _record(session, turn, call_ids, decision)
                    rejected += len(call_ids)
                    if (pair := await _resume_if_decided(self.services, session, turn)) is not None:
                        resumed.append(pair)
        except BaseException:
            for reply, _ in resumed:
                self.services.registry.remove(reply.id)
            raise
        for reply, request in resumed:
            self.services.runner.launch(reply, request, resumed=True)
        return rejected

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if count := await self.sweep_once():
                    log.info("approval timeout rejected %d tool call(s)", count)
            except Exception:
                log.exception("approval timeout pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)
