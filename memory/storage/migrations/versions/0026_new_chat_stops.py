"""A stop of a chat id nobody has used yet is kept, for a short while, for that chat's first run

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-28 00:40:00.000000

AG-UI and AI SDK clients pick the thread (chat) id themselves, so the stop of a brand-new
chat's first run can reach a process before the request that creates the chat's
conversation. It answered 404 and the run streamed unstopped. Such a stop is now kept by
(tenant, user, chat id): ``requested_at`` (the database's time of the stop) and ``run_key``
(the idempotency key of the AG-UI run it names, or NULL for "the chat's reply"). The
transaction that creates the chat's conversation takes it onto the conversation row
(migration 0025), where the run's start takes it. One row per chat id; a newer stop
replaces it. A row is stale NEW_CHAT_STOP_SECONDS after it was written
(memory/record/pending_stops.py): never taken then, and deleted by the next stop kept in
the tenant (``ix_chat_stops_requested_at`` finds those without a scan). Under the tenant
policy like every table of user data.
"""

import sqlalchemy as sa
from alembic import op

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chat_stops",
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=128), nullable=False),
        sa.Column("chat_id", sa.String(length=128), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_key", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("tenant_id", "user_id", "chat_id"),
    )
    op.create_index("ix_chat_stops_requested_at", "chat_stops", ["requested_at"])
    enable_tenant_rls(op, "chat_stops")


def downgrade() -> None:
    disable_tenant_rls(op, "chat_stops")
    op.drop_index("ix_chat_stops_requested_at", table_name="chat_stops")
    op.drop_table("chat_stops")
