"""Turns keep what their reply's prompt showed and whether memory was used; "use memory in this chat"

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-26 04:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On a reply's first assistant turn: {"now": ..., "memories": [...]}, shown again with its
    # user message in later prompts (memory.prompt.context).
    op.add_column("turns", sa.Column("prompt_part", JSONB(), nullable=True))
    # On every assistant turn: on | off | unavailable (the remembering rule reads it).
    op.add_column("turns", sa.Column("memory_use", sa.String(16), nullable=True))
    # "Use memory in this chat" (read), beside memory_mode ("remember this chat", write).
    op.add_column(
        "conversations", sa.Column("use_memory", sa.Boolean(), nullable=False, server_default=sa.true())
    )


def downgrade() -> None:
    op.drop_column("conversations", "use_memory")
    op.drop_column("turns", "memory_use")
    op.drop_column("turns", "prompt_part")
