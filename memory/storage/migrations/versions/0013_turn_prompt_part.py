"""Turns keep what their reply's prompt showed before the user's words, and whether memory was used

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 04:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # On a reply's first assistant turn: {"now": ..., "memories": [...]}, shown again with its
    # user message in later prompts (memory.prompt.context).
    op.add_column("turns", sa.Column("prompt_part", JSONB(), nullable=True))
    # On every assistant turn: on | off | unavailable (the remembering rule reads it).
    op.add_column("turns", sa.Column("memory_use", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "memory_use")
    op.drop_column("turns", "prompt_part")
