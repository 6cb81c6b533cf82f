"""The indexing pipeline: finished-turn payloads in, searchable memory rows out.

filter (low information, memory off, deleted, forgotten, empty) → redact → chunk (and the
sentence keys of a long chunk a person wrote, ``memory.recall.sentence_keys``; with
``FACT_KEYS=model`` the facts a user's message states, ``memory.recall.fact_keys``) → embed
(one call per batch, off the event loop) → upsert keyed by (turn_id, kind, chunk_index,
key_index), mark the batch's outbox rows consumed and advance the conversations' watermarks
over consumed turns only (see ADVANCE_WATERMARKS), all in one transaction. A turn's
keyword terms also carry the words of the message before it (``memory_search_terms``),
read for the whole batch in one statement.

A redelivered payload changes nothing: its rows conflict on (turn_id, chunk_index) and
the update only fires when the stored text differs. A turn whose memory the user corrected or
forgot gets no sentence or fact keys (its old words must not be found through them). The
conversations of a batch are
locked (``FOR NO KEY UPDATE``, in id order) while their rows are written, so a
conversation deleted or switched to memory mode `none` during the batch never gets rows
written after the switch, and each row's ``on_active_branch`` is read under the same lock
(a branch switch takes it too, see memory/record/branches.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import JSONB

from indexer.chunking import chunk_text
from indexer.metrics import TimedEmbedder, observe_fact_answer, observe_reused_vectors
from memory.config import Settings
from memory.recall.embeddings import Embedder
from memory.recall.fact_keys import FactAnswer, FactAsker, wants_facts
from memory.recall.index import Generation, generation_of, write_guard
from memory.recall.keywords import memory_search_terms, memory_text, photo_caption, query_terms
from memory.recall.redaction import redact
from memory.recall.remembering import FORGOTTEN, is_low_information, unremembered_reason
from memory.recall.sentence_keys import sentence_keys
from memory.recall.vector_cache import VectorCache, turn_key
from memory.record.branches import turns_off_active_branch
from memory.record.outbox import PAYLOAD_VERSION, RECORDED_ROLES, RECORDED_STATUSES
from memory.storage.db import Database
from memory.storage.models import EMBEDDING_DIM, OUTBOX_SEQ

# Texts per encode call of the indexer: small enough that a query queued behind one waits
# tens of milliseconds, large enough to keep the encoder's batching (see _vectors_of).
EMBED_SLICE = 16


READ_CONVERSATIONS = text(
    "SELECT id, memory_mode, deleted_at, memory_forgotten_seq FROM conversations"
    " WHERE id = ANY(CAST(:ids AS uuid[]))"
)

LOCK_CONVERSATIONS = text(
    """
    SELECT id, memory_mode, deleted_at, memory_forgotten_seq FROM conversations
    WHERE id = ANY(CAST(:ids AS uuid[]))
    ORDER BY id
    FOR NO KEY UPDATE
    """
)

# The message each turn follows on its own branch (tool turns and empty texts skipped): a reply's
# keywords get its question's words (see memory_search_terms). One statement for the whole batch;
# per lineage entry of the turn's branch the newest candidate, then the newest of those.
PREVIOUS_MESSAGES = text(
    """
    SELECT r.turn_id, p.name, p.content
    FROM unnest(CAST(:turn_ids AS uuid[]), CAST(:seqs AS int[])) AS r(turn_id, seq)
    JOIN turns own ON own.id = r.turn_id
    JOIN branches b ON b.id = own.branch_id
    CROSS JOIN LATERAL (
        SELECT c.name, c.content
        FROM unnest(b.lineage_ids, b.lineage_max_seqs) AS l(branch_id, max_seq)
        CROSS JOIN LATERAL (
            SELECT t.seq, t.name, t.content FROM turns t
            WHERE t.branch_id = l.branch_id AND t.seq <= LEAST(l.max_seq, r.seq - 1)
              AND t.role IN ('user', 'assistant') AND t.content <> ''
            ORDER BY t.seq DESC
            LIMIT 1
        ) c
        ORDER BY c.seq DESC
        LIMIT 1
    ) p
    """
)

UPSERT_ITEM = text(
    """
    INSERT INTO memory_items (index_id, tenant_id, user_id, conversation_id, turn_id, kind, chunk_index,
                              key_index, turn_seq, role, name, text, search_terms, embedding, turn_created_at,
                              external_id, metadata, on_active_branch)
    VALUES (:index_id, :tenant_id, :user_id, CAST(:conversation_id AS uuid), CAST(:turn_id AS uuid),
            :kind, :chunk_index, :key_index, :turn_seq, :role, :name, :text, to_tsvector('simple', :terms),
            CAST(:embedding AS vector), :turn_created_at, :external_id, :metadata, :on_active_branch)
    ON CONFLICT (index_id, turn_id, kind, chunk_index, key_index) DO UPDATE SET
        text = EXCLUDED.text, name = EXCLUDED.name, search_terms = EXCLUDED.search_terms,
        embedding = EXCLUDED.embedding, turn_seq = EXCLUDED.turn_seq,
        turn_created_at = EXCLUDED.turn_created_at,
        external_id = EXCLUDED.external_id, metadata = EXCLUDED.metadata,
        on_active_branch = EXCLUDED.on_active_branch, indexed_at = now()
    WHERE (memory_items.text, memory_items.name, memory_items.metadata, memory_items.on_active_branch)
          IS DISTINCT FROM (EXCLUDED.text, EXCLUDED.name, EXCLUDED.metadata, EXCLUDED.on_active_branch)
      -- A user's correction or forgetting of this item outlives reprocessing (memory/recall/items.py).
      AND memory_items.edited_at IS NULL AND memory_items.forgotten_at IS NULL
    """
).bindparams(bindparam("metadata", type_=JSONB(none_as_null=True)))

# A turn re-chunked into fewer pieces (or now filtered out) must not keep its old tail (nor its keys).
DELETE_STALE_CHUNKS = text(
    """
    DELETE FROM memory_items m
    USING unnest(CAST(:turn_ids AS uuid[]), CAST(:counts AS int[])) AS t(turn_id, n)
    WHERE m.index_id = :index_id AND m.turn_id = t.turn_id AND m.chunk_index >= t.n
      AND m.edited_at IS NULL AND m.forgotten_at IS NULL
    """
)

# A chunk's sentence keys beyond the ones written now (fewer keys, or none: corrected, forgotten).
DELETE_STALE_KEYS = text(
    """
    DELETE FROM memory_items m
    USING unnest(CAST(:turn_ids AS uuid[]), CAST(:chunks AS int[]), CAST(:counts AS int[]))
          AS c(turn_id, chunk_index, n)
    WHERE m.index_id = :index_id AND m.kind = 'sentence' AND m.turn_id = c.turn_id
      AND m.chunk_index = c.chunk_index AND m.key_index >= c.n
    """
)

# Of these turns, the ones already in the index (any chunk, also a corrected or forgotten one).
INDEXED_TURNS = text(
    """
    SELECT DISTINCT turn_id FROM memory_items
    WHERE index_id = :index_id AND turn_id = ANY(CAST(:turn_ids AS uuid[])) AND kind = 'chunk'
    """
)

# Of these turns, the ones with a chunk the user corrected or forgot: no keys for them.
CHANGED_BY_USER = text(
    """
    SELECT DISTINCT turn_id FROM memory_items
    WHERE index_id = :index_id AND turn_id = ANY(CAST(:turn_ids AS uuid[])) AND kind = 'chunk'
      AND (edited_at IS NOT NULL OR forgotten_at IS NOT NULL)
    """
)

# The assistant turns of a batch whose reply is no longer remembered since their payload was
# written (shown a memory the user forgot or corrected, memory/recall/forgetting.py): read under
# the conversations' locks, which the forgetting takes too, so a queued reply is never indexed later.
FORGOTTEN_SINCE = text(
    "SELECT id FROM turns WHERE id = ANY(CAST(:turn_ids AS uuid[])) AND role = 'assistant'"
    " AND memory_use = :forgotten"
)

_SEQ = OUTBOX_SEQ.format(t="o.")

# The outbox rows of the batch's turns are consumed in the transaction that writes their memory
# (either transport: the watermark below reads them), their leases cleared in the same write (a
# consumed row is never claimed again; the Postgres queue's commit then has nothing left to
# write). Taken after the conversations' locks and before the memory rows, in the lock order.
MARK_CONSUMED = text(
    f"""
    UPDATE outbox o SET consumed_at = now(), claimed_until = NULL, claim_token = NULL
    FROM unnest(CAST(:conversation_ids AS uuid[]), CAST(:seqs AS int[]), CAST(:turn_ids AS uuid[]))
         AS t(conversation_id, seq, turn_id)
    WHERE o.conversation_id = t.conversation_id AND {_SEQ} = t.seq AND o.turn_id = t.turn_id
      AND o.consumed_at IS NULL AND o.dead_at IS NULL
    """
)

# Dead-lettered turns are passed over: their outbox rows dead, so they hold back no watermark.
MARK_DEAD = text(
    """
    UPDATE outbox o SET dead_at = now(), last_error = t.error
    FROM unnest(CAST(:conversation_ids AS uuid[]), CAST(:turn_ids AS uuid[]), CAST(:errors AS text[]))
         AS t(conversation_id, turn_id, error)
    WHERE o.conversation_id = t.conversation_id AND o.turn_id = t.turn_id
      AND o.consumed_at IS NULL AND o.dead_at IS NULL
    """
)

# Every turn up to the watermark is indexed (or passed over): it moves up to the highest seq
# consumed or dead (or of the batch: turns indexed without an outbox row) below the conversation's
# first outbox row still pending above it. A live turn consumed before its conversation's import
# (Kafka reads live turns first) waits for it. Rows at or below the watermark never hold it back:
# rows consumed before consumption was marked on the Kafka path all stay pending.
ADVANCE_WATERMARKS = text(
    f"""
    WITH batch AS (
        SELECT t.id, t.seq FROM unnest(CAST(:ids AS uuid[]), CAST(:seqs AS int[])) AS t(id, seq)
    ),
    marks AS MATERIALIZED (  -- once per conversation, not per turn of the batch
        SELECT c.id, c.indexed_seq,
               (SELECT min({_SEQ}) FROM outbox o
                WHERE o.conversation_id = c.id AND {_SEQ} > c.indexed_seq
                  AND o.consumed_at IS NULL AND o.dead_at IS NULL) AS pending
        FROM conversations c WHERE c.id IN (SELECT id FROM batch)
    ),
    reached AS (
        SELECT m.id, max(r.seq) AS seq
        FROM marks m
        CROSS JOIN LATERAL (
            SELECT b.seq FROM batch b WHERE b.id = m.id
            UNION ALL
            SELECT max({_SEQ}) FROM outbox o
            WHERE o.conversation_id = m.id AND {_SEQ} > m.indexed_seq
              AND {_SEQ} < coalesce(m.pending, 2147483647)
        ) r
        WHERE m.pending IS NULL OR r.seq < m.pending
        GROUP BY m.id
    )
    UPDATE conversations c SET indexed_seq = r.seq
    FROM reached r WHERE c.id = r.id AND r.seq > c.indexed_seq
    """
)


class PoisonPayload(ValueError):
    """A payload that can never be indexed (wrong version, missing or mistyped fields)."""


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """A validated outbox payload."""

    tenant_id: str
    user_id: str
    conversation_id: uuid.UUID
    turn_id: uuid.UUID
    seq: int
    role: str
    status: str
    text: str
    name: str | None
    created_at: datetime
    external_id: str | None
    metadata: dict[str, Any] | None
    memory_use: str | None = None  # an assistant turn's: was its reply made with memory


@dataclass(slots=True)
class IndexResult:
    """What one `index` call did."""

    indexed_turns: int = 0
    chunks: int = 0
    keys: int = 0  # sentence keys written beside the chunks
    facts: int = 0  # fact keys written beside the chunks
    fact_answers: list[FactAnswer] = field(default_factory=list)  # one per user turn the model was asked
    skipped: Counter[str] = field(default_factory=Counter)


def _str(payload: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    value = payload.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not optional and not value and key != "text"):
        raise PoisonPayload(f"field {key!r} must be a{' non-empty' if not optional else ''} string")
    return value


def parse_payload(payload: object) -> TurnRecord:
    """Validate an outbox payload; raises PoisonPayload with the reason."""
    if not isinstance(payload, dict):
        raise PoisonPayload("payload is not an object")
    if payload.get("v") != PAYLOAD_VERSION:
        raise PoisonPayload(f"unsupported payload version {payload.get('v')!r}")
    try:
        conversation_id = uuid.UUID(str(payload.get("conversation_id")))
        turn_id = uuid.UUID(str(payload.get("turn_id")))
    except ValueError as exc:
        raise PoisonPayload("conversation_id and turn_id must be UUIDs") from exc
    seq = payload.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise PoisonPayload("field 'seq' must be a non-negative integer")
    role, status = payload.get("role"), payload.get("status")
    if role not in RECORDED_ROLES:
        raise PoisonPayload(f"role {role!r} is not indexed")
    if status not in RECORDED_STATUSES:
        raise PoisonPayload(f"status {status!r} is not a finished status")
    try:
        created_at = datetime.fromisoformat(str(_str(payload, "created_at")))
    except ValueError as exc:
        raise PoisonPayload("field 'created_at' must be an ISO timestamp") from exc
    metadata = payload.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise PoisonPayload("field 'metadata' must be an object")
    return TurnRecord(
        tenant_id=str(_str(payload, "tenant_id")),
        user_id=str(_str(payload, "user_id")),
        conversation_id=conversation_id,
        turn_id=turn_id,
        seq=seq,
        role=str(role),
        status=str(status),
        text=str(_str(payload, "text")),
        name=_str(payload, "name", optional=True),
        created_at=created_at,
        external_id=_str(payload, "external_id", optional=True),
        metadata=metadata,
        memory_use=_str(payload, "memory_use", optional=True),
    )


def _vector_literal(vector: Sequence[float]) -> str:
    return "[" + ",".join(format(float(x), ".8g") for x in vector) + "]"


@dataclass(slots=True)
class _Chunk:
    """A row to write: a chunk of a turn, or (``key_index`` not None) one of its keys (sentence or fact)."""

    record: TurnRecord
    index: int
    text: str
    memory_text: str
    previous: str | None
    key_index: int | None = None
    kind: str = "chunk"


def _best_chunk(fact: str, pieces: list[_Chunk]) -> int:
    """The chunk of a turn that shares the most words with the fact (the first on a tie)."""
    terms = set(query_terms(fact))
    best = max(pieces, key=lambda c: (len(terms.intersection(query_terms(c.text))), -c.index))
    return best.index


class IndexPipeline:
    """Turns finished-turn payloads into memory rows, idempotently."""

    def __init__(
        self,
        db: Database,
        embedder: Embedder,
        settings: Settings,
        *,
        facts: FactAsker | None = None,
        vectors: VectorCache | None = None,
    ) -> None:
        if embedder.dim != EMBEDDING_DIM:
            raise ValueError(f"embedder makes {embedder.dim}-d vectors; memory_items holds {EMBEDDING_DIM}-d")
        self._db = db
        self._embedder = embedder
        self._settings = settings
        self._facts = facts
        # The recall's cache of turn vectors, when this pipeline runs in the API's process.
        self._vectors = vectors

    @staticmethod
    def validate(payload: object) -> str | None:
        """None when the payload can be indexed, else why it is poison."""
        try:
            parse_payload(payload)
        except PoisonPayload as exc:
            return str(exc)
        return None

    def _skip_reason(
        self, record: TurnRecord, conversation: Any, forgotten: Collection[uuid.UUID] = ()
    ) -> str | None:
        if conversation is None or conversation.deleted_at is not None:
            return "deleted"
        if conversation.memory_mode == "none":
            return "memory_off"
        if record.seq <= conversation.memory_forgotten_seq:
            return "forgotten"
        if not record.text.strip():
            return "empty"
        memory_use = FORGOTTEN if record.turn_id in forgotten else record.memory_use
        if unremembered := unremembered_reason(record.role, memory_use):
            return unremembered
        if is_low_information(record.text, extra_phrases=tuple(self._settings.low_information_extra)):
            return "low_information"
        return None

    def _redact(self, text: str) -> str:
        return redact(text) if self._settings.redact_pii else text

    async def _ask_facts(self, index_id: int, records: list[TurnRecord]) -> dict[uuid.UUID, FactAnswer]:
        """The model's facts of each user turn worth asking about, one request at a time.

        A turn already in the index is not asked again (a redelivery keeps the facts it got, and a
        turn the user corrected or forgot gets none). After a request that timed out or failed,
        the rest of the batch is not asked: a model that is away costs a batch one time box, not
        one per turn; nor is it once the batch spent FACT_KEYS_BATCH_SECONDS on requests (those
        turns are indexed without facts).
        """
        answers: dict[uuid.UUID, FactAnswer] = {}
        asked = [r for r in records if wants_facts(r.text, role=r.role)]
        if self._facts is None or not asked:
            return answers
        async with self._db.session() as session:
            indexed = set(
                (
                    await session.execute(
                        INDEXED_TURNS, {"index_id": index_id, "turn_ids": [str(r.turn_id) for r in asked]}
                    )
                ).scalars()
            )
        budget = self._settings.fact_keys_batch_seconds
        spent = 0.0
        for record in asked:
            if record.turn_id in indexed:
                continue
            if spent >= budget:
                break
            answer = await self._facts.ask(self._redact(record.text))
            observe_fact_answer(answer)
            answers[record.turn_id] = answer
            spent += answer.seconds
            if answer.outcome in ("timeout", "error"):
                break
        return answers

    def _chunks(
        self,
        records: list[TurnRecord],
        previous: dict[uuid.UUID, Any],
        facts: dict[uuid.UUID, FactAnswer] | None = None,
    ) -> list[_Chunk]:
        # Runs in a worker thread: regexes and string work over a whole batch.
        out: list[_Chunk] = []
        for record in records:
            start = len(out)
            body = self._redact(record.text)
            before = previous.get(record.turn_id)
            before_text = None
            if before is not None:
                said = f"{before.name}: {before.content}" if before.name else before.content
                before_text = self._redact(said)
            pieces = chunk_text(
                body, max_chars=self._settings.chunk_chars, overlap=self._settings.chunk_overlap_chars
            )
            extra = photo_caption(record.metadata)
            for index, piece in enumerate(p for p in pieces if p.strip()):
                embedded = memory_text(piece, name=record.name, created_at=record.created_at, extra=extra)
                out.append(_Chunk(record, index, piece, embedded, before_text))
                keys = sentence_keys(piece, role=record.role, name=record.name)
                for key_index, sentence in enumerate(keys):
                    key_text = memory_text(sentence, name=record.name, created_at=record.created_at)
                    out.append(_Chunk(record, index, sentence, key_text, None, key_index, "sentence"))
            answer = (facts or {}).get(record.turn_id)
            own = [c for c in out[start:] if c.kind == "chunk"]
            if answer is not None and own:
                for key_index, fact in enumerate(answer.facts):
                    fact_text = memory_text(fact, name=record.name, created_at=record.created_at)
                    out.append(
                        _Chunk(record, _best_chunk(fact, own), fact, fact_text, None, key_index, "fact")
                    )
        return out

    @staticmethod
    def _rows(chunks: list[_Chunk], vectors: Sequence[Sequence[float]]) -> list[dict[str, Any]]:
        return [
            {
                "tenant_id": c.record.tenant_id,
                "user_id": c.record.user_id,
                "conversation_id": str(c.record.conversation_id),
                "turn_id": str(c.record.turn_id),
                "kind": c.kind,
                "chunk_index": c.index,
                "key_index": c.key_index or 0,
                "turn_seq": c.record.seq,
                "role": c.record.role,
                "name": c.record.name,
                "text": c.text,
                # Keys have no keyword terms: the keyword list stays on chunks.
                "terms": (
                    "" if c.key_index is not None else memory_search_terms(c.memory_text, previous=c.previous)
                ),
                "embedding": _vector_literal(vector),
                "turn_created_at": c.record.created_at,
                "external_id": c.record.external_id,
                "metadata": c.record.metadata,
            }
            for c, vector in zip(chunks, vectors, strict=True)
        ]

    async def _vectors_of(self, generation: Generation, chunks: list[_Chunk]) -> list[list[float]]:
        """The chunks' vectors: those the shared cache keeps for this generation, the rest encoded.

        Only a chunk's text is looked up and kept: recall embeds an unindexed turn as exactly
        that text (memory.recall.search), never a turn's sentence or fact keys. Each slice's
        chunk vectors are kept as soon as they are encoded, for a recall that runs meanwhile.
        """
        texts = [c.memory_text for c in chunks]
        shared = [i for i, c in enumerate(chunks) if c.kind == "chunk"] if self._vectors is not None else []
        keys = {i: turn_key(generation.id, texts[i]) for i in shared}
        vectors: list[list[float] | None] = [None] * len(chunks)
        if self._vectors is not None and keys:
            for i, kept in zip(keys, self._vectors.take(list(keys.values())), strict=True):
                vectors[i] = kept
        missing = [i for i, vector in enumerate(vectors) if vector is None]
        observe_reused_vectors(len(chunks) - len(missing))
        # Timed here, around the generation's own encoder: a wrapper around the MemoryIndex
        # would hide the generation from generation_of (and record the wrapper as the encoder).
        embedder = TimedEmbedder(generation.embedder)
        # In slices: where the indexer shares its encoder with replies' queries (an Embedder
        # without a twin; the sentence-transformers one has its own copy, chat_api/cli/serve.py), a
        # query joins the next slice instead of waiting behind a whole batch of history.
        encoded: dict[int, list[float]] = {}
        for start in range(0, len(missing), EMBED_SLICE):
            part = missing[start : start + EMBED_SLICE]
            encoded.update(zip(part, await embedder.embed([texts[i] for i in part]), strict=True))
            if self._vectors is not None:
                fresh = [i for i in part if i in keys]
                self._vectors.keep([keys[i] for i in fresh], [encoded[i] for i in fresh])
        return [encoded[i] if vector is None else vector for i, vector in enumerate(vectors)]

    async def pass_over(self, dead: Sequence[tuple[dict[str, Any], str]]) -> None:
        """Dead-lettered turns (payload, error): outbox rows dead, their watermarks moved past them.

        Called once the transport has kept the dead letters and before it commits the batch: if
        this fails, the batch is delivered again and its dead letters come here again, so a row
        never stays pending (holding its conversation's watermark) once its batch is committed.
        Rows are found by conversation and turn, on either transport (the Postgres queue marks its
        own by id at commit as well). A payload naming no conversation and turn has no row to mark.
        """
        named: list[tuple[str, str, str]] = []
        for payload, error in dead:
            try:
                conversation_id = uuid.UUID(str(payload.get("conversation_id")))
                turn_id = uuid.UUID(str(payload.get("turn_id")))
            except ValueError:
                continue
            named.append((str(conversation_id), str(turn_id), error))
        if not named:
            return
        conversation_ids = sorted({c for c, _, _ in named})
        async with self._db.transaction(lock_timeout_ms=self._settings.background_lock_timeout_ms) as session:
            locked = await session.execute(LOCK_CONVERSATIONS, {"ids": conversation_ids})
            alive = [str(row.id) for row in locked if row.deleted_at is None]
            await session.execute(
                MARK_DEAD,
                {
                    "conversation_ids": [c for c, _, _ in named],
                    "turn_ids": [t for _, t, _ in named],
                    "errors": [e for _, _, e in named],
                },
            )
            if alive:
                await session.execute(ADVANCE_WATERMARKS, {"ids": alive, "seqs": [0] * len(alive)})

    async def index(self, payloads: Sequence[dict[str, Any]]) -> IndexResult:
        """Index a batch in one transaction; raises PoisonPayload if any payload is invalid."""
        result = IndexResult()
        latest: dict[uuid.UUID, TurnRecord] = {}
        for payload in payloads:
            record = parse_payload(payload)
            latest[record.turn_id] = record  # a redelivery inside one batch counts once
        if not latest:
            return result
        records = list(latest.values())
        conversation_ids = sorted({str(r.conversation_id) for r in records})

        async with self._db.transaction(lock_timeout_ms=self._settings.background_lock_timeout_ms) as session:
            seen = {
                row.id: row for row in await session.execute(READ_CONVERSATIONS, {"ids": conversation_ids})
            }
            wanted = [r for r in records if self._skip_reason(r, seen.get(r.conversation_id)) is None]
            previous: dict[uuid.UUID, Any] = {}
            if wanted:
                rows_before = await session.execute(
                    PREVIOUS_MESSAGES,
                    {
                        "turn_ids": [str(r.turn_id) for r in wanted],
                        "seqs": [r.seq for r in wanted],
                    },
                )
                previous = {row.turn_id: row for row in rows_before}
        # The vectors and the rows they go into belong to one generation (memory/recall/index.py).
        generation = await generation_of(self._embedder, self._db)
        # Outside any transaction: a slow model holds no lock and no connection.
        facts = await self._ask_facts(generation.id, wanted)
        result.fact_answers = list(facts.values())
        chunks = await asyncio.to_thread(self._chunks, wanted, previous, facts)
        vectors = await self._vectors_of(generation, chunks)
        rows = await asyncio.to_thread(self._rows, chunks, vectors)
        for row in rows:
            row["index_id"] = generation.id

        async with self._db.transaction(lock_timeout_ms=self._settings.background_lock_timeout_ms) as session:
            # Raises IndexChanged if a reindex switched generations meanwhile: the batch is retried.
            await write_guard(session, self._embedder, generation)
            locked = {
                row.id: row for row in await session.execute(LOCK_CONVERSATIONS, {"ids": conversation_ids})
            }
            replies = [str(r.turn_id) for r in records if r.role == "assistant"]
            forgotten: set[uuid.UUID] = set()
            if replies:
                forgotten = set(
                    (
                        await session.execute(FORGOTTEN_SINCE, {"turn_ids": replies, "forgotten": FORGOTTEN})
                    ).scalars()
                )
            await session.execute(
                MARK_CONSUMED,
                {
                    "conversation_ids": [str(r.conversation_id) for r in records],
                    "seqs": [r.seq for r in records],
                    "turn_ids": [str(r.turn_id) for r in records],
                },
            )
            reached: list[TurnRecord] = []  # turns of conversations not deleted
            counts: dict[uuid.UUID, int] = {}
            for record in records:
                conversation = locked.get(record.conversation_id)
                reason = self._skip_reason(record, conversation, forgotten)
                if conversation is not None and conversation.deleted_at is None:
                    reached.append(record)
                    counts[record.turn_id] = 0
                if reason is not None:
                    result.skipped[reason] += 1
            for chunk in chunks:
                if (
                    chunk.key_index is None
                    and chunk.record.turn_id in counts
                    and self._skip_reason(chunk.record, locked.get(chunk.record.conversation_id), forgotten)
                    is None
                ):
                    counts[chunk.record.turn_id] += 1
            changed = set()
            if counts:
                changed = set(
                    (
                        await session.execute(
                            CHANGED_BY_USER,
                            {"index_id": generation.id, "turn_ids": [str(t) for t in counts]},
                        )
                    ).scalars()
                )
            keep = [
                row
                for row, c in zip(rows, chunks, strict=True)
                if counts.get(c.record.turn_id, 0) > 0
                and (c.key_index is None or c.record.turn_id not in changed)
            ]
            # Every chunk written now, with how many keys it keeps (older keys beyond them go).
            keys_of: dict[tuple[str, int], int] = {}
            for row in keep:
                key = (row["turn_id"], row["chunk_index"])
                keys_of[key] = keys_of.get(key, 0) + (1 if row["kind"] == "sentence" else 0)
            # Read under the conversations' locks: a branch switch committed while this batch was
            # embedding is seen here, and one not yet committed waits until these rows are written.
            off_branch = await turns_off_active_branch(session, {uuid.UUID(row["turn_id"]) for row in keep})
            for row in keep:
                row["on_active_branch"] = uuid.UUID(row["turn_id"]) not in off_branch
            if keep:
                await session.execute(UPSERT_ITEM, keep)
            if keys_of:
                await session.execute(
                    DELETE_STALE_KEYS,
                    {
                        "turn_ids": [turn for turn, _ in keys_of],
                        "chunks": [chunk for _, chunk in keys_of],
                        "counts": list(keys_of.values()),
                        "index_id": generation.id,
                    },
                )
            if counts:
                await session.execute(
                    DELETE_STALE_CHUNKS,
                    {
                        "turn_ids": [str(t) for t in counts],
                        "counts": list(counts.values()),
                        "index_id": generation.id,
                    },
                )
            if reached:
                await session.execute(
                    ADVANCE_WATERMARKS,
                    {"ids": [str(r.conversation_id) for r in reached], "seqs": [r.seq for r in reached]},
                )
        result.indexed_turns = sum(1 for n in counts.values() if n > 0)
        result.chunks = sum(1 for row in keep if row["kind"] == "chunk")
        result.facts = sum(1 for row in keep if row["kind"] == "fact")
        result.keys = len(keep) - result.chunks - result.facts
        return result
