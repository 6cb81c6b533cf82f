"""The embedded Postgres of `chatmem up` across a crash of the process that started it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from memory.storage.embedded import EmbeddedPostgres

HOLD = (
    "import sys, pathlib\n"
    "from memory.storage.embedded import EmbeddedPostgres\n"
    "EmbeddedPostgres(pathlib.Path(sys.argv[1])).start()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_the_embedded_postgres_is_stopped_after_a_crash_of_the_process_that_started_it(
    tmp_path: Path,
) -> None:
    """`chatmem up` killed with SIGKILL, then started again on the same data directory and stopped:
    the Postgres it attached to was left running, because the killed process was still counted as
    one of its users."""
    crashed = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert crashed.stdout is not None and crashed.stdout.readline().strip() == "ready"
    finally:
        crashed.send_signal(signal.SIGKILL)
        crashed.wait(10)
    postmaster = tmp_path / "pg" / "postmaster.pid"
    assert postmaster.exists()  # the killed process's Postgres outlives it
    again = EmbeddedPostgres(tmp_path)
    again.start()
    again.stop()
    assert not postmaster.exists()
