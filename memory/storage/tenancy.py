"""The tenant a piece of work acts for, as Postgres row-level security sees it.

A request sets its tenant once (``chat_api.deps.current_owner``); every transaction that
starts while it is set runs as the ``chatmem_tenant`` role with ``chatmem.tenant_id`` set
to it (see ``memory.storage.db``), so the policies of migration 0003 hide every other tenant's
rows even from a query that forgot its ``WHERE tenant_id``. Both settings are
transaction-local: they revert at commit, and a pooled connection never carries them on.

The value lives in a context variable, so tasks started while it is set (a reply the
request launches) inherit it. Work that serves every tenant (the checkpointer, the
reaper, the indexer, anything batching across requests) must not: start it from the
lifespan, or inside ``unscoped()`` when it is created lazily from a request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Names fixed by migration 0003 (memory/storage/migrations/rls.py); kept here so that
# memory.storage.db needs no migration code.
TENANT_ROLE = "chatmem_tenant"
TENANT_SETTING = "chatmem.tenant_id"

_current: ContextVar[str | None] = ContextVar("chatmem_tenant", default=None)


def current_tenant() -> str | None:
    """The tenant transactions started now are scoped to, or None (the connecting role, unscoped)."""
    return _current.get()


def set_tenant(tenant_id: str) -> None:
    """Scope the rest of this task (and tasks it starts) to one tenant; a request does this once."""
    if not tenant_id:
        raise ValueError("a tenant scope needs a tenant id")
    _current.set(tenant_id)


@contextmanager
def tenant_scope(tenant_id: str) -> Iterator[None]:
    """Scope transactions started inside the block to one tenant (CLI commands, tests)."""
    if not tenant_id:
        raise ValueError("a tenant scope needs a tenant id")
    token = _current.set(tenant_id)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def unscoped() -> Iterator[None]:
    """Run the block, and tasks created in it, as the process (every tenant's rows).

    For shared workers created lazily inside a request (batchers, caches): they would
    otherwise inherit the first caller's tenant and serve everyone else with it.
    """
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)
