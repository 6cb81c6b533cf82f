"""The planner's statistics of `memory_items`, kept fresh after the indexer writes many rows.

Postgres plans a memory search from the table's statistics, which autovacuum refreshes at its
own pace (a check a minute, once a tenth of the table changed). A table that grew from almost
nothing (a new installation, a first import) is planned as if it were empty until then: a
search right after importing 1,000 turns took 1.2-4 s instead of 45 ms for the 40 s before
autovacuum's ANALYZE (`bench/ttft.py --memory-rows`). The indexer knows when it wrote many
rows, so it runs the ANALYZE itself: once the rows it wrote since its last one are at least
`min_rows` and a `share` of what the statistics last counted. On a large table that is rare
(autovacuum's rule is about the same); ANALYZE samples a fixed number of rows, so each one
costs tens of milliseconds, off the request path.
"""

from __future__ import annotations

from sqlalchemy import text

from memory.storage.db import Database

# What the statistics last counted (-1 before the first ANALYZE of the table: read as 0).
KNOWN_ROWS = text("SELECT greatest(reltuples, 0) FROM pg_class WHERE oid = 'memory_items'::regclass")


class MemoryTableStatistics:
    """Counts the memory rows the indexer wrote and runs ANALYZE when they are many."""

    def __init__(self, db: Database, *, min_rows: int = 500, share: float = 0.2) -> None:
        self.db = db
        self.min_rows = min_rows
        self.share = share
        self._written = 0

    async def wrote(self, rows: int) -> bool:
        """Record `rows` written; True when that made it refresh the statistics."""
        self._written += rows
        if self._written < self.min_rows:
            return False
        async with self.db.transaction() as session:
            known = float((await session.execute(KNOWN_ROWS)).scalar_one())
            if self._written < self.share * known:
                return False
            await session.execute(text("ANALYZE memory_items"))
        self._written = 0
        return True
