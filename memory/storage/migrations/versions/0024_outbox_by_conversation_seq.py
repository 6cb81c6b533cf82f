"""Outbox rows get an index by conversation and turn seq

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27 09:30:00.000000

The indexer's watermark (``conversations.indexed_seq``, every turn up to it indexed) now
advances only over turns whose outbox rows are consumed or dead: each batch reads its
conversations' rows above the watermark by seq (indexer/pipeline.py). The seq is in the
payload; this index holds it beside the conversation (NULL for a payload without a usable
seq, so a poison row still inserts) and replaces ``ix_outbox_conversation``, which it leads
with. Building it locks the outbox against writes (every finished turn) while it runs.
"""

from alembic import op
from sqlalchemy import text

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

SEQ = "(CASE WHEN payload->>'seq' ~ '^[0-9]{1,9}$' THEN CAST(payload->>'seq' AS integer) END)"


def upgrade() -> None:
    op.create_index("ix_outbox_conversation_seq", "outbox", ["conversation_id", text(SEQ)])
    op.drop_index("ix_outbox_conversation", table_name="outbox")


def downgrade() -> None:
    op.create_index("ix_outbox_conversation", "outbox", ["conversation_id"])
    op.drop_index("ix_outbox_conversation_seq", table_name="outbox")
