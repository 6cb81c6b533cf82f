"""conversations.memory_forgotten_seq: turns up to this seq were forgotten (DELETE /v1/memory)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 10:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "conversations",
        sa.Column("memory_forgotten_seq", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("conversations", "memory_forgotten_seq")
