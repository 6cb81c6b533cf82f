"""`chatmem memory reindex`: rebuild the memory index with the configured encoder (and this version's
pipeline: what is embedded, such as sentence keys), then switch."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chat_api.cli.installation import CommandError, installation_database, load_settings, positive_int

if TYPE_CHECKING:
    from memory.recall.reindex import Progress
    from memory.storage.db import Database


def add_memory_arguments(memory: argparse.ArgumentParser) -> None:
    memory_sub = memory.add_subparsers(dest="memory_command", required=True)
    reindex = memory_sub.add_parser(
        "reindex",
        help="rebuild the memory index (configured encoder, this pipeline) beside the old one, then switch",
    )
    reindex.add_argument(
        "--runtime", choices=["openvino", "torch"], help="encoder runtime (default: EMBEDDING_RUNTIME)"
    )
    reindex.add_argument("--status", action="store_true", help="print the index generations and exit")
    reindex.add_argument(
        "--replace", action="store_true", help="abandon a rebuild under way for another encoder"
    )
    reindex.add_argument("--batch", type=positive_int, default=64, help="rows embedded per batch")
    reindex.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="keep the old generation this long after the switch (processes move over), then delete it",
    )
    reindex.add_argument("--data-dir", type=Path, help="the `chatmem up` installation (without DATABASE_URL)")
    reindex.set_defaults(func=cmd_memory_reindex)


def cmd_memory_reindex(args: argparse.Namespace) -> None:
    overrides: dict[str, Any] = {"data_dir": args.data_dir} if args.data_dir else {}
    if args.runtime:
        overrides["embedding_runtime"] = args.runtime
    settings = load_settings(**overrides)
    with installation_database(settings) as database_url:
        asyncio.run(_reindex(args, settings, database_url))


def _print_generations(rows: list[dict[str, Any]]) -> None:
    from memory.recall.index import describe

    print(f"{'id':>3}  {'state':<9} {'rows':>9}  encoder")
    for row in rows:
        rows_text = f"{row['rows_done']}/{row['rows_total']}" if row["state"] == "building" else "-"
        line = f"{row['id']:>3}  {row['state']:<9} {rows_text:>9}  {describe(row['spec'])}"
        if row["state"] == "building" and not row["running"]:
            line += "  (no run is building it: run `chatmem memory reindex` to resume)"
        print(line)


class Pace:
    """A build's progress line: the rate and time left count the rows this run copied, not those
    an earlier run of a resumed build did (they made a fresh run look fast and nearly done)."""

    def __init__(self, done_before: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.done_before = done_before
        self.clock = clock
        self.started = clock()

    def line(self, p: Progress) -> str:
        rate = max(p.done - self.done_before, 0) / max(self.clock() - self.started, 1e-6)
        eta = (p.total - p.done) / rate if rate > 0 else float("inf")
        line = f"\r{p.done}/{p.total} rows, {rate:.0f} rows/s"
        return line + (", switched" if p.switched else f", about {eta:.0f} s left")


async def pace_of(db: Database, generation: int, clock: Callable[[], float] = time.monotonic) -> Pace:
    """The pace of a run building ``generation``, from the rows it already has."""
    from memory.recall import reindex

    done = [g["rows_done"] for g in await reindex.generations(db) if g["id"] == generation]
    return Pace(int(done[0] or 0) if done else 0, clock)


async def _reindex(args: argparse.Namespace, settings: Any, database_url: str) -> None:
    from memory.recall import reindex
    from memory.recall.embedding_service import EmbeddingRefused
    from memory.recall.embeddings import load_embedder
    from memory.recall.index import describe, spec_of
    from memory.storage.db import Database

    db = Database(database_url, pool_size=2)
    try:
        if args.status:
            _print_generations(await reindex.generations(db))
            return
        encoder = await load_embedder(settings, threads=0)
        requested = getattr(encoder, "requested_runtime", None)
        if requested is not None and getattr(encoder, "runtime", None) != requested:
            raise CommandError(
                f"the {requested} encoder did not load: {getattr(encoder, 'fallback_reason', None)}"
            )
        try:
            ids = await reindex.begin(db, encoder, replace=args.replace)
        except reindex.ReindexRefused as exc:
            raise CommandError(str(exc)) from None
        if ids is None:
            print(f"the memory index is already built by {describe(spec_of(encoder))}")
            # A run stopped in its grace period left the retired generation: nothing else deletes it.
            if deleted := await reindex.purge_retired(db, older_than_seconds=args.grace_seconds):
                print(f"deleted {deleted} rows of a retired generation")
            return
        old, new = ids
        encoder_name = describe(spec_of(encoder))
        print(f"building memory index generation {new} with {encoder_name} (searching {old} until done)")
        pace = await pace_of(db, new)

        def progress(p: reindex.Progress) -> None:
            print(pace.line(p), end="\n" if p.switched else "", file=sys.stdout, flush=True)

        try:
            await reindex.build(db, encoder, old, new, batch=args.batch, on_progress=progress)
        except (reindex.ReindexRefused, EmbeddingRefused) as exc:
            raise CommandError(str(exc)) from None
        print(
            f"generation {new} is active; generation {old} is kept {args.grace_seconds:.0f} s, then deleted"
        )
        await asyncio.sleep(args.grace_seconds)
        deleted = await reindex.purge_retired(db, older_than_seconds=args.grace_seconds)
        print(f"deleted {deleted} rows of the retired generation")
    finally:
        await db.dispose()
