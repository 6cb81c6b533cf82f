"""Retention: soft-delete columns and per-tenant retention

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 10:00:00.000000

Turns and memory rows get ``deleted_at`` (conversations have one). The partial indexes
hold only what the retention job looks for: live turns by age, and soft-deleted rows by
when they were deleted. The others let a purge or a user's deletion reach dependent rows
without scanning: outbox rows by conversation, tool invocations by turn.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("memory_items", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_turns_live_created", "turns", ["created_at"], postgresql_where=sa.text("deleted_at IS NULL")
    )
    op.create_index(
        "ix_turns_deleted", "turns", ["deleted_at"], postgresql_where=sa.text("deleted_at IS NOT NULL")
    )
    op.create_index(
        "ix_memory_deleted",
        "memory_items",
        ["deleted_at"],
        postgresql_where=sa.text("deleted_at IS NOT NULL"),
    )
    op.create_index(
        "ix_conversations_deleted",
        "conversations",
        ["deleted_at"],
        postgresql_where=sa.text("deleted_at IS NOT NULL"),
    )
    op.create_index("ix_outbox_conversation", "outbox", ["conversation_id"])
    op.create_index("ix_outbox_created", "outbox", ["created_at"])
    op.create_index("ix_tool_invocations_turn", "tool_invocations", ["turn_id"])


def downgrade() -> None:
    op.drop_index("ix_tool_invocations_turn", table_name="tool_invocations")
    op.drop_index("ix_outbox_created", table_name="outbox")
    op.drop_index("ix_outbox_conversation", table_name="outbox")
    op.drop_index("ix_conversations_deleted", table_name="conversations")
    op.drop_index("ix_memory_deleted", table_name="memory_items")
    op.drop_index("ix_turns_deleted", table_name="turns")
    op.drop_index("ix_turns_live_created", table_name="turns")
    op.drop_column("memory_items", "deleted_at")
    op.drop_column("turns", "deleted_at")
