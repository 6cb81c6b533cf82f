"""Builds each model step's prompt: recalled memory plus the sanitized recent window."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from chat_api.replies.reply import Reply, ReplyRequest
from memory.config import Settings
from memory.context import BuiltContext, ContextBudget, MemoryItemView, TurnView, build_context
from memory.db import Database
from memory.prompts import PromptSet
from memory.turns import recent_turn_rows

# (reply, user_text, scope) -> (rewritten query, memory items, event payload)
MemoryRecall = Callable[[Reply, str, str], Awaitable[tuple[str, list[MemoryItemView], dict[str, Any]]]]


class Prompter:
    """Turns the stored conversation into provider messages, one step at a time."""

    def __init__(
        self, db: Database, settings: Settings, prompts: PromptSet, recall: MemoryRecall | None = None
    ) -> None:
        self.db = db
        self.prompts = prompts
        self.budget = ContextBudget.from_settings(settings)
        self.recall = recall
        # Enough rows that the window (counted in tool-call groups) can fill after sanitizing.
        self.load_limit = settings.context_max_turns * 4 + 20

    @property
    def version(self) -> str:
        return self.prompts.version

    async def prepare(self, reply: Reply, request: ReplyRequest) -> None:
        """Recall long-term memory once per reply and announce it to the client."""
        if self.recall is None or request.memory_scope == "none":
            return
        _rewritten, items, payload = await self.recall(reply, request.user_text, request.memory_scope)
        reply.memories = items
        reply.publish("memory.retrieved", payload)

    async def context_for(self, conversation_id: Any, memory: Sequence[MemoryItemView] = ()) -> BuiltContext:
        """What the model would be sent for this conversation right now."""
        async with self.db.session() as session:
            rows = await recent_turn_rows(session, conversation_id, self.load_limit)
        return build_context(
            [TurnView.from_row(row) for row in rows], prompts=self.prompts, budget=self.budget, memory=memory
        )

    async def messages(self, reply: Reply) -> list[dict[str, Any]]:
        """The provider messages for the reply's next model step."""
        built = await self.context_for(reply.conversation_id, reply.memories)
        return built.messages
