"""Row-level security for one table, for migrations: `enable_tenant_rls(op, "table")`.

A table that holds user data has a ``tenant_id`` column. Enabling RLS on it grants the
``chatmem_tenant`` role (created by migration 0003) what the app needs on it and adds one
policy: a row is visible to, and may be written by, that role only when its ``tenant_id``
equals the transaction's ``chatmem.tenant_id`` setting. Unset, nothing is visible.

The table's owner (the role migrations connect as) is not subject to RLS: background
work, which runs as that role, still sees every tenant. Requests switch to
``chatmem_tenant`` per transaction (``memory/storage/db.py``).
"""

from __future__ import annotations

from typing import Any

from memory.storage.tenancy import TENANT_ROLE, TENANT_SETTING

POLICY = "tenant_isolation"

_CONDITION = f"tenant_id = current_setting('{TENANT_SETTING}', true)"

# Identity columns' sequences (bigserial ids) need USAGE for INSERTs made as the role.
_GRANT_SEQUENCES = """
DO $$
DECLARE seq text;
BEGIN
    FOR seq IN
        SELECT pg_get_serial_sequence('{table}', a.attname) FROM pg_attribute a
        WHERE a.attrelid = '{table}'::regclass AND a.attnum > 0 AND NOT a.attisdropped
          AND pg_get_serial_sequence('{table}', a.attname) IS NOT NULL
    LOOP
        EXECUTE format('{verb} USAGE ON SEQUENCE %s {direction} {role}', seq);
    END LOOP;
END $$
"""


def enable_sql(table: str) -> list[str]:
    """The statements that put `table` under the tenant policy."""
    return [
        f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {TENANT_ROLE}",
        _GRANT_SEQUENCES.format(table=table, verb="GRANT", direction="TO", role=TENANT_ROLE),
        f"ALTER TABLE {table} ENABLE ROW LEVEL SECURITY",
        f"CREATE POLICY {POLICY} ON {table} TO {TENANT_ROLE} USING ({_CONDITION}) WITH CHECK ({_CONDITION})",
    ]


def disable_sql(table: str) -> list[str]:
    """The statements that undo `enable_sql(table)`."""
    return [
        f"DROP POLICY IF EXISTS {POLICY} ON {table}",
        f"ALTER TABLE {table} DISABLE ROW LEVEL SECURITY",
        _GRANT_SEQUENCES.format(table=table, verb="REVOKE", direction="FROM", role=TENANT_ROLE),
        f"REVOKE ALL ON {table} FROM {TENANT_ROLE}",
    ]


def enable_tenant_rls(op: Any, table: str) -> None:
    """In a migration's upgrade(): put a table with a tenant_id column under the tenant policy."""
    for statement in enable_sql(table):
        op.execute(statement)


def disable_tenant_rls(op: Any, table: str) -> None:
    """In a migration's downgrade(): the reverse of enable_tenant_rls."""
    for statement in disable_sql(table):
        op.execute(statement)
