"""Memory items a user controls: corrected, forgotten one by one, or stated directly

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 10:00:00.000000

``memory_items`` gets:

- ``source``: ``turn`` (written by the indexer from a finished turn) or ``stated`` (a
  fact the user stated directly, ``POST /v1/memory/items``: no turn behind it, so no
  conversation either unless one was named; its ``turn_id`` is its own random id).
- ``edited_at``: the user corrected the text (re-embedded); the indexer's upsert leaves
  such a row alone when it reprocesses the turn.
- ``forgotten_at``: the user forgot this one item. The row stays as a tombstone (text,
  keywords and vector emptied, ``deleted_at`` set so no search sees it), so the indexer's
  upsert finds it and does not bring the item back; the retention purge keeps it for as
  long as its turn exists.

``conversation_id`` and ``embedding`` become nullable (a stated fact; a tombstone). The
table is already under the tenant policy (migration 0003): new columns need nothing.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "memory_items", sa.Column("source", sa.String(length=16), nullable=False, server_default="turn")
    )
    op.add_column("memory_items", sa.Column("edited_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("memory_items", sa.Column("forgotten_at", sa.DateTime(timezone=True), nullable=True))
    op.alter_column("memory_items", "conversation_id", nullable=True)
    op.alter_column("memory_items", "embedding", nullable=True)
    # The items page lists one user's live items newest first.
    op.create_index(
        "ix_memory_owner_listed",
        "memory_items",
        ["tenant_id", "user_id", "turn_created_at", "id"],
        postgresql_where=sa.text("deleted_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_memory_owner_listed", table_name="memory_items")
    # Tombstones and stated facts cannot live under the old constraints.
    op.execute("DELETE FROM memory_items WHERE forgotten_at IS NOT NULL OR conversation_id IS NULL")
    op.alter_column("memory_items", "embedding", nullable=False)
    op.alter_column("memory_items", "conversation_id", nullable=False)
    op.drop_column("memory_items", "forgotten_at")
    op.drop_column("memory_items", "edited_at")
    op.drop_column("memory_items", "source")
