"""Row-level security on the tables that hold user data

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 10:00:00.000000

Creates the NOLOGIN role ``chatmem_tenant`` (no BYPASSRLS) if it is missing, makes the
migrating user a member (so the app may switch to it per transaction), and puts every
table with a ``tenant_id`` under the policy of ``memory/storage/migrations/rls.py``. A
DATABASE_URL user that may not create roles needs an operator to run, once:
``CREATE ROLE chatmem_tenant NOLOGIN NOBYPASSRLS; GRANT chatmem_tenant TO <app user>;``
"""

from alembic import op

from memory.storage.migrations.rls import disable_tenant_rls, enable_tenant_rls
from memory.storage.tenancy import TENANT_ROLE

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TENANT_TABLES = ("conversations", "turns", "turn_events", "tool_invocations", "outbox", "memory_items")

CREATE_ROLE = f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{TENANT_ROLE}') THEN
        CREATE ROLE {TENANT_ROLE} NOLOGIN NOBYPASSRLS;
    END IF;
    IF NOT pg_has_role(current_user, '{TENANT_ROLE}', 'MEMBER') THEN
        EXECUTE format('GRANT {TENANT_ROLE} TO %I', current_user);
    END IF;
END $$
"""

# Roles belong to the whole cluster: another database may still use it, so failing to drop is fine.
DROP_ROLE = f"""
DO $$
BEGIN
    DROP ROLE IF EXISTS {TENANT_ROLE};
EXCEPTION WHEN dependent_objects_still_exist OR insufficient_privilege THEN
    RAISE NOTICE 'role {TENANT_ROLE} kept: %', SQLERRM;
END $$
"""


def upgrade() -> None:
    op.execute(CREATE_ROLE)
    for table in TENANT_TABLES:
        enable_tenant_rls(op, table)


def downgrade() -> None:
    for table in TENANT_TABLES:
        disable_tenant_rls(op, table)
    op.execute(DROP_ROLE)
