"""Branches and forks of conversations

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21 10:00:00.000000

A conversation's history is a branch: its own turns plus its parent's turns up to
``fork_seq``, recursively, stored flattened on the branch as (branch, max seq) pairs
(``lineage_ids``/``lineage_max_seqs``). The root branch of a conversation has the
conversation's id, so existing rows are backfilled with plain copies of ids.

Two triggers keep every writer right, also raw SQL that predates branches (imports,
tests, tools): a new conversation gets ``active_branch_id = id`` and its root branch row;
a new turn without ``branch_id`` lands on its conversation's active branch. Writers that
know the branch (the reply path) set it, and the turn trigger then only checks for NULL.
``memory_items.on_active_branch`` is false for turns off their conversation's active
branch (see memory/record/branches.py); recall reads only true rows.
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

NO_LIMIT = 2147483647

CONVERSATION_DEFAULTS = """
CREATE FUNCTION chatmem_conversation_branch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.active_branch_id := COALESCE(NEW.active_branch_id, NEW.id);
    RETURN NEW;
END $$
"""

ROOT_BRANCH = f"""
CREATE FUNCTION chatmem_root_branch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.active_branch_id = NEW.id THEN
        INSERT INTO branches (id, tenant_id, user_id, conversation_id, fork_seq,
                              lineage_ids, lineage_max_seqs)
        VALUES (NEW.id, NEW.tenant_id, NEW.user_id, NEW.id, 0, ARRAY[NEW.id], ARRAY[{NO_LIMIT}])
        ON CONFLICT (id) DO NOTHING;
    END IF;
    RETURN NULL;
END $$
"""

TURN_BRANCH = """
CREATE FUNCTION chatmem_turn_branch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.branch_id IS NULL THEN
        SELECT active_branch_id INTO NEW.branch_id FROM conversations WHERE id = NEW.conversation_id;
        NEW.branch_id := COALESCE(NEW.branch_id, NEW.conversation_id);
    END IF;
    RETURN NEW;
END $$
"""


def upgrade() -> None:
    op.create_table(
        "branches",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=128), nullable=False),
        sa.Column("conversation_id", sa.UUID(), nullable=False),
        sa.Column("parent_branch_id", sa.UUID(), nullable=True),
        sa.Column("fork_seq", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lineage_ids", postgresql.ARRAY(sa.UUID()), nullable=False),
        sa.Column("lineage_max_seqs", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(["conversation_id"], ["conversations.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_branches_conversation", "branches", ["conversation_id", "created_at"])
    enable_tenant_rls(op, "branches")

    op.add_column("conversations", sa.Column("active_branch_id", sa.UUID(), nullable=True))
    op.add_column("turns", sa.Column("branch_id", sa.UUID(), nullable=True))
    op.add_column(
        "memory_items",
        sa.Column("on_active_branch", sa.Boolean(), server_default=sa.text("true"), nullable=False),
    )
    op.execute("UPDATE conversations SET active_branch_id = id")
    op.execute("UPDATE turns SET branch_id = conversation_id")
    op.execute(
        f"""
        INSERT INTO branches (id, tenant_id, user_id, conversation_id, fork_seq,
                              lineage_ids, lineage_max_seqs, created_at)
        SELECT id, tenant_id, user_id, id, 0, ARRAY[id], ARRAY[{NO_LIMIT}], created_at FROM conversations
        """
    )
    op.alter_column("conversations", "active_branch_id", nullable=False)
    op.alter_column("turns", "branch_id", nullable=False)
    op.create_index("ix_turns_branch_seq", "turns", ["branch_id", "seq"])

    op.execute(CONVERSATION_DEFAULTS)
    op.execute(ROOT_BRANCH)
    op.execute(TURN_BRANCH)
    op.execute(
        "CREATE TRIGGER conversation_branch BEFORE INSERT ON conversations"
        " FOR EACH ROW EXECUTE FUNCTION chatmem_conversation_branch()"
    )
    op.execute(
        "CREATE TRIGGER root_branch AFTER INSERT ON conversations"
        " FOR EACH ROW EXECUTE FUNCTION chatmem_root_branch()"
    )
    op.execute(
        "CREATE TRIGGER turn_branch BEFORE INSERT ON turns"
        " FOR EACH ROW EXECUTE FUNCTION chatmem_turn_branch()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS turn_branch ON turns")
    op.execute("DROP TRIGGER IF EXISTS root_branch ON conversations")
    op.execute("DROP TRIGGER IF EXISTS conversation_branch ON conversations")
    op.execute("DROP FUNCTION IF EXISTS chatmem_turn_branch()")
    op.execute("DROP FUNCTION IF EXISTS chatmem_root_branch()")
    op.execute("DROP FUNCTION IF EXISTS chatmem_conversation_branch()")
    op.drop_index("ix_turns_branch_seq", table_name="turns")
    op.drop_column("memory_items", "on_active_branch")
    op.drop_column("turns", "branch_id")
    op.drop_column("conversations", "active_branch_id")
    disable_tenant_rls(op, "branches")
    op.drop_index("ix_branches_conversation", table_name="branches")
    op.drop_table("branches")
