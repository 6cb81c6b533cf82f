"""Memory rows get a kind: a chunk (a memory) or a sentence key pointing to its chunk

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-26 07:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # chunk: a memory (listed, shown, edited); sentence: a search key of a chunk
    # (memory/recall/sentence_keys.py).
    op.add_column("memory_items", sa.Column("kind", sa.String(16), nullable=False, server_default="chunk"))
    # A key's position in its chunk (0 for a chunk).
    op.add_column("memory_items", sa.Column("key_index", sa.Integer(), nullable=False, server_default="0"))
    op.create_check_constraint("ck_memory_items_kind", "memory_items", "kind IN ('chunk', 'sentence')")
    op.drop_constraint("uq_memory_index_turn_chunk", "memory_items", type_="unique")
    op.create_unique_constraint(
        "uq_memory_index_turn_key",
        "memory_items",
        ["index_id", "turn_id", "kind", "chunk_index", "key_index"],
    )


def downgrade() -> None:
    op.execute("DELETE FROM memory_items WHERE kind <> 'chunk'")
    op.drop_constraint("uq_memory_index_turn_key", "memory_items", type_="unique")
    op.create_unique_constraint(
        "uq_memory_index_turn_chunk", "memory_items", ["index_id", "turn_id", "chunk_index"]
    )
    op.drop_constraint("ck_memory_items_kind", "memory_items", type_="check")
    op.drop_column("memory_items", "key_index")
    op.drop_column("memory_items", "kind")
