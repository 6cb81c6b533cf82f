"""Sentence keys: extra search keys for the sentences of a long message a person wrote.

A long user message often states one fact inside a request about something else ("I'm
redoing the kitchen, we moved to Porto in May, so which tiles ..."); the chunk's vector is
about the request, and the fact is found only by its own sentence. So a chunk of at least
``MIN_CHUNK_CHARS`` characters that a person wrote (not a model's reply) gets one key per
sentence: a row of ``memory_items`` with ``kind = 'sentence'``, embedded as the sentence
with its date and speaker (``memory_text``), pointing to its chunk by (turn_id,
chunk_index). A key is never a memory: it is not listed, shown or edited, and a search that
matches it returns its chunk (``memory.recall.index_search``). Keys carry no keyword terms:
the keyword list stays on chunks.

Measured on LongMemEval: a dense top 10 holds .53 of the evidence turns by chunk vectors and
.77 by their best sentence; through the product (bench/fit_fusion.py, joint cross-validation)
the key signals lift R@1 .331 → .351 and leave LoCoMo unchanged. Short chunks get none: on
LoCoMo (one or two sentences a turn) sentence fragments lose their context and only crowd
the dense list. Model replies get none: they are not what the user stated, and they would
triple the rows.

Keys are a function of the chunk row alone (its text, role and speaker name), so the
indexer and a reindex (``memory.recall.reindex``) make the same keys.
"""

from __future__ import annotations

import re

from memory.recall.fusion import is_model_reply

# Chunks shorter than this get no sentence keys.
MIN_CHUNK_CHARS = 300
# Sentences shorter than this are merged into the next one ("Yes." "Thanks!").
MIN_SENTENCE_CHARS = 25
_SENTENCE_END = re.compile(r"(?<=[.!?。！？])\s+|\n+")


def sentences(text: str, *, min_chars: int = MIN_SENTENCE_CHARS) -> list[str]:
    """The sentences of ``text``, ones shorter than ``min_chars`` merged into the next (the last
    into the one before)."""
    merged: list[str] = []
    pending = ""
    for part in (p.strip() for p in _SENTENCE_END.split(text)):
        if not part:
            continue
        pending = f"{pending} {part}" if pending else part
        if len(pending) >= min_chars:
            merged.append(pending)
            pending = ""
    if pending:
        if merged:
            merged[-1] = f"{merged[-1]} {pending}"
        else:
            merged.append(pending)
    return merged


def sentence_keys(chunk: str, *, role: str, name: str | None) -> list[str]:
    """The sentence keys of one chunk: none for a short chunk or a model's reply, else one per sentence."""
    if len(chunk) < MIN_CHUNK_CHARS or is_model_reply(role, name):
        return []
    found = sentences(chunk)
    # A chunk that is one sentence is its own key already.
    return found if len(found) > 1 else []
