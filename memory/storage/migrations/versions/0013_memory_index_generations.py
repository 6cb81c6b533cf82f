"""Index generations: which encoder made each memory vector

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 04:00:00.000000

``memory_indexes`` has one row per generation of the memory index: ``spec`` says what made
its vectors (model, the sha256 of the weights, runtime, dimension, the indexer pipeline's
version), ``spec_key`` is the part of it that decides whether two vectors may be compared,
``state`` is ``active`` (searched), ``building`` (being filled by ``chatmem memory reindex``,
never searched) or ``retired`` (kept for a grace period after a switch, then deleted).
``memory_items.index_id`` names the generation of each row; a query vector is only compared
with rows of the generation whose encoder made it (memory/recall/index.py).

Every row that exists was made by the torch encoder of the packaged MiniLM, so generation 1
records that. An installation with no memory yet takes the spec of whatever encoder starts
first (its rows are then all made by it).
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from memory.storage.tenancy import TENANT_ROLE

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

FIRST_SPEC = (
    '{"model": "all-MiniLM-L6-v2", '
    '"source_sha256": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db", '
    '"runtime": "torch", "dim": 384, "pipeline": "1"}'
)
FIRST_KEY = (
    '{"dim": 384, "pipeline": "1", "runtime": "torch", '
    '"source_sha256": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"}'
)


def upgrade() -> None:
    op.create_table(
        "memory_indexes",
        sa.Column("id", sa.SmallInteger(), sa.Identity(), primary_key=True),
        sa.Column("spec", JSONB(), nullable=False),
        sa.Column("spec_key", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("activated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rows_total", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("rows_done", sa.BigInteger(), nullable=False, server_default="0"),
        sa.CheckConstraint("state IN ('building', 'active', 'retired')", name="ck_memory_indexes_state"),
    )
    # At most one active and one building generation.
    op.create_index(
        "uq_memory_indexes_state",
        "memory_indexes",
        ["state"],
        unique=True,
        postgresql_where=sa.text("state IN ('active', 'building')"),
    )
    op.execute(
        "INSERT INTO memory_indexes (id, spec, spec_key, state, activated_at) OVERRIDING SYSTEM VALUE "
        f"VALUES (1, '{FIRST_SPEC}', '{FIRST_KEY}', 'active', now())"
    )
    op.execute("SELECT setval(pg_get_serial_sequence('memory_indexes', 'id'), 1)")
    # Requests read it (as the tenant role) to know which generation to search and write.
    op.execute(f"GRANT SELECT ON memory_indexes TO {TENANT_ROLE}")
    op.add_column(
        "memory_items", sa.Column("index_id", sa.SmallInteger(), nullable=False, server_default="1")
    )
    op.alter_column("memory_items", "index_id", server_default=None)
    op.drop_constraint("uq_memory_turn_chunk", "memory_items", type_="unique")
    op.create_unique_constraint(
        "uq_memory_index_turn_chunk", "memory_items", ["index_id", "turn_id", "chunk_index"]
    )
    op.drop_index("ix_memory_owner", table_name="memory_items")
    op.create_index("ix_memory_owner", "memory_items", ["tenant_id", "user_id", "index_id"])


def downgrade() -> None:
    op.execute(
        "DELETE FROM memory_items WHERE index_id <> (SELECT id FROM memory_indexes WHERE state = 'active')"
    )
    op.drop_index("ix_memory_owner", table_name="memory_items")
    op.create_index("ix_memory_owner", "memory_items", ["tenant_id", "user_id"])
    op.drop_constraint("uq_memory_index_turn_chunk", "memory_items", type_="unique")
    op.create_unique_constraint("uq_memory_turn_chunk", "memory_items", ["turn_id", "chunk_index"])
    op.drop_column("memory_items", "index_id")
    op.execute(f"REVOKE ALL ON memory_indexes FROM {TENANT_ROLE}")
    op.drop_table("memory_indexes")
