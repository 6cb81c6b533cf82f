"""Runs replies: model → tools → model, with stop, checkpoints and exactly one ending.

Each reply runs as two tasks: the generation, and its supervisor. The supervisor waits
for whichever comes first, the generation ending or a stop request, and then decides
the one terminal status in one place:

- the generation returned          → completed (even if a stop arrived a moment later);
- the generation raised            → interrupted_by_error if anything was produced, else failed;
- stop came first                  → the generation is cancelled (closing the provider
                                     stream, cancelling a running tool) → interrupted_by_user;
- the generation parked the turn   → awaiting_approval: a tool that needs a person was
                                     called; nothing ran, the stream ends, and the reply is
                                     resumed later by `chat_api/replies/approve.py` (any process).

Only then is the terminal state written, with a conditional UPDATE (`WHERE status =
'streaming'`) so that the reaper and this runner can never both end a turn. The
terminal event is published to followers after the commit, so a client that saw
`turn.interrupted` can read the stored turn and find every delta it was sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.metrics import observe_first_token, observe_reply_end
from chat_api.observability import log_context
from chat_api.providers.base import (
    ChatProvider,
    ModelOptions,
    ProviderError,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
)
from chat_api.providers.textual_calls import TextualCalls, textual_tool_calls
from chat_api.replies.checkpoint import Checkpointer, give_back, take_unpersisted
from chat_api.replies.prompt import Prompter
from chat_api.replies.registry import ReplyRegistry
from chat_api.replies.reply import ASKED_OF_MODEL, Reply, ReplyRequest
from chat_api.tools import (
    RECALL_MEMORY,
    ToolContext,
    ToolFailed,
    ToolRegistry,
    begin_invocation,
    cancel_invocation,
    canonical_json,
    finish_invocation,
)
from memory.config import Settings
from memory.events import (
    PARKED_EVENT,
    USER_STOP_REASONS,
    ApprovalRequiredData,
    ErrorData,
    Event,
    EventData,
    EventName,
    StepStartedData,
    StopReason,
    ToolCallState,
    ToolResultData,
    ToolStartedData,
    TurnParkedData,
    TurnStatus,
)
from memory.json_values import JsonObject, JsonValue
from memory.prompt.context import ShownMemory, memories_still_shown
from memory.recall.forgetting import SHOWN_MEMORIES, lock_shown_memories
from memory.recall.recaller import Recaller
from memory.recall.remembering import DERIVATIVE, FORGOTTEN, repeats_only
from memory.record.approvals import earliest_expiry, park_turn
from memory.record.conversations import get_conversation
from memory.record.outbox import record_finished_turn
from memory.record.reply_endings import Ending, LiveState, end_reply
from memory.record.reply_state import notify_done
from memory.record.tool_calls import Approval, ToolCall
from memory.record.turns import add_turn, append_events, ending_of, finish_turn, note_reply_memory
from memory.storage.db import Database

log = logging.getLogger(__name__)

# What a generation returns: it ran to the end, or it parked the turn for a person.
FINISHED = "finished"
PARKED = "parked"


# Storing a reply's ending is tried again after these delays (doubling) while the database refuses it.
ENDING_RETRY_FIRST_DELAY = 0.1
ENDING_RETRY_MAX_DELAY = 2.0


class ReplyRunner:
    """Starts replies in this process and owns their tasks."""

    def __init__(
        self,
        *,
        db: Database,
        settings: Settings,
        provider: ChatProvider,
        tools: ToolRegistry,
        prompter: Prompter,
        checkpointer: Checkpointer,
        registry: ReplyRegistry,
        process_id: str,
        recaller: Recaller,
    ) -> None:
        self.db = db
        self.settings = settings
        self.provider = provider
        self.tools = tools
        self.prompter = prompter
        self.checkpointer = checkpointer
        self.registry = registry
        self.process_id = process_id  # names this process as the owner of the turns it streams
        self.recaller = recaller  # what the `recall_memory` tool searches with
        self._tasks: set[asyncio.Task[None]] = set()

    def launch(self, reply: Reply, request: ReplyRequest, *, resumed: bool = False) -> None:
        """Run the reply in the background; it outlives the request that started it.

        `resumed`: the reply was parked for approval and every call is now decided; it
        continues by running (or refusing) those calls, then the next model step.
        """
        reply.started_at = time.monotonic()
        reply.request = request
        task = asyncio.create_task(self._supervise(reply, request, resumed), name=f"reply-{reply.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every running reply and wait for their endings to be stored."""
        for reply in self.registry.all():
            reply.request_stop(StopReason.SHUTDOWN)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    # --- supervision ----------------------------------------------------------------

    async def _supervise(self, reply: Reply, request: ReplyRequest, resumed: bool) -> None:
        with log_context(
            tenant_id=reply.owner.tenant_id, conversation_id=reply.conversation_id, reply_id=reply.id
        ):
            await self._supervise_in_context(reply, request, resumed)

    async def _supervise_in_context(self, reply: Reply, request: ReplyRequest, resumed: bool) -> None:
        generation = asyncio.create_task(self._generate(reply, request, resumed), name=f"generate-{reply.id}")
        stop_wait = asyncio.create_task(reply.stop_requested.wait())
        try:
            await asyncio.wait({generation, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            if not generation.done():
                generation.cancel()
            await asyncio.wait({generation})
            # Stopped or failed before its recall: the query encoded for it is not kept.
            self.recaller.forget_query(reply.id)
        error: dict[str, str] | None = None
        if generation.cancelled():
            if reply.stop_reason in USER_STOP_REASONS:
                status = TurnStatus.INTERRUPTED_BY_USER
            else:
                status = TurnStatus.INTERRUPTED_BY_ERROR
                error = {"code": "server_shutdown", "message": "the server shut down during the reply"}
        elif (exc := generation.exception()) is not None:
            produced = bool(reply.content or reply.tool_calls or reply.turn_id != reply.id)
            status = TurnStatus.INTERRUPTED_BY_ERROR if produced else TurnStatus.FAILED
            if isinstance(exc, ProviderError):
                # The provider's own words (which may name the operator's account) go to the log only.
                log.warning("reply %s: the model failed: %s", reply.id, exc)
                error = {"code": "provider_error", "message": exc.public}
            else:  # a provider failing is expected; anything else is a bug
                log.error("reply %s failed", reply.id, exc_info=exc)
                error = {"code": "internal_error", "message": "the reply failed on the server"}
        elif generation.result() == PARKED:
            status = TurnStatus.AWAITING_APPROVAL
        else:
            status = TurnStatus.COMPLETED
            error = reply.ending_error
        try:
            await self._store_ending(reply, status, error)
        except Exception:
            # The turn stays `streaming` with its last checkpoint; the reaper will end it.
            log.exception("could not store the end of reply %s", reply.id)
            reply.publish(
                EventName.ERROR,
                ErrorData(code="storage_error", message="the reply's ending could not be stored"),
            )
            reply.finish(TurnStatus.STREAMING)
            self.registry.remove(reply.id)

    # --- generation -----------------------------------------------------------------

    async def _generate(self, reply: Reply, request: ReplyRequest, resumed: bool) -> str:
        window = await self.prompter.prepare(reply, request)
        steps = self.settings.max_tool_steps
        first_token = True
        ran: dict[str, str] = {}  # the calls this reply ran: canonical call -> its call id
        if resumed:
            await self._run_tools(reply, ran)
        step = int(resumed)
        answer_now = False  # the next step is sent no tools and told to answer in plain text
        while True:
            if step:
                await self._next_step(reply)
            final = answer_now or step >= steps
            # The first step is sent the window recall read; later ones read the turns they follow.
            messages = await self.prompter.messages(reply, window if step == 0 else None)
            if answer_now:
                messages = _told_to_answer(messages)
            tools = self._tool_schemas(reply, final=final, answer_now=answer_now)
            offered = {tool["function"]["name"] for tool in tools or ()}
            as_text = TextualCalls()
            upstream = self.provider.stream(messages, tools, _step_options(reply, step))
            stream = textual_tool_calls(upstream, offered, as_text)
            try:
                async for delta in stream:
                    if first_token and isinstance(delta, TextDelta | ToolCallDelta):
                        first_token = False
                        observe_first_token(time.monotonic() - reply.started_at)
                    if isinstance(delta, TextDelta):
                        if delta.text:
                            reply.add_text(delta.text)
                    elif isinstance(delta, ToolCallDelta):
                        reply.add_tool_delta(delta.index, delta.id, delta.name, delta.arguments)
                    elif isinstance(delta, StreamEnd):
                        reply.usage = dict(delta.usage)
                    self.checkpointer.note_progress(reply)
            finally:
                # Closing the stream closes the upstream connection: no more tokens are paid for.
                await stream.aclose()
                await upstream.aclose()
            if as_text.dropped:
                log.info(
                    "reply %s: tool calls written as text kept out of the answer: %s",
                    reply.id,
                    as_text.dropped,
                )
            if not reply.tool_calls:
                if not as_text.dropped or reply.content.strip():
                    return FINISHED
                if answer_now:
                    # Asked twice, the model still wrote only a call: an empty answer, never JSON.
                    error = ErrorData(code=TOOL_CALL_AS_TEXT, message="the model answered with a tool call")
                    reply.publish(EventName.ERROR, error)
                    reply.ending_error = {"code": TOOL_CALL_AS_TEXT, "message": error["message"]}
                    return FINISHED
                answer_now = True
                step += 1
                continue
            if _hand_back_to_client(reply):
                return FINISHED
            if self._park_for_approval(reply):
                return PARKED
            repeats_only = await self._run_tools(reply, ran)
            if final:
                return FINISHED
            answer_now = repeats_only
            step += 1

    def _tool_schemas(self, reply: Reply, *, final: bool, answer_now: bool) -> list[dict[str, Any]] | None:
        """The tools offered in one step: the server's and the client's (a client's shadows the server's).

        The server's are offered while it may still run them: not in the final step, not at all
        with MAX_TOOL_STEPS=0, and `recall_memory` only when MEMORY_TOOL=on and the reply's
        memory is on. The client's pass with MAX_TOOL_STEPS=0 too (their calls end the reply;
        the server runs nothing), but not in a step told to answer in plain text.
        """
        if answer_now:
            return None
        client = {tool["function"]["name"] for tool in reply.client_tools}
        server: list[dict[str, Any]] = []
        if not final:
            memory_off = self.settings.memory_tool == "off" or reply.memory_use != "on"
            schemas: list[dict[str, Any]] = [dict(schema) for schema in self.tools.schemas()]
            server = [
                schema
                for schema in schemas
                if schema["function"]["name"] not in client
                and not (memory_off and schema["function"]["name"] == RECALL_MEMORY.name)
            ]
        offers_client = not final or self.settings.max_tool_steps == 0
        return [*server, *(reply.client_tools if offers_client else ())] or None

    def _park_for_approval(self, reply: Reply) -> bool:
        """If a call needs a person, mark the step's calls as waiting and announce them; nothing runs.

        Every call of the step waits (the others run with the decided ones), so the results
        reach the model together, in the order it asked. A call whose arguments are not a
        JSON object is not put before a person: running it reports the error to the model.
        """
        needing = []
        for call in reply.tool_calls:
            tool = self.tools.get(call["name"])
            if tool is not None and tool.requires_approval and _json_object(call["arguments"]):
                needing.append((call, tool))
        if not needing:
            return False
        now = datetime.now(UTC)
        for call in reply.tool_calls:
            call["state"] = ToolCallState.READY
        for call, tool in needing:
            timeout = tool.approval_timeout_seconds
            expires = (now + timedelta(seconds=timeout)).isoformat() if timeout else None
            call["state"] = ToolCallState.AWAITING_APPROVAL
            call["approval"] = {"required": True, "expires_at": expires}
            reply.publish(
                EventName.TOOL_CALL_APPROVAL_REQUIRED,
                ApprovalRequiredData(
                    reply_id=str(reply.id),
                    turn_id=str(reply.turn_id),
                    call_id=call["id"],
                    index=call["index"],
                    name=call["name"],
                    arguments=call["arguments"],
                    expires_at=expires,
                ),
            )
        return True

    async def _next_step(self, reply: Reply) -> None:
        """End the step's assistant turn as completed and open the next one, atomically."""
        next_id = uuid.uuid4()
        async with self.db.transaction() as session:
            turn = await finish_turn(
                session,
                reply.turn_id,
                status=TurnStatus.COMPLETED,
                content=reply.content,
                tool_calls=reply.tool_calls,
                last_event_id=len(reply.events),
                usage=reply.usage or None,
                prompt_version=self.prompter.version,
            )
            if turn is None:
                raise RuntimeError("turn was ended by someone else")
            await record_finished_turn(session, turn)
            conversation = await get_conversation(session, reply.owner, reply.conversation_id)
            await add_turn(
                session,
                conversation,
                role="assistant",
                status=TurnStatus.STREAMING,
                reply_id=reply.id,
                turn_id=next_id,
                model=self.provider.model,
                owner=self.process_id,
            )
        reply.begin_step(next_id)
        reply.publish(EventName.STEP_STARTED, StepStartedData(reply_id=str(reply.id), turn_id=str(next_id)))

    async def _run_tools(self, reply: Reply, ran: dict[str, str]) -> bool:
        """Run each complete tool call once and store its result as a tool turn.

        A call identical (name and canonical arguments) to one this reply already ran is not
        run again: its result says so and points to the earlier call. Returns True when every
        call of the step was such a repeat (the model is going round in circles).
        """
        for call in reply.tool_calls:
            if call["state"] == ToolCallState.STREAMING:
                call["state"] = ToolCallState.READY
        repeats = 0
        for call in reply.tool_calls:
            key = _call_key(call)
            earlier = ran.get(key)
            shown: list[ShownMemory] = []  # the memories the call showed the model
            if earlier is not None and call["state"] != ToolCallState.REJECTED:
                repeats += 1
                result: JsonValue = {
                    "error": f"not run again: the same call ({earlier}) ran earlier in this reply; "
                    "use its result above"
                }
                state: str = ToolCallState.FAILED
            else:
                result, state = await self._run_one(reply, call, shown)
                ran[key] = call["id"]
            call["state"] = state
            content = json.dumps(result, ensure_ascii=False, default=str)
            async with self.db.transaction() as session:
                if shown:
                    # Shown a memory whose correction or forget committed since the tool read it,
                    # after it looked for the replies shown it: not remembered (as for a prompt's).
                    await lock_shown_memories(session, reply.owner, changing=False)
                    if not await memories_still_shown(session, shown):
                        await note_reply_memory(session, reply.id, FORGOTTEN)
                conversation = await get_conversation(session, reply.owner, reply.conversation_id)
                tool_turn = await add_turn(
                    session,
                    conversation,
                    role="tool",
                    status=TurnStatus.COMPLETED,
                    content=content,
                    reply_id=reply.id,
                    tool_call_id=call["id"],
                    name=call["name"],
                    meta={SHOWN_MEMORIES: [str(m.turn_id) for m in shown]} if shown else None,
                )
            reply.publish(
                EventName.TOOL_RESULT,
                ToolResultData(
                    turn_id=str(tool_turn.id),
                    call_id=call["id"],
                    name=call["name"],
                    state=state,
                    result=content,
                ),
            )
        return bool(reply.tool_calls) and repeats == len(reply.tool_calls)

    async def _run_one(self, reply: Reply, call: ToolCall, shown: list[ShownMemory]) -> tuple[JsonValue, str]:
        """Run one call; ``shown`` gets the turns whose memories it showed the model."""
        approval = call.get("approval", Approval())
        if call["state"] == ToolCallState.REJECTED:
            timed_out = approval.get("by") == "timeout"
            refusal: JsonObject = {
                "error": "nobody approved this tool call in time"
                if timed_out
                else "the user did not approve this tool call",
                "reason": approval.get("reason", ""),
            }
            return refusal, ToolCallState.REJECTED
        tool = self.tools.get(call["name"])
        if tool is None:
            return {"error": f"unknown tool {call['name']!r}"}, ToolCallState.FAILED
        if tool.requires_approval and approval.get("decision") != "approved":
            # Defence in depth: only a recorded approval lets such a tool run.
            return {"error": "this tool needs an approval that was not given"}, ToolCallState.FAILED
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except json.JSONDecodeError as exc:
            return {"error": f"arguments are not valid JSON: {exc.msg}"}, ToolCallState.FAILED
        if not isinstance(arguments, dict):
            return {"error": "arguments must be a JSON object"}, ToolCallState.FAILED
        key, known = await begin_invocation(
            self.db, reply.owner, reply.turn_id, call["index"], call["id"], tool, arguments
        )
        if known is not None:
            return known.result, known.state
        call["state"] = ToolCallState.RUNNING
        reply.publish(
            EventName.TOOL_STARTED,
            ToolStartedData(turn_id=str(reply.turn_id), call_id=call["id"], name=call["name"]),
        )
        context = ToolContext(
            owner=reply.owner,
            conversation_id=reply.conversation_id,
            turn_id=reply.turn_id,
            db=self.db,
            recaller=self.recaller,
            shown=shown,
        )
        try:
            result = await tool.func(arguments, context)
        except asyncio.CancelledError:
            call["state"] = ToolCallState.CANCELLED
            call["side_effect_may_have_happened"] = tool.side_effects
            # Recorded even though this task is being cancelled: the shield lets the write finish.
            await asyncio.shield(
                cancel_invocation(self.db, key, side_effect_may_have_happened=tool.side_effects)
            )
            raise
        except ToolFailed as exc:
            result, state = {"error": str(exc)}, ToolCallState.FAILED
        except Exception as exc:
            log.warning("tool %s failed: %s", tool.name, exc)
            result, state = {"error": f"{type(exc).__name__}: {exc}"}, ToolCallState.FAILED
        else:
            state = ToolCallState.SUCCEEDED
        await finish_invocation(self.db, key, state, result)
        return result, state

    # --- the ending -----------------------------------------------------------------

    async def _store_ending(self, reply: Reply, status: str, error: dict[str, str] | None) -> None:
        """`_finalize`, tried again while the database refuses it, for up to the heartbeat timeout.

        A blip (Postgres restarting, connections cut) must not cost the text the user saw:
        this process still holds all of it, and live followers wait for the ending. The reply
        stays registered meanwhile, so its heartbeat goes on once the database is back. Past
        the heartbeat timeout it is left to the reaper, as a dead process's reply would be.
        """
        deadline = time.monotonic() + self.settings.heartbeat_timeout_seconds
        delay = ENDING_RETRY_FIRST_DELAY
        while True:
            try:
                await self._finalize(reply, status, error)
                return
            except (SQLAlchemyError, OSError):  # the database, not a bug: a bug is not tried again
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("could not store the end of reply %s yet; trying again", reply.id, exc_info=True)
            await asyncio.sleep(delay)
            delay = min(delay * 2, ENDING_RETRY_MAX_DELAY)

    async def _finalize(self, reply: Reply, status: str, error: dict[str, str] | None) -> None:
        """Store the ending (or the parking) with every event not stored yet, then tell followers."""
        # A checkpoint write under way holds events claimed before this ending: let it land first.
        while not reply.checkpoint_idle.is_set():
            await reply.checkpoint_idle.wait()
        claimed = take_unpersisted(reply)
        unsaved = reply.events[claimed.start :] if claimed else []
        try:
            async with self.db.transaction() as session:
                if status == TurnStatus.AWAITING_APPROVAL:
                    terminal = await self._park(session, reply, unsaved)
                else:
                    reason = reply.stop_reason if status == TurnStatus.INTERRUPTED_BY_USER else None
                    live = LiveState(
                        content=reply.content,
                        tool_calls=reply.tool_calls,
                        last_event_id=len(reply.events),
                        unsaved_events=unsaved,
                        usage=reply.usage,
                        prompt_version=self.prompter.version,
                    )
                    if reply.memory_use == "on" and repeats_only(reply.content, reply.shown_to_model):
                        # Before the ending writes the outbox row, which carries memory_use.
                        await note_reply_memory(session, reply.turn_id, DERIVATIVE)
                    terminal = await end_reply(
                        session, reply.turn_id, Ending(status, reason, error), live=live
                    )
        except BaseException:
            if claimed:
                give_back(reply, claimed)
            raise
        if terminal is None:
            # The reaper (or a stop from a process that found us dead) ended it first; theirs stands,
            # and is what this process's followers get. Its stored id can be below ids they already
            # have (it follows the last checkpoint): they get it numbered after them, and a resume
            # past the stored log is sent that same stored ending (`follow.follow_reply`).
            log.warning("reply %s was already ended elsewhere", reply.id)
            async with self.db.session() as session:
                stored = await ending_of(session, reply.turn_id)
            status = TurnStatus.INTERRUPTED_BY_ERROR
            if stored is not None:  # None: the turn is gone (erased with its conversation)
                reply.publish(EventName(stored.name), cast(EventData, stored.data))
                status = str(stored.data.get("status") or status)
        else:
            event = reply.publish(EventName(terminal.name), cast(EventData, terminal.data))
            assert event.id == terminal.id
        reply.persisted = len(reply.events)
        self.registry.remove(reply.id)
        reply.finish(status)
        observe_reply_end(status, time.monotonic() - reply.started_at, reply.usage)

    async def _park(self, session: AsyncSession, reply: Reply, unsaved: list[Event]) -> Event | None:
        """Store the parked turn with what the resume needs; None if it was ended elsewhere.

        Parking is not an ending: the conversation stays held, and a decision resumes the reply.
        """
        calls = reply.tool_calls
        terminal_id = len(reply.events) + 1
        parked = await park_turn(
            session,
            reply.turn_id,
            content=reply.content,
            tool_calls_json=json.dumps(calls, ensure_ascii=False),
            last_event_id=terminal_id,
            usage_json=json.dumps(reply.usage or None),
            prompt_version=self.prompter.version,
            meta_json=json.dumps(
                {"memory_scope": reply.request.memory_scope, ASKED_OF_MODEL: reply.asked_of_model()},
                ensure_ascii=False,
            ),
            expires_at=earliest_expiry(calls),
        )
        if not parked:
            return None
        data = TurnParkedData(
            reply_id=str(reply.id),
            turn_id=str(reply.turn_id),
            status=TurnStatus.AWAITING_APPROVAL,
            call_ids=[c["id"] for c in calls if c["state"] == ToolCallState.AWAITING_APPROVAL],
        )
        if reply.usage:
            data["usage"] = dict(reply.usage)
        terminal = Event(terminal_id, PARKED_EVENT, cast(JsonObject, data))
        await append_events(session, reply.id, reply.owner, [*unsaved, terminal])
        await notify_done(session, reply.id)
        return terminal


def _hand_back_to_client(reply: Reply) -> bool:
    """A step that called a client's tool ends the reply, its calls `ready` for the client to run.

    The server's calls of that step are not run either: the step's calls are answered
    together, by the client's next request.
    """
    client = {tool["function"]["name"] for tool in reply.client_tools}
    if not any(call["name"] in client for call in reply.tool_calls):
        return False
    for call in reply.tool_calls:
        call["state"] = ToolCallState.READY
    return True


def _step_options(reply: Reply, step: int) -> ModelOptions | None:
    """The client's model options for a step: a forced tool_choice binds the first step only.

    After a tool ran, the model must be free to answer (as the Agents SDK resets it), or a
    forced choice would call the tool again at every step.
    """
    options = reply.model_options
    if options is None or step == 0 or options.tool_choice in (None, "auto", "none"):
        return options
    return replace(options, tool_choice="auto")


# The error code of a reply whose model answered only with a tool call it could not make.
TOOL_CALL_AS_TEXT = "tool_call_as_text"

# Added to the prompt (never stored) of a step that must answer without tools.
ANSWER_NOW = "Answer the user now, in plain text, without calling any tool."


def _told_to_answer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the plain-text instruction appended to the last tool or user message."""
    told = list(messages)
    for i in range(len(told) - 1, -1, -1):
        if told[i].get("role") in ("tool", "user") and isinstance(told[i].get("content"), str):
            told[i] = {**told[i], "content": f"{told[i]['content']}\n\n{ANSWER_NOW}"}
            break
    return told


def _call_key(call: ToolCall) -> str:
    """A call's identity within one reply: its name and its arguments, canonically."""
    try:
        arguments: JsonValue = json.loads(call["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = call["arguments"]
    return f"{call['name']}\x1f{canonical_json(arguments)}"


def _json_object(raw: str) -> bool:
    try:
        return isinstance(json.loads(raw or "{}"), dict)
    except json.JSONDecodeError:
        return False
