"""outbox leases and priority: claims are committed, not held open; live turns before imports

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 10:00:00.000000

A consumer (the Postgres-queue indexer, the Kafka relay) used to hold its claim as row
locks of a transaction left open while it embedded or published. A user's erasure then
waited on those locks while the indexer waited on the erasure's conversation locks: a
deadlock Postgres could not see. A claim is now a lease (``claimed_until``, ``claim_token``)
committed at once; an expired lease is claimed again.

``priority`` orders the queue: 0 for live turns, 1 for imported history. The claim index
holds what the fair claim reads, for pending rows only.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("outbox", sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True))
    op.add_column("outbox", sa.Column("claim_token", UUID(as_uuid=True), nullable=True))
    op.add_column("outbox", sa.Column("priority", sa.SmallInteger(), nullable=False, server_default="0"))
    op.create_index(
        "ix_outbox_pending_fair",
        "outbox",
        ["tenant_id", "user_id", "priority", "id"],
        postgresql_where=sa.text("consumed_at IS NULL AND dead_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_pending_fair", table_name="outbox")
    op.drop_column("outbox", "priority")
    op.drop_column("outbox", "claim_token")
    op.drop_column("outbox", "claimed_until")
