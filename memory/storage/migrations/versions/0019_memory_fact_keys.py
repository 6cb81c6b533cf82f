"""Memory rows of a third kind: a fact a turn states, as the model put it, a search key of its chunk

Revision ID: 0019
Revises: 0017
Create Date: 2026-11-26 10:10:00.000000
"""

from alembic import op

revision = "0019"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # fact: a search key made by the rewrite model at index time (memory/recall/fact_keys.py).
    op.drop_constraint("ck_memory_items_kind", "memory_items", type_="check")
    op.create_check_constraint(
        "ck_memory_items_kind", "memory_items", "kind IN ('chunk', 'sentence', 'fact')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM memory_items WHERE kind = 'fact'")
    op.drop_constraint("ck_memory_items_kind", "memory_items", type_="check")
    op.create_check_constraint("ck_memory_items_kind", "memory_items", "kind IN ('chunk', 'sentence')")
