"""Memory vectors stay in their row (storage MAIN) instead of the TOAST table

Revision ID: 0016
Revises: 0014
Create Date: 2026-11-26 07:10:00.000000

pgvector stores `vector` as `external`: a row over ~2 KB has its vector moved out of line.
Nearly every memory row is over 2 KB (384 floats, the text, and a tsvector that carries the
previous turn's words), so every search read each candidate's vector through the TOAST
index and a TOAST page. MAIN keeps it in the row (moved out only if the row cannot fit
otherwise). Only rows written from now on are affected: existing rows move in when they are
rewritten (`chatmem memory reindex` writes a new generation; `VACUUM FULL memory_items` or
pg_repack rewrite in place). Measured with bench/retrieval_latency.py (docs/scaling.md).
"""

from alembic import op

revision = "0016"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE memory_items ALTER COLUMN embedding SET STORAGE MAIN")


def downgrade() -> None:
    op.execute("ALTER TABLE memory_items ALTER COLUMN embedding SET STORAGE EXTERNAL")
