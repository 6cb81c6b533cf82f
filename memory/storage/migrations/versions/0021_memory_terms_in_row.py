"""Memory search terms stay in their row (storage MAIN) instead of the TOAST table

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26 16:30:00.000000

A search reads the tsvector of every one of the user's rows (the owner pass of
memory/recall/index_search.py). `tsvector` is `extended`: a row over ~2 KB has it compressed
and, mostly, moved out of line, so each row cost a TOAST index probe and a TOAST page on
top of its heap page (four of every five buffers of that pass at 1,000 rows a user). MAIN
keeps it in the row (compressed; moved out only if the row cannot fit otherwise), as 0016
did for the vector. The search's results do not depend on the storage (its order is exact
and ties break by id). Only rows written from now on are affected: existing rows move in
when they are rewritten (`chatmem memory reindex` writes a new generation; `VACUUM FULL
memory_items` or pg_repack rewrite in place). Measured with bench/retrieval_latency.py
(docs/scaling.md).
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE memory_items ALTER COLUMN search_terms SET STORAGE MAIN")


def downgrade() -> None:
    op.execute("ALTER TABLE memory_items ALTER COLUMN search_terms SET STORAGE EXTENDED")
