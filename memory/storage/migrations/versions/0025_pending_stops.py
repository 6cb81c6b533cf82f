"""A stop that finds no reply running yet is kept on its conversation until a reply starts

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27 21:30:00.000000

A stop can reach the server (any process) before the reply it means is stored: an AG-UI
client names the run by the `runId` it picked, and an AI SDK (or AG-UI) stop names only the
chat. It found nothing to stop and the reply then streamed to its end. Now such a stop is
kept on the conversation's row, under the row's lock (``stop_requested_at``, the database's
time of the stop, and ``stop_requested_key``, the idempotency key of the run it names, or
NULL for "the reply being started"); the transaction that stores a reply, which holds the
same lock, starts it stopped if a stop names its key or is keyless and newer than that
transaction, and clears it (memory/record/pending_stops.py). Only one is kept: a newer stop
replaces it.
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("conversations", sa.Column("stop_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("conversations", sa.Column("stop_requested_key", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("conversations", "stop_requested_key")
    op.drop_column("conversations", "stop_requested_at")
