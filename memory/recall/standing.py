"""Standing memories: what a user said about themselves, kept at the start of a conversation.

Recall shows each reply the memories that match its question, and a model server reads
every token of them before the reply's first token, reply after reply. A user's own short
statements ("My sister Mara lives in Porto.") answer many of the questions asked later, and
the same few matter in conversation after conversation. With ``MEMORY_STANDING_TOKENS``
above 0, a conversation's first reply is also given the user's newest statements from
earlier conversations, oldest first, in a block of their own at the start of its part
(memory/prompt/context.py); the block is stored with that part and shown again, byte for
byte, with that message in every later prompt of the conversation. Until the user says
something new, every new conversation begins with the same block, so it joins the prefix the
model server caches (llama-server's prompt cache, hosted prompt-cache discounts): the first
conversation after a change reads it, the next ones do not. A reply's recalled memories
leave out what the block shows.

A statement is a visible memory item in the user's own words (a chunk of one of their
turns, or a fact they stated), short (at most ``MAX_CHARS``), not a question, and about the
speaker (a first-person word: "I", "my", "我"...). This is a cheap test, not understanding:
"Can you help me with my essay" passes it. The block's token budget keeps the newest that
fit. A statement forgotten, corrected or deleted since a block showed it leaves that block
when the conversation's next prompt is built, as any shown memory does.
"""

from __future__ import annotations

import re
import uuid

from sqlalchemy.ext.asyncio import AsyncSession

from memory.recall.found import FoundMemory
from memory.recall.items import latest_in_own_words
from memory.record.conversations import Owner

# A statement longer than this is a message about something else, not one about the user.
MAX_CHARS = 300
# Nor is one shorter than this ("ok", "thanks!").
MIN_CHARS = 8
# The newest items read: more than a block of MEMORY_STANDING_TOKENS holds after the questions.
CANDIDATES = 40

_QUESTION_ENDS = ("?", "？")
_FIRST_PERSON = re.compile(r"\b(?:i|i'm|i've|i'd|i'll|me|my|mine|myself|we|our|us)\b|我", re.IGNORECASE)


def is_statement(text: str) -> bool:
    """Whether the user's `text` reads as something they said about themselves (see the module)."""
    words = " ".join(text.split()).replace("’", "'")
    return (
        MIN_CHARS <= len(words) <= MAX_CHARS
        and not words.endswith(_QUESTION_ENDS)
        and _FIRST_PERSON.search(words) is not None
    )


async def standing_memories(
    session: AsyncSession, owner: Owner, *, besides: uuid.UUID | None
) -> list[FoundMemory]:
    """The owner's newest statements outside conversation `besides`, oldest first, one per text."""
    newest = await latest_in_own_words(session, owner, limit=CANDIDATES, max_chars=MAX_CHARS, besides=besides)
    seen: set[str] = set()
    kept: list[FoundMemory] = []
    for memory in newest:
        text = " ".join(memory.text.split()).casefold()
        if is_statement(memory.text) and text not in seen:
            seen.add(text)
            kept.append(memory)
    return kept[::-1]
