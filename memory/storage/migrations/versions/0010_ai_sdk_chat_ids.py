"""AI SDK chat ids: the client's chat id of each conversation an AI SDK frontend started

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 10:00:00.000000

A `useChat` frontend names its chat with an id it made itself (`generateId()`), not a
chatmem conversation id. One row per (tenant, user, chat id) says which conversation that
is; the same chat id of two users is two rows, two conversations. Rows go with their
conversation (ON DELETE CASCADE: the retention purge and user erasure delete conversations).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ai_sdk_chats",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=128), nullable=False),
        sa.Column("chat_id", sa.String(length=128), nullable=False),
        sa.Column(
            "conversation_id",
            UUID(as_uuid=True),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "user_id", "chat_id"),
    )
    # The cascade from a purged conversation finds its row without a scan.
    op.create_index("ix_ai_sdk_chats_conversation", "ai_sdk_chats", ["conversation_id"])
    enable_tenant_rls(op, "ai_sdk_chats")


def downgrade() -> None:
    disable_tenant_rls(op, "ai_sdk_chats")
    op.drop_index("ix_ai_sdk_chats_conversation", table_name="ai_sdk_chats")
    op.drop_table("ai_sdk_chats")
