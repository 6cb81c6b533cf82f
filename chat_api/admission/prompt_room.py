"""Prompt room: a client's system text that leaves the reply no room in the prompt is refused.

A client's system text (chat completions' `system`/`developer` messages, the Responses API's
`instructions` and system items, the AI SDK's and AG-UI's system messages and context) goes
into the system message after chatmem's own. The part of the prompt no budget can shorten
(`memory.prompt.context.fixed_tokens`: both system texts, the time and the new user message)
must fit CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS; past that the history got no room and
the prompt went out over the budget. The memory block is not counted: it shrinks to what is
left (`PromptWindow.part_room`) rather than refuse the request.

Only a request whose system text is what does not fit is refused here: a user message that
alone fills the room is held to MAX_MESSAGE_CHARS only, and the current exchange is sent whole
even over the budget, with or without a system text beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

from anyio import to_thread

from memory.errors import InvalidInput
from memory.prompt.context import fixed_tokens

if TYPE_CHECKING:
    from chat_api.replies.prompt import Prompter


def check_prompt_room(
    prompter: Prompter, instructions: str | None, user_text: str | None, *, field: str
) -> None:
    """InvalidInput naming `field` (the client's system text) when, with chatmem's system prompt and
    the new message, it does not fit the prompt's room. Counted as the prompt builder counts."""
    if not instructions:
        return
    budget = prompter.budget
    now = datetime.now(UTC)
    fixed = fixed_tokens(prompter.prompts, instructions, user_text, now)
    if fixed <= budget.prompt_room:
        return
    if fixed_tokens(prompter.prompts, None, user_text, now) > budget.prompt_room:
        # The new message alone does not fit: the system text is not what is too long, and the
        # message is answered as it would be without one (sent whole, as above).
        return
    raise InvalidInput(
        f"the system prompt is too long: with chatmem's own and the new message it comes to "
        f"~{fixed} tokens, more than the {budget.prompt_room} a prompt may take "
        "(CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS); shorten it",
        field=field,
        prompt_tokens=fixed,
        max_prompt_tokens=budget.prompt_room,
    )


async def check_prompt_room_off_loop(
    prompter: Prompter, instructions: str | None, user_text: str | None, *, field: str
) -> None:
    """`check_prompt_room` in a worker thread: counting a long text holds the GIL for milliseconds."""
    if instructions:
        await to_thread.run_sync(partial(check_prompt_room, prompter, instructions, user_text, field=field))


def longest_field(parts: Sequence[tuple[str, str]], default: str) -> str:
    """The field of the longest of the (field, text) parts a system text was joined from: what a
    refusal of it names (`default` when there are none)."""
    return max(parts, key=lambda part: len(part[1]))[0] if parts else default
