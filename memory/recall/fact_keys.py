"""Fact keys: the short facts a user's message states about the user, as extra search keys.

A long message states a fact in passing ("…we moved to Porto in May, so which tiles…"); a
question about it ("Where do I live?") is far from the message's vector and shares few of
its words. With ``FACT_KEYS=model`` the indexer asks the rewrite model, once per user turn,
for those facts ("The user lives in Porto.") and writes each as a row of ``memory_items``
with ``kind = 'fact'`` pointing to the turn's chunk, like a sentence key: never a memory, a
search that matches it returns its chunk (``memory.recall.index_search``).

The model is asked inside a time box (``FACT_KEYS_TIMEOUT_SECONDS``); a late answer, a
provider error or an answer that is not a list of short facts gives no keys, and the turn is
indexed all the same. Only a user's own turns are asked (what the assistant said is not what
the user stated), and only messages of at least ``MIN_MESSAGE_CHARS`` (a short message is its
own key). At most ``MAX_FACTS`` facts of at most ``MAX_FACT_CHARS`` characters each; a line
that shares no word with the message is dropped (a small model invents). Never without a
real model: the demo provider has nothing to say about a message.

Facts depend on the model, not on the pipeline version: an index without them is not stale,
and a reindex copies the stored fact text (embedding it again) instead of asking again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from memory.prompt.templates import PromptSet
from memory.recall.keywords import query_terms
from memory.recall.rewrite import Complete

log = logging.getLogger(__name__)

# Messages shorter than this are not asked about: the message is its own key.
MIN_MESSAGE_CHARS = 100
# The most of a message the model is shown (about 1,000 tokens): the time box holds for long ones.
MAX_MESSAGE_CHARS = 4000
MAX_FACTS = 5
MAX_FACT_CHARS = 200
MIN_FACT_CHARS = 8
NO_FACTS = "NONE"

FactOutcome = Literal["facts", "none", "junk", "timeout", "error"]
_BULLET = re.compile(r"^\s*(?:[-*•·]|\d+[.)、]|[（(]?\d+[)）])\s*")
# Code, markup, JSON, a heading ("Facts:", "Here is what I found:") or a question is not a fact.
_NOT_A_FACT = re.compile(r"[{}<>`]|[:：?？]\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!。！])\s+")


@dataclass(frozen=True, slots=True)
class FactAnswer:
    """The facts of one message, how the request ended, and how long it took."""

    facts: tuple[str, ...]
    outcome: FactOutcome
    seconds: float


def wants_facts(text: str, *, role: str) -> bool:
    """True for a message worth asking about: a user's own, long enough to hide a fact."""
    return role == "user" and len(text.strip()) >= MIN_MESSAGE_CHARS


def fact_prompt(message: str, prompts: PromptSet) -> list[dict[str, Any]]:
    """The chat messages that ask the model for the facts ``message`` states about the user."""
    content = prompts.render("fact_keys", message=message.strip()[:MAX_MESSAGE_CHARS])
    return [{"role": "user", "content": content}]


def parse_facts(answer: str, message: str) -> tuple[str, ...] | None:
    """The facts of the model's answer; () when it says there are none, None when it is no fact list."""
    lines = [ln.strip() for ln in answer.strip().splitlines() if ln.strip()]
    if not lines:
        return None
    if lines[0].strip(" .。\"'").upper() == NO_FACTS:
        return ()
    said = set(query_terms(message))
    facts: list[str] = []
    # One fact a sentence: small models often write the facts as one paragraph.
    for sentence in (s for line in lines for s in _SENTENCE_END.split(_BULLET.sub("", line))):
        fact = sentence.strip().strip("\"'“”").strip()
        if not (MIN_FACT_CHARS <= len(fact) <= MAX_FACT_CHARS) or _NOT_A_FACT.search(fact):
            continue
        # A fact the message states shares a word with it; a line that shares none was invented.
        if not said.intersection(query_terms(fact)) or fact in facts:
            continue
        facts.append(fact)
        if len(facts) == MAX_FACTS:
            break
    return tuple(facts) if facts else None


@dataclass(frozen=True, slots=True)
class FactAsker:
    """Asks the rewrite model for the facts of one message, inside a time box; never raises."""

    complete: Complete
    prompts: PromptSet
    timeout: float

    async def ask(self, message: str) -> FactAnswer:
        """The facts ``message`` states about the user; no facts on timeout, error or an unusable answer."""
        started = time.perf_counter()
        outcome: FactOutcome
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self.complete(fact_prompt(message, self.prompts))
        except TimeoutError:
            outcome = "timeout"
        except Exception as exc:  # any provider failure: no keys, the turn is indexed all the same
            log.debug("fact keys: the model failed: %s: %s", type(exc).__name__, str(exc)[:200])
            outcome = "error"
        else:
            facts = parse_facts(answer, message)
            if facts is not None:
                return FactAnswer(facts, "facts" if facts else "none", time.perf_counter() - started)
            outcome = "junk"
        return FactAnswer((), outcome, time.perf_counter() - started)
