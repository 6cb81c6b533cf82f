"""API keys: long-lived bearer keys that authenticate as one tenant and user (hash only)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 09:30:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", UUID(as_uuid=True), primary_key=True),
        sa.Column("tenant_id", sa.String(128), nullable=False),
        sa.Column("user_id", sa.String(128), nullable=False),
        sa.Column("name", sa.Text(), nullable=False, server_default=""),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_api_keys_owner", "api_keys", ["tenant_id", "user_id", "created_at"])
    # Listing and revoking run as the request's tenant; the lookup by hash runs before any
    # tenant is known, as the connecting role (the table's owner, not subject to the policy).
    enable_tenant_rls(op, "api_keys")


def downgrade() -> None:
    disable_tenant_rls(op, "api_keys")
    op.drop_index("ix_api_keys_owner", table_name="api_keys")
    op.drop_table("api_keys")
