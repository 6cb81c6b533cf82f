"""Tool approvals: when the earliest waiting approval of a turn runs out

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21 11:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("turns", sa.Column("approval_expires_at", sa.DateTime(timezone=True), nullable=True))
    # Only turns awaiting a person with a timeout are in it: the sweep reads a handful of rows.
    op.create_index(
        "ix_turns_approval_expiry",
        "turns",
        ["approval_expires_at"],
        postgresql_where=sa.text("status = 'awaiting_approval' AND approval_expires_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_turns_approval_expiry", table_name="turns")
    op.drop_column("turns", "approval_expires_at")
