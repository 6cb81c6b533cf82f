"""Rebuild the memory index with another encoder beside the old one, then switch.

``chatmem memory reindex`` registers a ``building`` generation for its encoder's spec and
fills it from the active generation: every memory row (chunks of turns, stated facts,
corrections, tombstones) is copied with its text embedded again by the new encoder, so the
user's corrections and forgets carry over exactly. Searches keep reading the active
generation the whole time (a building generation is never searched).

Memory keeps arriving while it runs. Writers write the active generation only (memory/recall/
index.py); the build catches up in passes: each pass re-copies the rows of the active
generation that are missing from the new one or differ from their copy, and deletes copies
whose row is gone. A batch encodes what it read with no lock held, then copies only the rows
still as it read them (the same row version): a memory corrected, forgotten or switched off
its branch meanwhile is left stale, and the next pass copies it with its new text's vector
(the last one reads it again at once). When a pass finds little left, the last pass runs under the index lock
held exclusively (writers of new vectors wait for it, a moment) and, in the same
transaction, the new generation becomes ``active`` and the old one ``retired``. So the
switch is one commit, and the new generation holds every memory the old one held at that
moment. Processes see the switch within their check interval and load the new encoder;
until then they search the retired generation, which stays complete and is deleted after
a grace period.

What is copied are the chunks (the memories); their sentence keys (memory/recall/
sentence_keys.py) are made again from each copied chunk's text, as the indexer makes them,
so a rebuild also serves a change of the ``PIPELINE`` version that only adds or changes keys
(version 2 added them: an index built before gets its keys from `chatmem memory reindex`
with the same encoder). Fact keys (memory/recall/fact_keys.py) are made by a model, not
from the text: a copied chunk's facts are copied from the old generation, their stored text
embedded again, and the model is never asked. A corrected or forgotten chunk gets none.
A change of the chunks
themselves (other chunk sizes, other text) would need the indexer pipeline run over the
turns; that is not built.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.types import BigInteger, Text

from memory.recall.embedding_service import EmbeddingUnavailable
from memory.recall.embeddings import Embedder
from memory.recall.index import LOCK_EXCLUSIVE, LOCK_SHARED, describe, spec_key, spec_of
from memory.recall.keywords import memory_text, photo_caption
from memory.recall.sentence_keys import sentence_keys
from memory.storage.db import Database

log = logging.getLogger(__name__)

# A run of the command holds this advisory lock (this class, the generation's id) shared, on a
# connection of its own, while it builds: Postgres frees it when the run ends, killed or not. A
# building generation whose lock nobody holds has no run (it waits for the command to resume it).
BUILD_LOCK_CLASS = 0x28_1DE8
HOLD_BUILD = text(f"SELECT pg_advisory_lock_shared({BUILD_LOCK_CLASS}, CAST(:id AS int))")
RELEASE_BUILD = text(f"SELECT pg_advisory_unlock_shared({BUILD_LOCK_CLASS}, CAST(:id AS int))")


def build_running(generation: str) -> str:
    """SQL: whether a run of the command holds the build lock of ``generation`` (an id column)."""
    return (
        "EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        f" AND classid = {BUILD_LOCK_CLASS} AND objid = CAST({generation} AS oid))"
    )


GENERATIONS = text(
    "SELECT id, spec, spec_key, state, created_at, activated_at, retired_at, rows_total, rows_done, "
    f"state = 'building' AND {build_running('id')} AS running "
    "FROM memory_indexes ORDER BY id"
)
ACTIVE = text("SELECT id, spec, spec_key FROM memory_indexes WHERE state = 'active' FOR UPDATE")
BUILDING = text("SELECT id, spec, spec_key FROM memory_indexes WHERE state = 'building' FOR UPDATE")
CREATE_BUILDING = text(
    "INSERT INTO memory_indexes (spec, spec_key, state, rows_total) "
    "VALUES (CAST(:spec AS jsonb), :key, 'building', "
    "(SELECT count(*) FROM memory_items WHERE index_id = :active AND kind = 'chunk')) RETURNING id"
)
DROP_BUILDING = text("DELETE FROM memory_indexes WHERE id = :id")
DELETE_ROWS = text(
    "DELETE FROM memory_items WHERE id IN (SELECT id FROM memory_items WHERE index_id = :id LIMIT :batch)"
)

# The columns a copy carries over as they are (everything but the id, the generation and the vector).
_COPIED = (
    "tenant_id, user_id, conversation_id, turn_id, chunk_index, turn_seq, role, name, text, search_terms, "
    "turn_created_at, external_id, metadata, on_active_branch, indexed_at, deleted_at, source, edited_at, "
    "forgotten_at"
)
_COMPARED = ", ".join(f"{{t}}.{c.strip()}" for c in _COPIED.split(",") if c.strip() != "indexed_at")

# Chunks of the old generation whose copy is missing or differs, in id order from :after; each with
# its row version (xmin: the transaction that wrote it), for COPY to take it only as it was read.
STALE = text(
    f"""
    SELECT a.id, a.xmin::text AS version, a.turn_id, a.chunk_index, a.role, a.text, a.name,
           a.turn_created_at, a.metadata,
           a.embedding IS NULL AS tombstone,
           a.source = 'turn' AND a.edited_at IS NULL AND a.forgotten_at IS NULL AS keyed
    FROM memory_items a
    LEFT JOIN memory_items b
      ON b.index_id = :new AND b.turn_id = a.turn_id AND b.kind = 'chunk' AND b.chunk_index = a.chunk_index
     AND b.key_index = 0
    WHERE a.index_id = :old AND a.kind = 'chunk' AND a.id > :after
      AND (b.id IS NULL OR ({_COMPARED.format(t="a")}) IS DISTINCT FROM ({_COMPARED.format(t="b")}))
    ORDER BY a.id
    LIMIT :batch
    """
)
# The rows as they were read and encoded: a row written since (corrected, forgotten, switched off
# its branch) is not copied with the vector of its old text; it is stale still, for the next pass.
COPY = text(
    f"""
    INSERT INTO memory_items (index_id, embedding, {_COPIED})
    SELECT :new, CAST(v.embedding AS vector), {", ".join("a." + c.strip() for c in _COPIED.split(","))}
    FROM unnest(:ids, :versions, :embeddings) AS v(id, version, embedding)
    JOIN memory_items a ON a.id = v.id AND a.xmin::text = v.version
    ON CONFLICT (index_id, turn_id, kind, chunk_index, key_index) DO UPDATE SET
        embedding = EXCLUDED.embedding,
        {", ".join(f"{c.strip()} = EXCLUDED.{c.strip()}" for c in _COPIED.split(","))}
    RETURNING turn_id, chunk_index
    """
).bindparams(
    bindparam("ids", type_=ARRAY(BigInteger)),
    bindparam("versions", type_=ARRAY(Text)),
    bindparam("embeddings", type_=ARRAY(Text)),
)
# The keys of the copied chunks are made again (below): the old ones go first.
DELETE_KEYS = text(
    """
    DELETE FROM memory_items b
    USING memory_items a
    WHERE a.id = ANY(:ids) AND b.index_id = :new AND b.kind <> 'chunk'
      AND b.turn_id = a.turn_id AND b.chunk_index = a.chunk_index
    """
).bindparams(bindparam("ids", type_=ARRAY(BigInteger)))
# A copied chunk's sentence keys: its columns, the key's text and vector, no keyword terms.
_KEY_COLUMNS = (
    "tenant_id, user_id, conversation_id, turn_id, chunk_index, turn_seq, role, name, turn_created_at, "
    "external_id, metadata, on_active_branch, deleted_at, source"
)
INSERT_KEYS = text(
    f"""
    INSERT INTO memory_items (index_id, kind, key_index, text, search_terms, embedding, {_KEY_COLUMNS})
    SELECT :new, :kind, v.key_index, v.text, to_tsvector('simple', ''), CAST(v.embedding AS vector),
           {", ".join("a." + c.strip() for c in _KEY_COLUMNS.split(","))}
    FROM unnest(:ids, :key_indexes, :texts, :embeddings) AS v(id, key_index, text, embedding)
    JOIN memory_items a ON a.id = v.id
    """
).bindparams(
    bindparam("ids", type_=ARRAY(BigInteger)),
    bindparam("key_indexes", type_=ARRAY(BigInteger)),
    bindparam("texts", type_=ARRAY(Text)),
    bindparam("embeddings", type_=ARRAY(Text)),
)
# The fact keys of these chunks in the old generation: copied with their text embedded again.
OLD_FACTS = text(
    """
    SELECT a.id, f.key_index, f.text, a.name, a.turn_created_at
    FROM memory_items a
    JOIN memory_items f
      ON f.index_id = a.index_id AND f.kind = 'fact' AND f.turn_id = a.turn_id
     AND f.chunk_index = a.chunk_index
    WHERE a.id = ANY(:ids)
    ORDER BY a.id, f.key_index
    """
).bindparams(bindparam("ids", type_=ARRAY(BigInteger)))
# Copies (and keys) whose chunk is gone from the old generation (a stated fact forgotten, a turn deleted).
ORPHANS = text(
    """
    DELETE FROM memory_items b
    WHERE b.index_id = :new AND NOT EXISTS (
        SELECT 1 FROM memory_items a
        WHERE a.index_id = :old AND a.turn_id = b.turn_id AND a.kind = 'chunk'
          AND a.chunk_index = b.chunk_index
    )
    """
)
# Progress counts chunks (the memories): a rebuild may make more or fewer keys than the old one had.
PROGRESS = text(
    "UPDATE memory_indexes SET rows_done = "
    "(SELECT count(*) FROM memory_items WHERE index_id = :new AND kind = 'chunk'), "
    "rows_total = (SELECT count(*) FROM memory_items WHERE index_id = :old AND kind = 'chunk') "
    "WHERE id = :new"
)
STATES = text("SELECT id, state FROM memory_indexes WHERE id IN (:old, :new)")
CHUNKS = text("SELECT count(*) FROM memory_items WHERE index_id = :id AND kind = 'chunk'")
RETIRE = text("UPDATE memory_indexes SET state = 'retired', retired_at = now() WHERE id = :old")
ACTIVATE = text("UPDATE memory_indexes SET state = 'active', activated_at = now() WHERE id = :new")


class ReindexRefused(RuntimeError):
    """Another build is under way for another encoder (or replaced this one)."""


class _BuildOver(Exception):
    """The generation is no longer being built beside the active one: another run switched to it
    (``state`` 'active'), or abandoned it (``--replace``: gone)."""

    def __init__(self, state: str | None) -> None:
        super().__init__(state)
        self.state = state


async def _hold_building(session: Any, old: int, new: int) -> None:
    """In a transaction that writes ``new``: the index lock shared, and ``new`` still being built."""
    await session.execute(LOCK_SHARED)
    await _still_building(session, old, new)


async def _still_building(session: Any, old: int, new: int) -> None:
    """Raise _BuildOver unless ``new`` is still being built beside the active ``old``.

    Called under the index lock (shared for a batch, exclusive for the switch), so no switch or
    replacement by another run of the command can come between this check and the writes after it.
    """
    states = {int(r.id): r.state for r in await session.execute(STATES, {"old": old, "new": new})}
    if states.get(old) != "active" or states.get(new) != "building":
        raise _BuildOver(states.get(new))


@dataclass(slots=True)
class Progress:
    generation: int
    done: int
    total: int
    switched: bool = False


def _vector_literal(vector: list[float]) -> str:
    return "[" + ",".join(format(float(x), ".8g") for x in vector) + "]"


def _embedded_text(row: Any) -> str:
    # As the indexer and the items API embed a memory (indexer/pipeline.py, memory/recall/access.py).
    return memory_text(
        row.text, name=row.name, created_at=row.turn_created_at, extra=photo_caption(row.metadata)
    )


async def generations(db: Database) -> list[dict[str, Any]]:
    """Every generation of the index, oldest first (for `--status` and /metrics)."""
    async with db.session() as session:
        return [dict(row._mapping) for row in await session.execute(GENERATIONS)]


async def begin(db: Database, encoder: Embedder, *, replace: bool = False) -> tuple[int, int] | None:
    """Register (or resume) the building generation for ``encoder``: (old, new) ids, or None if
    the active generation is already made by it."""
    spec = spec_of(encoder)
    key = spec_key(spec)
    async with db.transaction() as session:
        await session.execute(LOCK_EXCLUSIVE)
        active = (await session.execute(ACTIVE)).one()
        if active.spec_key == key:
            return None
        building = (await session.execute(BUILDING)).one_or_none()
        if building is not None and building.spec_key == key:
            return int(active.id), int(building.id)
        if building is not None:
            if not replace:
                raise ReindexRefused(
                    f"a rebuild for {describe(building.spec)} is under way (generation {building.id}); "
                    "pass --replace to abandon it"
                )
            await _drop_rows(db, int(building.id))
            await session.execute(DROP_BUILDING, {"id": building.id})
        new_id = (
            await session.execute(
                CREATE_BUILDING, {"spec": json.dumps(spec), "key": key, "active": active.id}
            )
        ).scalar_one()
        return int(active.id), int(new_id)


async def _drop_rows(db: Database, generation: int, batch: int = 5000) -> int:
    deleted = 0
    while True:
        async with db.transaction() as session:
            result = await session.execute(DELETE_ROWS, {"id": generation, "batch": batch})
            n = int(getattr(result, "rowcount", 0) or 0)
        deleted += n
        if n < batch:
            return deleted


async def _texts_of(session: Any, rows: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any], list[str]]:
    """The stale rows' live chunks, sentence keys, fact keys and the texts to embed, in that order."""
    live = [r for r in rows if not r.tombstone]
    keys = [
        (r, key_index, sentence)
        for r in live
        if r.keyed
        for key_index, sentence in enumerate(sentence_keys(r.text, role=r.role, name=r.name))
    ]
    keyed = [r.id for r in live if r.keyed]
    facts = list(await session.execute(OLD_FACTS, {"ids": keyed})) if keyed else []
    texts = (
        [_embedded_text(r) for r in live]
        + [memory_text(sentence, name=r.name, created_at=r.turn_created_at) for r, _, sentence in keys]
        + [memory_text(f.text, name=f.name, created_at=f.turn_created_at) for f in facts]
    )
    return live, keys, facts, texts


async def _encode_into(encoder: Embedder, texts: Sequence[str], encoded: dict[str, str]) -> None:
    if texts:
        vectors = await encoder.embed(list(texts))
        encoded.update(zip(texts, (_vector_literal(list(v)) for v in vectors), strict=True))


async def _encode_stale(
    db: Database, encoder: Embedder, old: int, new: int, batch: int, encoded: dict[str, str]
) -> None:
    """Encode what the last pass will copy, with no lock held: its vectors go into ``encoded``."""
    after = 0
    while True:
        async with db.transaction() as session:
            rows = (
                await session.execute(STALE, {"old": old, "new": new, "after": after, "batch": batch})
            ).all()
            if not rows:
                return
            texts = (await _texts_of(session, rows))[3]
        await _encode_into(encoder, [t for t in dict.fromkeys(texts) if t not in encoded], encoded)
        after = int(rows[-1].id)


# Times the last pass is rolled back to encode rows written before it took the exclusive lock.
_UNLOCKED_ENCODES = 5


class _Unencoded(Exception):
    """The last pass under the exclusive lock found texts not encoded beforehand (written meanwhile)."""


async def _copy_batch(
    session: Any,
    encoder: Embedder,
    old: int,
    new: int,
    after: int,
    batch: int,
    *,
    locked: bool = False,
    encoded: dict[str, str] | None = None,
    strict: bool = False,
) -> tuple[int, int] | None:
    """Copy the next ``batch`` stale rows after id ``after``: the last id read and how many of its
    rows were written since they were read (not copied: still stale), None if none was left.

    ``locked``: the caller holds the index lock exclusively (the switch) and checked the states.
    ``encoded``: vectors encoded beforehand, by text; with ``locked`` and ``strict``, a text not
    among them raises _Unencoded (the caller rolls back and encodes it without the lock).
    """
    rows = (await session.execute(STALE, {"old": old, "new": new, "after": after, "batch": batch})).all()
    if not rows:
        if not locked:
            await _hold_building(session, old, new)  # the pass's progress is written next
        return None
    live, keys, facts, texts = await _texts_of(session, rows)
    if encoded is None:
        vectors = [_vector_literal(list(v)) for v in await encoder.embed(texts)] if texts else []
    else:
        missing = list(dict.fromkeys(t for t in texts if t not in encoded))
        if missing and locked and strict:
            raise _Unencoded(len(missing))
        await _encode_into(encoder, missing, encoded)
        vectors = [encoded[t] for t in texts]
    by_id = dict(zip((r.id for r in live), vectors, strict=False))
    ids = [r.id for r in rows]
    if not locked:
        # Only now, after the encoding: a switch waits for this batch's writes, never its encoder.
        await _hold_building(session, old, new)
    written = await session.execute(
        COPY,
        {
            "new": new,
            "ids": ids,
            "versions": [r.version for r in rows],
            "embeddings": [by_id.get(i) for i in ids],
        },
    )
    # The keys go with the chunks copied as read; those of a row written since are made with it.
    copied_keys = {(r.turn_id, r.chunk_index) for r in written}
    copied = {r.id for r in rows if (r.turn_id, r.chunk_index) in copied_keys}
    await session.execute(DELETE_KEYS, {"new": new, "ids": sorted(copied)})
    sentence_rows = [(i, key) for i, key in enumerate(keys) if key[0].id in copied]
    if sentence_rows:
        await session.execute(
            INSERT_KEYS,
            {
                "new": new,
                "kind": "sentence",
                "ids": [r.id for _, (r, _, _) in sentence_rows],
                "key_indexes": [key_index for _, (_, key_index, _) in sentence_rows],
                "texts": [sentence for _, (_, _, sentence) in sentence_rows],
                "embeddings": [vectors[len(live) + i] for i, _ in sentence_rows],
            },
        )
    fact_rows = [(i, f) for i, f in enumerate(facts) if f.id in copied]
    if fact_rows:
        await session.execute(
            INSERT_KEYS,
            {
                "new": new,
                "kind": "fact",
                "ids": [f.id for _, f in fact_rows],
                "key_indexes": [f.key_index for _, f in fact_rows],
                "texts": [f.text for _, f in fact_rows],
                "embeddings": [vectors[len(live) + len(keys) + i] for i, _ in fact_rows],
            },
        )
    return int(rows[-1].id), len(rows) - len(copied)


async def _pass(
    db: Database,
    encoder: Embedder,
    old: int,
    new: int,
    batch: int,
    on_progress: Callable[[Progress], None] | None = None,
    session: Any = None,
    encoded: dict[str, str] | None = None,
    strict: bool = False,
) -> int:
    """One pass over the old generation: copy what is missing or changed, drop orphans.

    Each batch commits on its own (a long build holds no lock and shows its progress),
    unless ``session`` is given (the last pass, under the exclusive lock). Returns the
    number of rows copied.
    """
    copied = 0
    after: int | None = 0
    while after is not None:
        if session is not None:
            copy = await _copy_batch(
                session, encoder, old, new, after, batch, locked=True, encoded=encoded, strict=strict
            )
            done, total = await _counts(session, old, new)
        else:
            async with db.transaction() as own:
                copy = await _copy_batch(own, encoder, old, new, after, batch)
                done, total = await _counts(own, old, new)
        after = None if copy is None else copy[0]
        if copy is not None:
            copied += 1
            if on_progress is not None:
                on_progress(Progress(new, done, total))
            if copy[1] and session is not None:
                # The last pass leaves nothing stale: a row written since it was read (forgotten,
                # switched off its branch: such writers do not wait for the index lock) is read again.
                after = 0
    if session is not None:
        await session.execute(ORPHANS, {"old": old, "new": new})
    else:
        async with db.transaction() as own:
            await _hold_building(own, old, new)
            await own.execute(ORPHANS, {"old": old, "new": new})
    return copied


async def build(
    db: Database,
    encoder: Embedder,
    old: int,
    new: int,
    *,
    batch: int = 64,
    settle_batches: int = 4,
    on_progress: Callable[[Progress], None] | None = None,
    backoff_seconds: float = 1.0,
    backoff_max_seconds: float = 30.0,
) -> Progress:
    """Fill generation ``new`` from ``old`` and switch when complete (see the module docstring).

    Two runs of the command for one encoder build the same generation together; the one that
    gets to the switch second finds it made and stops (it must not copy the retired generation
    over the active one). A run whose generation another run abandoned (``--replace``) raises
    ReindexRefused.

    An embedding service that does not answer is waited for, as the indexer waits for it: the
    batch in hand rolls back (the switch's exclusive lock with it), and the build goes on where
    it was once the service answers (a refusal, such as a wrong key, still ends it).
    """
    delay = backoff_seconds
    async with _building(db, new):
        while True:
            try:
                return await _build(db, encoder, old, new, batch, settle_batches, on_progress)
            except EmbeddingUnavailable as exc:
                log.warning("memory reindex: %s; trying again in %.0f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, backoff_max_seconds)


@asynccontextmanager
async def _building(db: Database, new: int) -> AsyncIterator[None]:
    """Hold generation ``new``'s build lock for the block (see BUILD_LOCK_CLASS)."""
    async with db.engine.connect() as connection:
        await connection.execute(HOLD_BUILD, {"id": new})
        await connection.commit()  # the lock is the session's: no transaction stays open
        try:
            yield
        finally:
            # The connection goes back to the pool: it must not keep the lock.
            await connection.execute(RELEASE_BUILD, {"id": new})
            await connection.commit()


async def _build(
    db: Database,
    encoder: Embedder,
    old: int,
    new: int,
    batch: int,
    settle_batches: int,
    on_progress: Callable[[Progress], None] | None,
) -> Progress:
    try:
        await _pass(db, encoder, old, new, batch, on_progress)
        # Passes until little changed meanwhile, then the last one under the exclusive lock.
        for _ in range(5):
            if await _pass(db, encoder, old, new, batch, on_progress) <= settle_batches:
                break
        # The last pass copies under the exclusive lock, where writers wait: what it copies is
        # encoded before, without the lock (a hung encoder must not hold memory writes back). A
        # text written in between rolls it back, to be encoded without the lock too (a few times:
        # under steady writes the last try encodes them under the lock, as few as they are).
        encoded: dict[str, str] = {}
        for attempt in range(_UNLOCKED_ENCODES, -1, -1):
            strict = attempt > 0
            await _encode_stale(db, encoder, old, new, batch, encoded)
            try:
                async with db.transaction() as session:
                    await session.execute(LOCK_EXCLUSIVE)
                    await _still_building(session, old, new)
                    await _pass(db, encoder, old, new, batch, session=session, encoded=encoded, strict=strict)
                    await session.execute(RETIRE, {"old": old})
                    await session.execute(ACTIVATE, {"new": new})
                    done, total = await _counts(session, old, new)
                break
            except _Unencoded as unencoded:
                log.info("memory reindex: %s texts written before the switch; encoding them first", unencoded)
    except _BuildOver as over:
        if over.state != "active":
            why = "another run of the command abandoned it (--replace)" if over.state is None else over.state
            raise ReindexRefused(f"generation {new} is no longer being built: {why}") from None
        async with db.session() as session:
            done = int((await session.execute(CHUNKS, {"id": new})).scalar_one())
        log.info("memory index generation %d was switched to by another run of the command", new)
        progress = Progress(new, done, done, switched=True)
        if on_progress is not None:
            on_progress(progress)
        return progress
    progress = Progress(new, done, total, switched=True)
    if on_progress is not None:
        on_progress(progress)
    log.info("memory index generation %d is active (%d rows); generation %d retired", new, done, old)
    return progress


async def _counts(session: Any, old: int, new: int) -> tuple[int, int]:
    await session.execute(PROGRESS, {"old": old, "new": new})
    row = (
        await session.execute(
            text("SELECT rows_done, rows_total FROM memory_indexes WHERE id = :id"), {"id": new}
        )
    ).one()
    return int(row.rows_done), int(row.rows_total)


async def purge_retired(db: Database, *, older_than_seconds: float, batch: int = 5000) -> int:
    """Delete the rows of generations retired more than ``older_than_seconds`` ago."""
    async with db.session() as session:
        ids = (
            await session.execute(
                text(
                    "SELECT id FROM memory_indexes WHERE state = 'retired' "
                    "AND retired_at < now() - make_interval(secs => :grace)"
                ),
                {"grace": older_than_seconds},
            )
        ).scalars()
        retired = list(ids)
    deleted = 0
    for generation in retired:
        deleted += await _drop_rows(db, int(generation), batch)
    return deleted
