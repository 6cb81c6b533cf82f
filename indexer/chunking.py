"""Splitting long turns into overlapping chunks that each fit the embedding model.

Chunks are exact slices of the text, so nothing is lost: consecutive chunks touch or
overlap. Cuts prefer a sentence end (including Chinese 。！？), then a clause mark or
a space, and only then fall back to a hard cut, which Chinese without spaces may need.
"""

from __future__ import annotations

SENTENCE_ENDS = frozenset(".!?。！？；;\n…")
SOFT_BREAKS = frozenset(" \t,，、:：)）]」』")
# A cut is only taken if it keeps at least this share of max_chars in the chunk.
_MIN_FILL = 0.5


def _cut(text: str, start: int, limit: int) -> int:
    """Where the chunk starting at ``start`` should end (exclusive), at most ``limit``."""
    floor = start + max(1, int((limit - start) * _MIN_FILL))
    for breaks in (SENTENCE_ENDS, SOFT_BREAKS):
        for i in range(limit, floor, -1):
            if text[i - 1] in breaks:
                return i
    return limit


def _overlap_start(text: str, start: int, end: int, overlap: int) -> int:
    """Where the next chunk starts: ``overlap`` characters back, moved to a word start."""
    nxt = max(end - overlap, start + 1)
    if nxt >= end:
        return end
    # Do not start mid-word: move forward to just after a break inside the overlap.
    for i in range(nxt, end):
        if text[i - 1] in SOFT_BREAKS or text[i - 1] in SENTENCE_ENDS:
            return i
    return nxt


def chunk_text(text: str, *, max_chars: int, overlap: int) -> list[str]:
    """``text`` as chunks of at most ``max_chars``, overlapping by up to ``overlap``; none empty."""
    if max_chars < 1:
        raise ValueError("max_chars must be positive")
    if not text.strip():
        return []
    if len(text) <= max_chars:
        return [text]
    overlap = max(0, min(overlap, max_chars // 2))
    chunks: list[str] = []
    start = 0
    while start < len(text):
        if len(text) - start <= max_chars:
            end = len(text)
        else:
            end = _cut(text, start, start + max_chars)
        piece = text[start:end]
        if piece.strip():
            chunks.append(piece)
        if end >= len(text):
            break
        start = _overlap_start(text, start, end, overlap)
    return chunks
