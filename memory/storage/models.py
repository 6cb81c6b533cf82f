"""Storage models: every row that holds user data carries tenant_id and user_id.

The migrations (memory/storage/migrations/) define every table; tables only ever written by
SQL statements (dead_letters: indexer/pg_queue.py; ai_sdk_chats: memory/record/ai_sdk_chats.py;
chat_stops: memory/record/pending_stops.py)
have no model here.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from types import MappingProxyType
from typing import Any

from pgvector.sqlalchemy import Vector
from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    FetchedValue,
    ForeignKey,
    Identity,
    Index,
    Integer,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy import text as sql_text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TSVECTOR, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

EMBEDDING_DIM = 384


class Base(DeclarativeBase):
    pass


def _now() -> Any:
    return func.now()


class Conversation(Base):
    __tablename__ = "conversations"
    # Its database-made times come back with the INSERT (RETURNING), not in a second read.
    __mapper_args__ = MappingProxyType({"eager_defaults": True})

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    title: Mapped[str] = mapped_column(Text, default="")
    memory_mode: Mapped[str] = mapped_column(String(16), default="persistent")
    next_seq: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # Newest turn seq whose memory rows are written (the indexer's watermark).
    indexed_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Turns up to this seq were forgotten (DELETE /v1/memory): never indexed, never recalled.
    memory_forgotten_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # "Use memory in this chat": replies here recall memory (memory_mode says whether it is remembered).
    use_memory: Mapped[bool] = mapped_column(Boolean, default=True, server_default=sql_text("true"))
    active_reply_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    # A stop that found no reply to stop yet, kept for the one being started (memory/record/pending_stops.py).
    stop_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    stop_requested_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The branch new turns go to and prompts read (memory/record/branches.py). Its root branch has
    # the conversation's id; a trigger (migration 0005) fills both in for any INSERT.
    active_branch_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), default=lambda ctx: ctx.get_current_parameters()["id"]
    )
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        Index("ix_conversations_owner_created", "tenant_id", "user_id", "created_at", "id"),
        Index("ix_conversations_deleted", "deleted_at", postgresql_where=text("deleted_at IS NOT NULL")),
    )


class Branch(Base):
    """One line of a conversation's history: its own turns after its parent's up to `fork_seq`.

    Immutable once created. `lineage_*` is the whole history as (branch, max seq) pairs,
    itself first with no limit, computed at creation, so reading a branch never recurses.
    """

    __tablename__ = "branches"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    conversation_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("conversations.id", ondelete="CASCADE")
    )
    # May belong to another conversation (a fork's root branch); same owner always.
    parent_branch_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    fork_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lineage_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)))
    lineage_max_seqs: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())

    __table_args__ = (
        Index("ix_branches_conversation", "conversation_id", "created_at"),
        # Which branches share a given branch's turns (forks), for purging safely.
        Index("ix_branches_lineage", "lineage_ids", postgresql_using="gin"),
    )


class Turn(Base):
    __tablename__ = "turns"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    conversation_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("conversations.id", ondelete="CASCADE")
    )
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    seq: Mapped[int] = mapped_column(Integer)
    # Set by every writer, or by the trigger of migration 0005 to the conversation's active branch.
    branch_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), server_default=FetchedValue())
    role: Mapped[str] = mapped_column(String(16))  # user | assistant | tool
    status: Mapped[str] = mapped_column(String(32))
    content: Mapped[str] = mapped_column(Text, default="")
    # Assistant turns: [{"index", "id", "name", "arguments", "state", ...}] exactly as received.
    tool_calls: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, default=list, server_default="[]")
    # Tool turns: which call this result answers.
    tool_call_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    # All turns of one reply (model → tools → model) share the first assistant turn's id.
    reply_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    model: Mapped[str | None] = mapped_column(Text, nullable=True)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    interrupt_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    rewritten_query: Mapped[str | None] = mapped_column(Text, nullable=True)
    prompt_version: Mapped[str | None] = mapped_column(String(64), nullable=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(256), nullable=True)
    external_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB, nullable=True)
    # A reply's first assistant turn: the part its prompt showed before the user's words.
    prompt_part: Mapped[dict[str, Any] | None] = mapped_column(JSONB, nullable=True)
    # An assistant turn: whether its reply was made with memory (on | off | unavailable).
    memory_use: Mapped[str | None] = mapped_column(String(16), nullable=True)
    last_event_id: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Awaiting approval: when the earliest call with a timeout counts as rejected.
    approval_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Expired by retention: hidden from every read now, purged after the grace period.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (
        UniqueConstraint("conversation_id", "seq", name="uq_turns_conversation_seq"),
        # A branch's history is read per (branch, seq <= limit), newest first.
        Index("ix_turns_branch_seq", "branch_id", "seq"),
        Index(
            "ix_turns_approval_expiry",
            "approval_expires_at",
            postgresql_where=text("status = 'awaiting_approval' AND approval_expires_at IS NOT NULL"),
        ),
        Index("ix_turns_reply", "reply_id"),
        Index("ix_turns_live_created", "created_at", postgresql_where=text("deleted_at IS NULL")),
        Index("ix_turns_deleted", "deleted_at", postgresql_where=text("deleted_at IS NOT NULL")),
        Index("ix_turns_streaming", "heartbeat_at", postgresql_where=text("status = 'streaming'")),
        Index(
            "uq_turns_idempotency",
            "conversation_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        Index(
            "uq_turns_external_id",
            "conversation_id",
            "external_id",
            unique=True,
            postgresql_where=text("external_id IS NOT NULL"),
        ),
    )


class TurnEventChunk(Base):
    """The SSE events of one reply, persisted at each checkpoint (for resume on any process)."""

    __tablename__ = "turn_events"

    reply_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    first_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    last_id: Mapped[int] = mapped_column(Integer)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    # [[id, event, data], ...]
    events: Mapped[list[Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class ToolInvocation(Base):
    """One logical tool call; the idempotency key makes a side effect happen at most once."""

    __tablename__ = "tool_invocations"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    turn_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    call_index: Mapped[int] = mapped_column(Integer)
    call_id: Mapped[str] = mapped_column(String(128))
    tool_name: Mapped[str] = mapped_column(Text)
    arguments: Mapped[Any] = mapped_column(JSONB)
    idempotency_key: Mapped[str] = mapped_column(String(64), unique=True)
    state: Mapped[str] = mapped_column(String(32))
    result: Mapped[Any | None] = mapped_column(JSONB, nullable=True)
    side_effect_may_have_happened: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())

    __table_args__ = (Index("ix_tool_invocations_turn", "turn_id"),)


# An outbox row's turn seq, read from its payload (NULL when the payload has none that fits an
# int: a poison row must still insert). Indexed with the conversation: the indexer's watermark reads
# a conversation's rows by seq (indexer/pipeline.py), and statements must spell it exactly so.
OUTBOX_SEQ = "(CASE WHEN {t}payload->>'seq' ~ '^[0-9]{{1,9}}$' THEN CAST({t}payload->>'seq' AS integer) END)"


class OutboxRow(Base):
    """A finished turn waiting to reach the memory index (same transaction as the turn)."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    conversation_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    turn_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    # Kafka transport: set once the broker acknowledged.
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Set once the indexer committed the turn's memory (either transport).
    consumed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    dead_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # A consumer's lease on the row (see indexer/outbox_claims.py): committed, never a held lock.
    claimed_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    claim_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    # 0: a live turn; 1: imported history, indexed after every live turn waiting.
    priority: Mapped[int] = mapped_column(SmallInteger, default=0, server_default="0")

    __table_args__ = (
        Index("ix_outbox_unpublished", "id", postgresql_where=text("published_at IS NULL")),
        Index("ix_outbox_unconsumed", "id", postgresql_where=text("consumed_at IS NULL AND dead_at IS NULL")),
        Index("ix_outbox_conversation_seq", "conversation_id", text(OUTBOX_SEQ.format(t=""))),
        Index("ix_outbox_created", "created_at"),
        Index(
            "ix_outbox_pending_fair",
            "tenant_id",
            "user_id",
            "priority",
            "id",
            postgresql_where=text("consumed_at IS NULL AND dead_at IS NULL"),
        ),
    )


class MemoryItemSource:
    """Where a memory item came from."""

    TURN = "turn"  # the indexer, from a finished turn
    STATED = "stated"  # the user, directly (POST /v1/memory/items): no turn behind it


class MemoryItemKind:
    """What a memory row is."""

    CHUNK = "chunk"  # a memory: a chunk of a turn, or a stated fact
    SENTENCE = "sentence"  # a search key of a chunk, never a memory (memory/recall/sentence_keys.py)
    FACT = "fact"  # a fact the turn states, in the model's words: a search key (memory/recall/fact_keys.py)


class MemoryItem(Base):
    """One embedded chunk of a finished turn, or a fact the user stated: the long-term memory.

    A row of kind ``sentence`` is a search key of a chunk (same turn and chunk_index), not a memory.
    """

    __tablename__ = "memory_items"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    # None for a stated fact made outside any conversation.
    conversation_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), nullable=True)
    # A stated fact has no turn: this is then its own random id (keeps one memory per "turn").
    turn_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    chunk_index: Mapped[int] = mapped_column(Integer)
    turn_seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(Text, nullable=True)
    text: Mapped[str] = mapped_column(Text)
    # Words, plus CJK character bigrams, so 'simple' full-text search works for Chinese.
    search_terms: Mapped[Any] = mapped_column(TSVECTOR)
    # None only on a forgotten item's tombstone.
    embedding: Mapped[Any] = mapped_column(Vector(EMBEDDING_DIM), nullable=True)
    turn_created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    external_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB, nullable=True)
    # False while the turn is off its conversation's active branch: never recalled then.
    on_active_branch: Mapped[bool] = mapped_column(Boolean, default=True, server_default="true")
    indexed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    # Expired with its turn: invisible to search now, purged after the grace period.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    source: Mapped[str] = mapped_column(String(16), default=MemoryItemSource.TURN, server_default="turn")
    # The user corrected the text: the indexer never overwrites it (memory/recall/items.py).
    edited_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The user forgot it: a tombstone (deleted_at set, text emptied) the indexer never revives.
    forgotten_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The generation of the index this row belongs to: which encoder made its vector
    # (memory_indexes; a query vector is only compared with rows of its own generation).
    index_id: Mapped[int] = mapped_column(SmallInteger)
    kind: Mapped[str] = mapped_column(String(16), default=MemoryItemKind.CHUNK, server_default="chunk")
    # A sentence key's position in its chunk (0 for a chunk).
    key_index: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    __table_args__ = (
        UniqueConstraint(
            "index_id", "turn_id", "kind", "chunk_index", "key_index", name="uq_memory_index_turn_key"
        ),
        CheckConstraint("kind IN ('chunk', 'sentence', 'fact')", name="ck_memory_items_kind"),
        Index(
            "ix_memory_owner_listed",
            "tenant_id",
            "user_id",
            "turn_created_at",
            "id",
            postgresql_where=sql_text("deleted_at IS NULL"),
        ),
        Index("ix_memory_owner", "tenant_id", "user_id", "index_id"),
        Index("ix_memory_conversation", "conversation_id"),
        # A turn's rows by the turn alone (without skip scan, before PostgreSQL 18: migration 0023).
        Index("ix_memory_turn", "turn_id"),
        # sqlalchemy.text, not the `text` column above.
        Index("ix_memory_deleted", "deleted_at", postgresql_where=sql_text("deleted_at IS NOT NULL")),
        # No GIN on search_terms and no HNSW on embedding: a search matches terms and takes
        # distances on its owner's rows, exactly (migrations 0020 and 0022).
    )


class MemoryIndex(Base):
    """One generation of the memory index: what made its vectors, and whether it is searched."""

    __tablename__ = "memory_indexes"

    id: Mapped[int] = mapped_column(SmallInteger, Identity(), primary_key=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB)
    spec_key: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # building | active | retired
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    activated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    rows_total: Mapped[int] = mapped_column(BigInteger, server_default="0")
    rows_done: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        CheckConstraint("state IN ('building', 'active', 'retired')", name="ck_memory_indexes_state"),
        Index(
            "uq_memory_indexes_state",
            "state",
            unique=True,
            postgresql_where=sql_text("state IN ('active', 'building')"),
        ),
    )


class ApiKey(Base):
    """A long-lived key that authenticates as one tenant and user (memory/accounts/keys.py); hash only."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=uuid.uuid4)
    tenant_id: Mapped[str] = mapped_column(String(128))
    user_id: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(Text, default="")
    # The key's first characters, shown in lists so a person can tell keys apart.
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    __table_args__ = (Index("ix_api_keys_owner", "tenant_id", "user_id", "created_at"),)
