"""Memory vectors lose their HNSW index: no statement reads it any more

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26 16:45:00.000000

A search takes its dense list exactly, in the one pass over the searching user's rows that
the keyword list already makes (memory/recall/index_search.py): the approximate HNSW scan
saved no row reads there, and leaving the choice to the planner made the found lists depend
on table size and storage. The index then only cost every insert a graph update, its build
time (about five minutes per million rows on two cores) and about 650 MB per million rows
(docs/scaling.md). Nothing else moves: rows, vectors and constraints stay.
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_memory_embedding", table_name="memory_items", postgresql_using="hnsw")


def downgrade() -> None:
    op.create_index(
        "ix_memory_embedding",
        "memory_items",
        ["embedding"],
        unique=False,
        postgresql_using="hnsw",
        postgresql_with={"m": 16, "ef_construction": 64},
        postgresql_ops={"embedding": "vector_cosine_ops"},
    )
