"""Memory search terms lose their GIN index: no statement reads it any more

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26 10:30:00.000000

The search statement (memory/recall/index_search.py) matches a question's terms against the
searching user's own rows, read once through the owner's btree. Through the GIN index the
keyword list read every user's postings of the question's words, a cost that grew with the
whole table (bench/retrieval_latency.py, docs/scaling.md). The index only cost writes, build
time and ~6 % of the table's storage. Nothing else moves: rows, keys and constraints stay.
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_memory_terms", table_name="memory_items", postgresql_using="gin")


def downgrade() -> None:
    op.create_index("ix_memory_terms", "memory_items", ["search_terms"], unique=False, postgresql_using="gin")
