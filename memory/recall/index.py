"""Generations of the memory index: which encoder made each vector, and which one is searched.

Vectors from different encoders are never compared. Every memory row carries ``index_id``,
the generation it belongs to (``memory_indexes``); a generation's ``spec`` records what made
its vectors (model, the sha256 of its weights, runtime, dimension, and ``PIPELINE``: the
version of what the indexer embeds, bumped when that changes). One generation is
``active``: searched and written. ``chatmem memory reindex`` (memory/recall/reindex.py)
builds another beside it, never searched, and switches when it is complete.

``MemoryIndex`` is a process's view: the active generation and the encoder that made its
vectors. It is an ``Embedder`` itself (it encodes with the active generation's encoder), and
``generation()`` gives the pair (id, encoder) that a search or a write uses together, so a
query vector is compared only with rows its own encoder made, and a row is written only
into the generation whose encoder made its vector. It re-reads the active generation at
most every ``check_seconds`` (and ``follow``, a loop of each API process, makes it look that
often when no search comes); after a switch it loads the new generation's encoder (a local
runtime of the same weights) in the background and keeps using the old, complete
generation until that is ready (retired rows are kept for a grace period). A process that
cannot load it refuses memory (``refused``: searches and writes raise ``ForeignGeneration``)
rather than answer from a retired generation that stops being written and is then deleted, and
tries again after ``RETRY_SECONDS``, then less and less often.

A generation is known by its id and its encoder's key together. An empty generation (no row,
no build) is taken over by the first process to start with another encoder (``start``), so the
key of a generation another process already uses can change under it. One rule covers that and
a switch alike: a process that finds the active (id, key) is not the one it uses loads that
encoder if it can and moves to it, and until it has, it writes nothing there; if it cannot, it
refuses memory (``generation()`` raises ``ForeignGeneration``, as ``start`` refuses a generation
made by an encoder it cannot load); and it never searches a generation of its own id whose key
is not its own. The search statement carries
the key too (memory/recall/index_search.py): a process that has not read the generation again
since it was taken over finds it out at its next search, which raises ``ForeignGeneration`` rather
than rank the other encoder's rows by its own query vector, and reads it again at once.

Writers (the indexer pipeline, stated facts, corrections) call ``write_guard`` in their write
transaction: it takes the index lock shared and checks, in the write's own transaction, that the
generation (id and key) they encoded for is still the active one; a reindex's switch and a
take-over both take the lock exclusively, so no write straddles them (a write that lost the race
raises ``IndexChanged`` and is retried: the indexer's batch is redelivered). So the vectors of
two encoders are never mixed in one generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.config import Settings
from memory.recall.embeddings import RUNTIMES, Embedder
from memory.storage.db import Database

log = logging.getLogger(__name__)

# The version of what the indexer embeds (unit of memory, chunking, the text a memory is
# embedded as). Changing what is embedded bumps it, and existing memories are rebuilt with
# `chatmem memory reindex`. 2: sentence keys of long chunks a person wrote (memory/recall/sentence_keys.py).
PIPELINE = "2"
# The advisory lock writers hold shared and a switch holds exclusively.
INDEX_LOCK = 0x28_1DE7
# The spec fields that decide whether two vectors may be compared (the model's path or a
# service's address do not: the same weights give the same vectors wherever they live). An
# embedding service is known by the model it is asked for (memory/recall/embedding_service.py).
KEY_FIELDS = ("runtime", "source_sha256", "service_model", "dim", "pipeline", "seed")

ACTIVE = text("SELECT id, spec, spec_key FROM memory_indexes WHERE state = 'active'")
ACTIVE_LOCKED = text("SELECT id, spec, spec_key FROM memory_indexes WHERE state = 'active' FOR UPDATE")
HAS_ROWS = text("SELECT EXISTS (SELECT 1 FROM memory_items WHERE index_id = :id)")
BUILDING = text("SELECT id FROM memory_indexes WHERE state = 'building'")
ADOPT = text("UPDATE memory_indexes SET spec = CAST(:spec AS jsonb), spec_key = :key WHERE id = :id")
CREATE_ACTIVE = text(
    "INSERT INTO memory_indexes (spec, spec_key, state, activated_at) "
    "VALUES (CAST(:spec AS jsonb), :key, 'active', now()) RETURNING id"
)
LOCK_SHARED = text(f"SELECT pg_advisory_xact_lock_shared({INDEX_LOCK})")
LOCK_EXCLUSIVE = text(f"SELECT pg_advisory_xact_lock({INDEX_LOCK})")
# An encoder that could not be loaded is tried again after RETRY_SECONDS, then twice as long each
# time up to RETRY_MAX_SECONDS, not at each look: a failed local load costs a model load (0.1-0.4 s
# of CPU, and about 5 s the first time, when torch is imported).
RETRY_SECONDS = 30.0
RETRY_MAX_SECONDS = 600.0


class IndexChanged(RuntimeError):
    """The active generation changed while a write was encoding: encode again and retry."""


class ForeignGeneration(IndexChanged):
    """The active generation's vectors are made by an encoder this process cannot load (taken over,
    or switched to by a reindex): it searches and writes no generation (retried, as IndexChanged: a
    load that succeeds later, a restart with that encoder, or a reindex with this one ends it)."""


def spec_of(embedder: Embedder) -> dict[str, Any]:
    """What makes this embedder's vectors, as a generation records it."""
    spec = dict(getattr(embedder, "spec", None) or {"runtime": type(embedder).__name__})
    spec.setdefault("dim", embedder.dim)
    spec["pipeline"] = PIPELINE
    return spec


def spec_key(spec: dict[str, Any]) -> str:
    """The canonical string two processes compare: same key, comparable vectors."""
    return json.dumps({k: spec[k] for k in KEY_FIELDS if spec.get(k) is not None}, sort_keys=True)


def same_vectors(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The two specs' encoders make the same vectors (the pipeline aside)."""
    return spec_key({**a, "pipeline": None}) == spec_key({**b, "pipeline": None})


def describe(spec: dict[str, Any]) -> str:
    return f"{spec.get('runtime')}/{spec.get('model', '?')}/pipeline {spec.get('pipeline')}"


@dataclass(frozen=True, slots=True)
class Retry:
    """When this process tries again to load the encoder of generation key ``key``."""

    key: str
    at: float  # time.monotonic()
    delay: float


@dataclass(frozen=True, slots=True)
class Generation:
    """A generation of the index and the encoder whose vectors it holds."""

    id: int
    embedder: Embedder
    key: str


# Given a generation's spec, an encoder that makes its vectors (loaded), or None if this
# process cannot make one (another model, a service it cannot reach).
EncoderLoader = Callable[[dict[str, Any]], Embedder | None]


def foreign(spec: dict[str, Any]) -> str:
    """Why this process cannot use a generation made by ``spec``'s encoder, and what to do."""
    return (
        f"the memory index was built by {describe(spec)}, which this process cannot load; "
        "configure that encoder, or run `chatmem memory reindex` with this one"
    )


class MemoryIndex:
    """This process's active generation and its encoder; an Embedder that encodes for it."""

    def __init__(
        self,
        db: Database,
        embedder: Embedder,
        *,
        loader: EncoderLoader | None = None,
        check_seconds: float = 2.0,
        retry_seconds: float = RETRY_SECONDS,
        on_refused: Callable[[str | None], None] | None = None,
    ) -> None:
        self._db = db
        self.configured = embedder
        self.dim = embedder.dim
        self.configured_key = spec_key(spec_of(embedder))
        self._loader = loader
        self._encoders: dict[str, Embedder] = {self.configured_key: embedder}
        self._current: Generation | None = None
        self._checked = 0.0
        self._check_seconds = check_seconds
        self._loading: asyncio.Task[None] | None = None
        self._retry_seconds = retry_seconds
        self._retry: Retry | None = None  # the active generation's encoder could not be loaded
        self.mismatch: str | None = None  # why the configured encoder is not the one in use
        self._on_refused = on_refused
        self._refused: str | None = None

    @property
    def refused(self) -> str | None:
        """Why this process refuses memory now, or None: set while the active generation is made by
        an encoder it cannot load (``_load_then_switch``), or while it loads the encoder of the
        generation in use, taken over; searches and writes raise meanwhile."""
        return self._refused

    @refused.setter
    def refused(self, reason: str | None) -> None:
        self._refused = reason
        if self._on_refused is not None:
            self._on_refused(reason)  # the API's gauge (chat_api/metrics.py)

    async def start(self) -> Generation:
        """Find (or make) the active generation and the encoder of its vectors."""
        async with self._db.transaction() as session:
            await session.execute(LOCK_EXCLUSIVE)
            row = (await session.execute(ACTIVE_LOCKED)).one_or_none()
            spec = spec_of(self.configured)
            if row is None:
                new_id = (
                    await session.execute(
                        CREATE_ACTIVE, {"spec": json.dumps(spec), "key": self.configured_key}
                    )
                ).scalar_one()
                row_id, key, active_spec = int(new_id), self.configured_key, spec
            elif row.spec_key != self.configured_key and not await self._in_use(session, int(row.id)):
                # No vector exists yet: the first encoder to start makes them all.
                await session.execute(
                    ADOPT, {"spec": json.dumps(spec), "key": self.configured_key, "id": row.id}
                )
                row_id, key, active_spec = int(row.id), self.configured_key, spec
            else:
                row_id, key, active_spec = int(row.id), row.spec_key, row.spec
        encoder = await self._encoder_for(key, active_spec)
        if encoder is None:
            raise ForeignGeneration(foreign(active_spec))
        if key != self.configured_key:
            configured = describe(spec_of(self.configured))
            self.mismatch = (
                f"memory index built by {describe(active_spec)}, configured {configured}: "
                "answering from the built index; run `chatmem memory reindex` to rebuild it"
            )
            log.warning("%s", self.mismatch)
        self._current = Generation(row_id, encoder, key)
        self.refused = None
        self._checked = time.monotonic()
        return self._current

    @staticmethod
    async def _in_use(session: AsyncSession, generation_id: int) -> bool:
        if (await session.execute(BUILDING)).first() is not None:
            return True
        return bool((await session.execute(HAS_ROWS, {"id": generation_id})).scalar())

    async def _encoder_for(self, key: str, spec: dict[str, Any]) -> Embedder | None:
        if key in self._encoders:
            return self._encoders[key]
        if same_vectors(spec, spec_of(self.configured)):
            # Built by an older pipeline with this very encoder: searched as it is until a reindex.
            self._encoders[key] = self.configured
            return self.configured
        if self._loader is None:
            return None
        encoder = await asyncio.to_thread(self._loader, spec)
        if encoder is not None:
            self._encoders[key] = encoder
        return encoder

    async def generation(self) -> Generation:
        """The generation to search and write now, with its encoder."""
        if self._current is None:
            return await self.start()
        if time.monotonic() - self._checked >= self._check_seconds:
            self._checked = time.monotonic()
            await self._refresh()
        if self.refused is not None:
            raise ForeignGeneration(self.refused)
        return self._current

    async def _refresh(self) -> None:
        async with self._db.session() as session:
            row = (await session.execute(ACTIVE)).one_or_none()
        current = self._current
        if row is None or current is None or (int(row.id), row.spec_key) == (current.id, current.key):
            return
        generation_id, key = int(row.id), row.spec_key
        if key in self._encoders:
            self._switch(generation_id, key)
            return
        # Taken over (start): the generation in use holds that encoder's rows now, and no other
        # generation keeps this process's, so it refuses at once and waits for the load. Switched
        # to by a reindex: the retired generation is complete, searched until the load ends.
        taken_over = generation_id == current.id
        if taken_over and self.refused is None:
            self.refused = (
                f"memory index generation {generation_id} was taken over by {describe(row.spec)}: loading"
            )
            log.warning("%s", self.refused)
        if self._loading is not None and not self._loading.done():
            return
        retry = self._retry
        if retry is not None and retry.key == key and time.monotonic() < retry.at:
            return  # could not be loaded a moment ago: not again at each look
        if retry is None or retry.key != key:
            log.info(
                "memory index generation %d is active: loading its encoder (%s)",
                generation_id,
                describe(row.spec),
            )
        self._loading = asyncio.create_task(self._load_then_switch(generation_id, key, row.spec))
        if taken_over:
            await asyncio.shield(self._loading)  # nothing to answer from meanwhile

    def _switch(self, generation_id: int, key: str) -> None:
        log.info("memory index switched to generation %d", generation_id)
        if self.refused is not None:
            log.warning(
                "memory index generation %d: its encoder is loaded, memory is available again", generation_id
            )
        self._current = Generation(generation_id, self._encoders[key], key)
        self.mismatch = None if key == self.configured_key else self.mismatch
        self._retry = None
        self.refused = None

    async def _load_then_switch(self, generation_id: int, key: str, spec: dict[str, Any]) -> None:
        """Load the active generation's encoder and move to it. If it cannot be loaded, refuse
        memory, whether the generation was taken over or switched to (the retired generation's
        rows go after the grace period, and writes go to the active one only), and try again
        later, each time after twice as long; the log says so once, not at each try."""
        retry = self._retry if self._retry is not None and self._retry.key == key else None
        try:
            encoder = await self._encoder_for(key, spec)
        except Exception:
            log.log(
                logging.DEBUG if retry else logging.ERROR,
                "could not load the encoder of memory index generation %d",
                generation_id,
                exc_info=True,
            )
            encoder = None
        if encoder is not None:
            self._switch(generation_id, key)
            return
        delay = self._retry_seconds if retry is None else min(retry.delay * 2, RETRY_MAX_SECONDS)
        self._retry = Retry(key, time.monotonic() + delay, delay)
        if retry is None or self.refused is None:
            self.refused = foreign(spec)
            log.error(
                "memory index generation %d: %s; memory refused, trying again in %.0f s, then less often",
                generation_id,
                self.refused,
                delay,
            )
        else:
            log.debug(
                "memory index generation %d: its encoder still cannot be loaded (next try in %.0f s)",
                generation_id,
                delay,
            )

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Vectors for the active generation (callers that also search or write use ``generation()``)."""
        return await (await self.generation()).embedder.embed(texts)

    def generation_encoder(self) -> Embedder:
        """The encoder of the generation in use (the configured one unless the index was built by another)."""
        return self._current.embedder if self._current is not None else self.configured

    def current(self) -> Generation | None:
        """The generation in use as last read (no database read; None before ``start``)."""
        return self._current

    async def follow(self, stop: asyncio.Event) -> None:
        """Look for a switched generation every ``check_seconds`` until ``stop``, searches or not.

        A process that serves no search would otherwise keep the retired generation until its
        next search, after the reindex's grace period deleted that generation's rows: that
        search, and those made while the new encoder loads, would find nothing.
        """
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(self._check_seconds, 0.1))
            if stop.is_set():
                return
            try:
                await self.generation()
            except Exception as exc:  # the database away: readiness says so; look again later
                log.debug("memory index: the active generation could not be read: %r", exc)

    def look_again(self) -> None:
        """Re-read the active generation at the next call (a write found it changed)."""
        self._checked = 0.0


async def generation_of(embedder: Embedder, db: Database) -> Generation:
    """The generation ``embedder`` encodes for.

    A MemoryIndex (what the API and the indexer use) knows it. A bare encoder (tests and
    benchmarks that build their index with it) is checked like a starting process: it must
    be the encoder of the active generation (or the index must be empty).
    """
    if isinstance(embedder, MemoryIndex):
        return await embedder.generation()
    return await MemoryIndex(db, embedder).start()


def current_generation(embedder: Embedder) -> Generation | None:
    """The generation a MemoryIndex uses now, without reading the database; None for a bare encoder.

    For work started ahead of a search (memory/recall/prepared_queries.py): the search checks
    the generation again (``generation_of``) and drops what was made for another.
    """
    return embedder.current() if isinstance(embedder, MemoryIndex) else None


def look_again(embedder: Embedder) -> None:
    """A search or a write found the generation changed: a MemoryIndex re-reads it at its next call."""
    if isinstance(embedder, MemoryIndex):
        embedder.look_again()


@contextlib.contextmanager
def looking_again_if_taken_over(embedder: Embedder) -> Iterator[None]:
    """Around a search of the generation: ``ForeignGeneration`` (another encoder took it over since
    this process last read it) goes on up, and a MemoryIndex re-reads the generation at its next call."""
    try:
        yield
    except ForeignGeneration:
        look_again(embedder)
        raise


async def write_guard(session: AsyncSession, embedder: Embedder, generation: Generation) -> None:
    """In a write's transaction: hold the index lock shared, and check the generation is still the
    active one, made by the encoder the write's vectors come from (its id and its key)."""
    await session.execute(LOCK_SHARED)
    active = (await session.execute(ACTIVE)).one_or_none()
    if active is None:
        raise LookupError("the memory index has no active generation")
    if (int(active.id), active.spec_key) != (generation.id, generation.key):
        look_again(embedder)
        if int(active.id) == generation.id:
            raise IndexChanged(
                f"memory index generation {generation.id} is made by {describe(active.spec)} now, "
                "not by the encoder of this write"
            )
        raise IndexChanged(f"memory index generation {generation.id} is no longer active ({active.id} is)")


def local_loader(settings: Settings, *, threads: int) -> EncoderLoader:
    """Loads an encoder for a generation made by a local runtime of the configured model's weights."""

    def load(spec: dict[str, Any]) -> Embedder | None:
        from memory.recall.embeddings import configured_embedder

        if spec.get("runtime") not in RUNTIMES:
            return None
        encoder = configured_embedder(settings.model_copy(update={"embedding_runtime": spec["runtime"]}))
        encoder.load(threads=threads)
        # Another model's weights, or an OpenVINO that fell back to torch: not that generation's encoder.
        # An older pipeline's generation is searched with the same encoder (its rows lack what the
        # newer pipeline adds, such as sentence keys, until `chatmem memory reindex` rebuilds it).
        return encoder if same_vectors(spec_of(encoder), spec) else None

    return load


async def open_index(
    db: Database,
    settings: Settings,
    embedder: Embedder,
    *,
    threads: int,
    on_refused: Callable[[str | None], None] | None = None,
) -> MemoryIndex:
    """The process's MemoryIndex over ``embedder`` (the configured encoder, loaded), started.

    ``on_refused`` is told each time the index sets or clears why it refuses memory.
    """
    index = MemoryIndex(db, embedder, loader=local_loader(settings, threads=threads), on_refused=on_refused)
    await index.start()
    return index
