"""Memory rows get an index of their own by turn

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-27 06:10:00.000000

Several statements find a turn's memory rows by the turn alone, with no index generation:
before every reply, the check that the memories its window showed are still there
(memory/prompt/context.py, one lookup per shown memory), and retention's expiry and purge
(memory/storage/retention.py). The only index holding ``turn_id`` led with ``index_id``
(``uq_memory_index_turn_key``). PostgreSQL 18 skips through its few generations (a skip
scan: one descent each), but 17 and earlier, which ``chatmem serve`` accepts and the Compose
file runs, read that whole index for every lookup: a cost that grew with every user's memory.

Building it locks the table against writes (the indexer's) for as long as the build takes;
reads and searches go on.
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_memory_turn", "memory_items", ["turn_id"])


def downgrade() -> None:
    op.drop_index("ix_memory_turn", table_name="memory_items")
