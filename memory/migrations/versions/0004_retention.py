"""Retention: soft-delete columns and per-tenant retention

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21 10:00:00.000000
"""

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
