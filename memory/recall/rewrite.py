"""Query rewriting: the user's latest message as a standalone search query.

"What did she say about it?" finds nothing on its own; the recent turns say who "she" is
and what "it" is. A fast model rewrites the message with the prompt in
``prompts/<language>/query_rewrite.txt``, inside a time box, because this runs before the
first token of every reply. When the model is slow, fails, or answers something unusable,
the heuristic below is used instead. A message with nothing to resolve is used as is, with
no model call: no history, or a message that stands alone (enough keywords and no
reference word). On a single-slot local model server a rewrite would also hold the slot
the reply needs.

The heuristic is deliberately simple and predictable: the salient words of the user's own
latest messages (newest first, stopwords dropped, at most ``HEURISTIC_MAX_WORDS``) are
appended, so keyword and vector search see what the pronoun stood for. Never the
assistant's words: a small model's reply can be an invention, or a tool call written as
JSON, and searching with it finds more of the same.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from memory.prompt.templates import PromptSet
from memory.recall.keywords import STOPWORDS, query_terms

log = logging.getLogger(__name__)

RewriteMethod = Literal["model", "heuristic", "skipped"]
# messages -> completion text; the caller binds the model name and timeout.
Complete = Callable[[list[dict[str, Any]]], Awaitable[str]]

HISTORY_LINES = 6
HISTORY_LINE_CHARS = 600
MAX_QUERY_CHARS = 500
# A message with at least this many keyword terms and no reference word stands alone.
STANDALONE_TERMS = 3
HEURISTIC_MAX_WORDS = 8

REFERENCE_WORDS = frozenset(
    """
    it its it's this that these those they them their theirs he him his she her hers
    there then one ones former latter same such
    它 它们 这 那 这个 那个 这些 那些 他 她 他们 她们 其 该 此 上述 前者 后者
    """.split()
)
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


@dataclass(frozen=True, slots=True)
class HistoryLine:
    """One earlier message of the conversation, as the rewriter sees it."""

    role: str  # user | assistant
    text: str


@dataclass(frozen=True, slots=True)
class Rewrite:
    """The query used for retrieval and how it was made."""

    query: str
    method: RewriteMethod
    # Why the model's rewrite was not used (timeout, error, unusable answer), if it was not.
    fallback_reason: str | None = None


def _has_reference(message: str) -> bool:
    lowered = message.lower()
    if any(word in REFERENCE_WORDS for word in _WORD.findall(lowered)):
        return True
    # Chinese has no spaces: look for the reference words as substrings.
    return any(not word.isascii() and word in lowered for word in REFERENCE_WORDS)


def _salient_words(text: str) -> list[str]:
    words = []
    for word in _WORD.findall(text):
        lowered = word.lower().replace("’", "'")
        if lowered in STOPWORDS or lowered in REFERENCE_WORDS or (word.isascii() and len(word) < 3):
            continue
        words.append(word)
    return words


def stands_alone(message: str) -> bool:
    """True when the message needs no earlier turn to be searched for."""
    return len(query_terms(message)) >= STANDALONE_TERMS and not _has_reference(message)


def heuristic_rewrite(message: str, history: Sequence[HistoryLine]) -> str:
    """The message, plus the salient words of the user's latest messages when it leans on them."""
    message = message.strip()
    if not history or stands_alone(message):
        return message
    seen = {term for term in query_terms(message)}
    extra: list[str] = []
    for line in reversed(history):
        if line.role != "user":
            continue
        for word in _salient_words(line.text):
            terms = query_terms(word)
            if not terms or all(term in seen for term in terms):
                continue
            seen.update(terms)
            extra.append(word)
            if len(extra) >= HEURISTIC_MAX_WORDS:
                break
        if len(extra) >= HEURISTIC_MAX_WORDS:
            break
    return f"{message} {' '.join(extra)}".strip() if extra else message


def rewrite_prompt(message: str, history: Sequence[HistoryLine], prompts: PromptSet) -> list[dict[str, Any]]:
    """The chat messages that ask the model for a standalone query."""
    roles = {
        "user": prompts.render("history_role_user"),
        "assistant": prompts.render("history_role_assistant"),
    }
    lines = [
        prompts.render(
            "query_rewrite_history_line",
            role=roles.get(line.role, roles["assistant"]),
            text=" ".join(line.text.split())[:HISTORY_LINE_CHARS],
        )
        for line in history[-HISTORY_LINES:]
    ]
    content = prompts.render("query_rewrite", history="\n".join(lines), message=message.strip())
    return [{"role": "user", "content": content}]


def clean_model_query(answer: str) -> str | None:
    """The first line of the model's answer without quotes or a label, or None if unusable."""
    line = next((ln.strip() for ln in answer.splitlines() if ln.strip()), "")
    line = re.sub(r"^(?:standalone\s+)?(?:search\s+)?query\s*[:：]\s*", "", line, flags=re.IGNORECASE)
    line = line.strip().strip("\"'“”‘’「」`").strip()
    if not line or len(line) > MAX_QUERY_CHARS:
        return None
    return line


async def rewrite_query(
    message: str,
    history: Sequence[HistoryLine],
    *,
    prompts: PromptSet,
    complete: Complete | None,
    timeout: float,
) -> Rewrite:
    """A standalone query for ``message``; never raises and never takes much longer than ``timeout``."""
    message = message.strip()
    if not history or stands_alone(message):
        return Rewrite(message, "skipped")
    if complete is None:
        return Rewrite(heuristic_rewrite(message, history), "heuristic", "no rewrite model")
    try:
        async with asyncio.timeout(timeout):
            answer = await complete(rewrite_prompt(message, history, prompts))
    except TimeoutError:
        reason = f"timeout after {timeout:g}s"
    except Exception as exc:  # any provider failure falls back; the reply must not fail for it
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
    else:
        query = clean_model_query(answer)
        if query is not None:
            return Rewrite(query, "model")
        reason = "unusable answer"
    log.debug("query rewrite fell back to the heuristic: %s", reason)
    return Rewrite(heuristic_rewrite(message, history), "heuristic", reason)
