"""Builds each model step's prompt: recalled memory plus the sanitized recent window.

The window is read and built once per reply before its first token: recall uses it (the
rewriter's history, the turns retrieval must not return again) and the first model step
is sent it, with the recalled memories. A reply started by a request reads its window's
rows in the transaction that stores its turns (`read_at_start`: no transaction of its own).
Later steps read the turns the reply added.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from chat_api.replies.recall import recall_for_reply, recalls
from chat_api.replies.reply import Reply, ReplyRequest
from memory.config import Settings
from memory.prompt.context import (
    BuiltContext,
    ContextBudget,
    PromptWindow,
    StoredWindow,
    prompt_from_window,
    read_stored_window,
    read_window,
    standing_that_fits,
    unless_still_shown,
    window_from,
)
from memory.prompt.templates import PromptSet
from memory.recall.forgetting import lock_shown_memories
from memory.recall.found import FoundMemory
from memory.recall.recaller import Recaller
from memory.recall.standing import standing_memories
from memory.record.turns import note_reply_memory
from memory.storage.db import Database

log = logging.getLogger(__name__)


class Prompter:
    """Turns the stored conversation into provider messages, one step at a time."""

    def __init__(self, db: Database, settings: Settings, prompts: PromptSet, recaller: Recaller) -> None:
        self.db = db
        self.prompts = prompts
        self.budget = ContextBudget.from_settings(settings)
        self.recaller = recaller

    @property
    def version(self) -> str:
        return self.prompts.version

    async def read_at_start(self, session: AsyncSession, reply: Reply) -> None:
        """Read the reply's window rows in the transaction that stores its turns (no transaction of
        its own before the first token); its first prompt is built from them."""
        await session.flush()  # the turns just added are in the window
        reply.stored_window = await read_stored_window(session, reply.conversation_id, self.budget)

    async def prepare(self, reply: Reply, request: ReplyRequest) -> PromptWindow:
        """Read the prompt window, recall long-term memory with it and announce it; returns the window."""
        stored, reply.stored_window = reply.stored_window, None
        window = await self.window_for(reply.conversation_id, reply.instructions, stored)
        if recalls(request.memory_scope, window.use_memory):
            if request.memory_scope == "user" and window.opens_conversation and self.budget.standing_tokens:
                await self._read_standing(reply)
            await recall_for_reply(self.recaller, reply, request.user_text, request.memory_scope, window)
        else:
            reply.memory_use = "off"
            self.recaller.forget_query(reply.id)  # memory was switched off since it was accepted
        return window

    async def _read_standing(self, reply: Reply) -> None:
        """The statements a conversation's first reply begins with (memory.recall.standing), if any."""
        if reply.nothing_stored is not None:
            return  # nothing to find: the user had no memory when the reply was accepted
        try:
            async with self.db.session() as session:
                found = await standing_memories(session, reply.owner, besides=reply.conversation_id)
            reply.standing = standing_that_fits(found, self.prompts, self.budget)
        except Exception:
            # Memory is an aid: the reply goes on with what recall found.
            log.exception("standing memories for reply %s could not be read", reply.id)

    async def window_for(
        self, conversation_id: uuid.UUID, instructions: str | None = None, stored: StoredWindow | None = None
    ) -> PromptWindow:
        """The conversation's recent window as it stands now (one read), or as `stored` read it.

        A client's `instructions` go into the system message, so the history gets that much less.
        """
        prompts, budget = self.prompts, self.budget
        if stored is not None:  # the rows to read do not depend on the instructions
            return window_from(stored, prompts=prompts, budget=budget, instructions=instructions)
        return await read_window(
            self.db, conversation_id, prompts=prompts, budget=budget, instructions=instructions
        )

    def prompt(
        self, window: PromptWindow, memory: Sequence[FoundMemory] = (), standing: Sequence[FoundMemory] = ()
    ) -> BuiltContext:
        """The whole prompt: the system message, then the window with the reply's part (standing
        memories, the time and the recalled memories that fit) before its user's words."""
        return prompt_from_window(
            window, prompts=self.prompts, budget=self.budget, memory=memory, standing=standing
        )

    async def context_for(
        self, conversation_id: uuid.UUID, memory: Sequence[FoundMemory] = ()
    ) -> BuiltContext:
        """What the model would be sent for this conversation right now."""
        return self.prompt(await self.window_for(conversation_id), memory)

    async def messages(self, reply: Reply, window: PromptWindow | None = None) -> list[dict[str, Any]]:
        """The provider messages for the reply's next model step, from `window` if it is still current.

        The part the first step shows before the user's words (memories, time) is stored on
        the reply's first turn: its later steps and later replies show the same text there.
        """
        if window is None:
            window = await self.window_for(reply.conversation_id, reply.instructions)
        built = self.prompt(window, reply.memories, reply.standing)
        first_step = reply.turn_id == reply.id
        shown = built.new_part if first_step else None
        async with self.db.transaction() as session:
            unless_shown = None
            if shown is not None and shown.memories:
                # Recalled before a correction or forget of one of them committed, and stored after
                # it looked for the replies shown it: not remembered (memory/recall/forgetting.py).
                # Checked under the lock by the note itself (one statement fewer before the token).
                await lock_shown_memories(session, reply.owner, changing=False)
                unless_shown = unless_still_shown(shown.memories)
            # The searched query is stored for auditing with this write, not in the search (fewer
            # statements before the first token).
            query = reply.rewritten_query if first_step else None
            part = shown.to_json() if shown is not None else None
            await note_reply_memory(
                session,
                reply.turn_id,
                reply.memory_use,
                part,
                rewritten_query=query,
                forgotten_if=unless_shown,
            )
        messages = built.messages
        reply.shown_to_model = "\n".join(_user_text(m) for m in messages if m.get("role") == "user")
        if reply.instructions:
            # Inside the one system message (some chat templates take no second one).
            system = messages[0]
            messages[0] = {**system, "content": f"{system['content']}\n\n{reply.instructions}"}
        return messages


def _user_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""
