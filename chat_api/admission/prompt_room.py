"""Prompt room: a new message, or a client's system text, that leaves the reply no room is refused.

The part of a prompt no budget can shorten (`memory.prompt.context.fixed_tokens`: chatmem's
system prompt with the client's system text, the time and the new user message) must fit
CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS; the current exchange is sent whole, so past that
the prompt went to the model over the budget, and the model server refused or cut it mid-stream.
The memory block is not counted: it shrinks to what is left (`PromptWindow.part_room`) rather
than refuse the request. Counted as the prompt builder counts, before anything is stored:

- a new message that alone (with chatmem's system prompt and the time) does not fit is
  `ContextLengthExceeded` naming the message as sent, whatever system text is beside it;
- else a client's system text (chat completions' `system`/`developer` messages, the Responses
  API's `instructions` and system items, the AI SDK's and AG-UI's system messages and context)
  that with them does not fit is `ContextLengthExceeded` naming the system text.

MAX_MESSAGE_CHARS is a bound in characters on every stored text (history and imports too, which
need no room: the window leaves out what does not fit); a character count cannot promise a token
count, so this is what holds a new message to what a prompt can take.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING

from anyio import to_thread

from memory.errors import ContextLengthExceeded
from memory.prompt.context import fixed_tokens

if TYPE_CHECKING:
    from chat_api.replies.prompt import Prompter


# Counting a text this short holds the GIL ~0.2 ms (2,000 characters: ~0.6 ms, 27,000: ~9 ms):
# no worker thread for it.
INLINE_COUNT_CHARS = 500


def check_prompt_room(
    prompter: Prompter,
    instructions: str | None,
    user_text: str | None,
    *,
    message_field: str,
    instructions_field: str = "instructions",
) -> None:
    """ContextLengthExceeded naming `message_field` when the new message alone leaves no room; else
    the same naming `instructions_field` when the client's system text is what leaves none."""
    budget = prompter.budget
    now = datetime.now(UTC)
    base = fixed_tokens(prompter.prompts, None, None, now)
    alone = fixed_tokens(prompter.prompts, None, user_text, now)
    if user_text and alone > budget.prompt_room:
        raise ContextLengthExceeded(
            f"the message is too long: it comes to ~{alone - base} tokens and at most "
            f"{max(0, budget.prompt_room - base)} fit (CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS is "
            f"{budget.prompt_room}, and chatmem's system prompt and the time take {base}); shorten it",
            field=message_field,
            message_tokens=alone - base,
            max_message_tokens=max(0, budget.prompt_room - base),
        )
    if not instructions:
        return
    fixed = fixed_tokens(prompter.prompts, instructions, user_text, now)
    if fixed <= budget.prompt_room:
        return
    raise ContextLengthExceeded(
        f"the system prompt is too long: with chatmem's own and the new message it comes to "
        f"~{fixed} tokens, more than the {budget.prompt_room} a prompt may take "
        "(CONTEXT_MAX_TOKENS less REPLY_RESERVE_TOKENS); shorten it",
        field=instructions_field,
        prompt_tokens=fixed,
        max_prompt_tokens=budget.prompt_room,
    )


async def check_prompt_room_off_loop(
    prompter: Prompter,
    instructions: str | None,
    user_text: str | None,
    *,
    message_field: str,
    instructions_field: str = "instructions",
) -> None:
    """`check_prompt_room`, in a worker thread unless the texts are short: counting a long text holds
    the GIL for milliseconds."""
    check = partial(
        check_prompt_room,
        prompter,
        instructions,
        user_text,
        instructions_field=instructions_field,
        message_field=message_field,
    )
    if instructions or len(user_text or "") > INLINE_COUNT_CHARS:
        await to_thread.run_sync(check)
    else:
        check()


def longest_field(parts: Sequence[tuple[str, str]], default: str) -> str:
    """The field of the longest of the (field, text) parts a system text was joined from: what a
    refusal of it names (`default` when there are none)."""
    return max(parts, key=lambda part: len(part[1]))[0] if parts else default
