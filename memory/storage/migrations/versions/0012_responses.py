"""Responses API: the request each stored response (a chatmem reply) answered

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 23:50:00.000000

One row per response created with `store: true` through `/openai/v1/responses`: its id
is the reply's id, so status, output and event log are the reply's; the row keeps what
the turns do not (the request's options, the input items, the response it continued).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", UUID(as_uuid=True), primary_key=True),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=128), nullable=False),
        sa.Column(
            "conversation_id",
            UUID(as_uuid=True),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("previous_response_id", UUID(as_uuid=True), nullable=True),
        sa.Column("request", JSONB(), nullable=False),
        sa.Column("input_items", JSONB(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
    )
    # The cascade from a purged conversation finds its rows without a scan.
    op.create_index("ix_responses_conversation", "responses", ["conversation_id"])
    enable_tenant_rls(op, "responses")


def downgrade() -> None:
    disable_tenant_rls(op, "responses")
    op.drop_index("ix_responses_conversation", table_name="responses")
    op.drop_table("responses")
