"""Row-level security on the tables that hold user data

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 10:00:00.000000
"""

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
