"""branches.lineage_ids GIN index: which branches (forks) share a conversation's turns

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-21 12:00:00.000000
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The retention purge keeps a deleted conversation while a fork's lineage still names one of its branches.
    op.create_index("ix_branches_lineage", "branches", ["lineage_ids"], postgresql_using="gin")


def downgrade() -> None:
    op.drop_index("ix_branches_lineage", table_name="branches")
