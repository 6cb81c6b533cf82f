"""Branches and forks: which turns make up a conversation's history, and switching between them.

A branch is its own turns plus its parent's turns with ``seq <= fork_seq``, recursively.
Branches never change once created, so each stores that whole chain flattened as
(branch, max seq) pairs (``lineage_ids``/``lineage_max_seqs``, itself first, unlimited):
reading a history is one join on that short list, never a recursive query. ``seq`` grows
along every lineage (a child's own turns come after its fork point, a fork's ``next_seq``
starts after it), so ordering by ``seq`` orders any history.

- Regenerating the last reply forks a sibling branch just after its user turn; editing a
  user message forks one just before it. Both become the active branch.
- Forking a conversation makes a new conversation whose root branch's parent is the
  original's branch at the fork turn: nothing is copied, the original is untouched.
- Memory follows each turn's own conversation: ``memory_items.on_active_branch`` is true
  exactly for turns on their conversation's active branch. It is recomputed here when the
  active branch changes and set by the indexer when it writes, both under the
  conversation's row lock, so the two never interleave (see indexer/pipeline.py).

Every function takes a session and never commits; ownership is checked by the callers
through ``memory.record.conversations.get_conversation`` and ``memory.record.turns.get_turn``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

from sqlalchemy import Row, TextClause, bindparam, select, text
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import (
    ConversationBusy,
    InvalidInput,
    NotFound,
    NotLastReply,
    NotOnActiveBranch,
    TurnNotFinished,
)
from memory.events import TurnStatus
from memory.record.conversations import Owner
from memory.storage.models import Branch, Conversation, Turn

# A lineage entry with no upper bound: the branch's own turns.
NO_LIMIT = 2147483647


class _Seq(Protocol):
    @property
    def seq(self) -> int: ...


_Paged = TypeVar("_Paged", bound=_Seq)

_LINEAGE = "unnest(CAST(:lineage_ids AS uuid[]), CAST(:lineage_max_seqs AS int[])) AS l(branch_id, max_seq)"

BRANCH_HISTORY = text(
    f"""
    SELECT t.* FROM {_LINEAGE}
    JOIN turns t ON t.branch_id = l.branch_id AND t.seq <= l.max_seq AND t.deleted_at IS NULL
    ORDER BY t.seq
    """
)


def _newest_page(columns: str) -> TextClause:
    """One page of a history, newest first: the newest `limit` turns below a seq of each lineage
    entry (an index range scan each), then overall; `columns` of each. A long history is never
    read whole."""
    return text(
        f"""
        SELECT t.* FROM {_LINEAGE}
        CROSS JOIN LATERAL (
            SELECT {columns} FROM turns t
            WHERE t.branch_id = l.branch_id AND t.seq <= LEAST(l.max_seq, :below_seq - 1)
              AND t.deleted_at IS NULL
            ORDER BY t.seq DESC
            LIMIT :limit
        ) t
        ORDER BY t.seq DESC
        LIMIT :limit
        """
    )


BRANCH_HISTORY_PAGE = _newest_page("*")
# Only what a chat client's message is made of (its text, its tool calls and their results, the
# reply's status and error, the client's own id in the metadata), as rows, not Turn objects.
MESSAGE_COLUMNS = (
    "id, seq, role, status, content, tool_calls, tool_call_id, reply_id, interrupt_reason, error, "
    "metadata AS meta"
)
BRANCH_MESSAGES_PAGE = _newest_page(MESSAGE_COLUMNS)

# One page of a history, oldest first: the oldest `limit` turns above a seq of each lineage
# entry (an index range scan each), then overall; only what a history match reads of them.
BRANCH_HISTORY_FROM = text(
    f"""
    SELECT t.id, t.role, t.status, t.content, t.seq FROM {_LINEAGE}
    CROSS JOIN LATERAL (
        SELECT id, role, status, content, seq FROM turns t
        WHERE t.branch_id = l.branch_id AND t.seq > :after_seq AND t.seq <= l.max_seq AND t.deleted_at IS NULL
        ORDER BY t.seq
        LIMIT :limit
    ) t
    ORDER BY t.seq
    LIMIT :limit
    """
)

# The oldest user turn of a history the client names by its own id (kept in the turn's metadata
# under :key), or by the turn's id when the client gave it none.
USER_TURN_NAMED = text(
    f"""
    SELECT t.* FROM {_LINEAGE}
    JOIN turns t ON t.branch_id = l.branch_id AND t.seq <= l.max_seq AND t.deleted_at IS NULL
    WHERE t.role = 'user'
      AND CASE WHEN jsonb_typeof(t.metadata -> CAST(:key AS text)) = 'string'
                    AND t.metadata ->> CAST(:key AS text) <> ''
               THEN t.metadata ->> CAST(:key AS text) = CAST(:message_id AS text)
               ELSE CAST(t.id AS text) = CAST(:message_id AS text) END
    ORDER BY t.seq
    LIMIT 1
    """
)

# The newest turn of a lineage below a seq (optionally of one role): newest per entry, then overall.
NEWEST_TURN = text(
    f"""
    SELECT t.* FROM {_LINEAGE}
    CROSS JOIN LATERAL (
        SELECT * FROM turns t
        WHERE t.branch_id = l.branch_id AND t.seq <= LEAST(l.max_seq, :max_seq) AND t.deleted_at IS NULL
          AND (CAST(:role AS text) IS NULL OR t.role = CAST(:role AS text))
        ORDER BY t.seq DESC
        LIMIT 1
    ) t
    ORDER BY t.seq DESC
    LIMIT 1
    """
)

# Each branch with its newest turn and how many turns it holds itself.
BRANCH_SUMMARIES = text(
    """
    SELECT b.id, b.parent_branch_id, b.fork_seq, b.created_at,
           head.id AS head_turn_id, head.seq AS head_seq, head.role AS head_role, head.status AS head_status,
           (SELECT count(*) FROM turns o WHERE o.branch_id = b.id) AS own_turns
    FROM branches b
    LEFT JOIN LATERAL (
        SELECT t.id, t.seq, t.role, t.status
        FROM unnest(b.lineage_ids, b.lineage_max_seqs) AS l(branch_id, max_seq)
        CROSS JOIN LATERAL (
            SELECT t.id, t.seq, t.role, t.status FROM turns t
            WHERE t.branch_id = l.branch_id AND t.seq <= l.max_seq
            ORDER BY t.seq DESC
            LIMIT 1
        ) t
        ORDER BY t.seq DESC
        LIMIT 1
    ) head ON true
    WHERE b.conversation_id = :conversation_id
    ORDER BY b.created_at, b.id
    """
)

OWN_TURN_AT_OR_BELOW = text("SELECT 1 FROM turns WHERE branch_id = :branch_id AND seq <= :fork_seq LIMIT 1")

# Memory rows of turns that left (or rejoined) the active branch flip; the others are not written.
SYNC_MEMORY_FLAGS = text(
    f"""
    UPDATE memory_items m SET on_active_branch = NOT m.on_active_branch
    FROM turns t
    WHERE m.conversation_id = :conversation_id AND t.id = m.turn_id
      AND m.on_active_branch <> EXISTS (
          SELECT 1 FROM {_LINEAGE} WHERE l.branch_id = t.branch_id AND t.seq <= l.max_seq)
    """
)

# Of these turns, the ones that exist and are off their conversation's active branch.
OFF_ACTIVE_BRANCH = text(
    """
    SELECT t.id FROM turns t
    JOIN conversations c ON c.id = t.conversation_id
    JOIN branches b ON b.id = c.active_branch_id
    WHERE t.id = ANY(:turn_ids)
      AND NOT EXISTS (
          SELECT 1 FROM unnest(b.lineage_ids, b.lineage_max_seqs) AS l(branch_id, max_seq)
          WHERE l.branch_id = t.branch_id AND t.seq <= l.max_seq)
    """
).bindparams(bindparam("turn_ids", type_=ARRAY(UUID(as_uuid=True))))


@dataclass(frozen=True, slots=True)
class BranchSummary:
    """A branch as listed: where it forked and its newest turn."""

    id: uuid.UUID
    parent_branch_id: uuid.UUID | None
    fork_seq: int
    created_at: datetime
    head_turn_id: uuid.UUID | None
    head_seq: int | None
    head_role: str | None
    head_status: str | None
    own_turns: int


def _lineage_params(branch: Branch) -> dict[str, list[uuid.UUID] | list[int]]:
    return {"lineage_ids": list(branch.lineage_ids), "lineage_max_seqs": list(branch.lineage_max_seqs)}


def on_lineage(branch: Branch, turn: Turn) -> bool:
    """True when the turn is part of the branch's history."""
    pairs = zip(branch.lineage_ids, branch.lineage_max_seqs, strict=True)
    return any(b == turn.branch_id and turn.seq <= m for b, m in pairs)


async def load_branch(session: AsyncSession, branch_id: uuid.UUID) -> Branch:
    """A branch by id (the caller checked ownership of what led here)."""
    branch = await session.get(Branch, branch_id)
    if branch is None:
        raise NotFound("branch not found", branch_id=str(branch_id))
    return branch


async def conversation_branch(
    session: AsyncSession, conversation: Conversation, branch_id: uuid.UUID | None = None
) -> Branch:
    """One of the conversation's branches (default: the active one), or NotFound."""
    wanted = branch_id or conversation.active_branch_id
    branch = await session.get(Branch, wanted)
    if branch is None or branch.conversation_id != conversation.id:
        raise NotFound("branch not found", branch_id=str(wanted))
    return branch


async def branch_history(session: AsyncSession, branch: Branch) -> list[Turn]:
    """Every turn of the branch's history, oldest first (shared turns keep their own conversation id)."""
    rows = await session.execute(select(Turn).from_statement(BRANCH_HISTORY), _lineage_params(branch))
    return list(rows.scalars())


def encode_history_cursor(seq: int) -> str:
    """An opaque cursor for the page of a history before the turn with this seq."""
    return base64.urlsafe_b64encode(json.dumps(["before", seq]).encode()).decode().rstrip("=")


def decode_history_cursor(cursor: str) -> int:
    """The seq a history cursor reads before, or InvalidInput."""
    try:
        tag, seq = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if tag != "before" or type(seq) is not int or not 0 < seq <= NO_LIMIT:
            raise ValueError("not a history cursor")
        return seq
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidInput("malformed cursor", field="cursor") from exc


async def branch_history_page(
    session: AsyncSession, branch: Branch, *, limit: int, below_seq: int = NO_LIMIT
) -> tuple[list[Turn], int | None]:
    """The newest `limit` turns of the branch's history below `below_seq`, oldest first, and the
    seq to read the page before them from (None: the page reaches the history's start)."""
    rows = await session.execute(
        select(Turn).from_statement(BRANCH_HISTORY_PAGE), _page_params(branch, limit, below_seq)
    )
    return _oldest_first(list(rows.scalars()), limit)


async def _message_rows_page(
    session: AsyncSession, branch: Branch, *, limit: int, below_seq: int
) -> tuple[list[Row[Any]], int | None]:
    """As `branch_history_page`, each turn a row of MESSAGE_COLUMNS."""
    rows = await session.execute(BRANCH_MESSAGES_PAGE, _page_params(branch, limit, below_seq))
    return _oldest_first(list(rows), limit)


def _page_params(branch: Branch, limit: int, below_seq: int) -> dict[str, Any]:
    # One more than the page: whether older turns exist.
    return {**_lineage_params(branch), "limit": limit + 1, "below_seq": below_seq}


def _oldest_first(newest_first: list[_Paged], limit: int) -> tuple[list[_Paged], int | None]:
    more = len(newest_first) > limit
    page = newest_first[:limit]
    page.reverse()
    return page, (page[0].seq if more else None)


def history_newest_first(
    session: AsyncSession, branch: Branch, *, page: int = 50, below_seq: int = NO_LIMIT
) -> AsyncGenerator[Turn, None]:
    """The branch's history (below `below_seq`) newest turn first, read a page at a time: a caller
    that stops early (what it looks for is nearly always among the newest) never reads a long
    history whole."""

    async def read(below: int) -> tuple[list[Turn], int | None]:
        return await branch_history_page(session, branch, limit=page, below_seq=below)

    return _newest_first(read, below_seq)


def message_rows_newest_first(
    session: AsyncSession, branch: Branch, *, page: int = 50, below_seq: int = NO_LIMIT
) -> AsyncGenerator[Row[Any], None]:
    """As `history_newest_first`, each turn a row of MESSAGE_COLUMNS (the `metadata` column as
    `meta`, as on Turn): Turn objects of a page of 1,001 turns took ~14 ms of the event loop's CPU,
    rows ~4 ms."""

    async def read(below: int) -> tuple[list[Row[Any]], int | None]:
        return await _message_rows_page(session, branch, limit=page, below_seq=below)

    return _newest_first(read, below_seq)


async def _newest_first(
    read: Callable[[int], Awaitable[tuple[list[_Paged], int | None]]], below_seq: int
) -> AsyncGenerator[_Paged, None]:
    below = below_seq
    while True:
        turns, first_seq = await read(below)
        for turn in reversed(turns):
            yield turn
        if first_seq is None:
            return
        below = first_seq


async def history_oldest_first(
    session: AsyncSession, branch: Branch, *, page: int = 16, max_page: int = 512
) -> AsyncGenerator[list[Row[Any]], None]:
    """The branch's history oldest turn first, in pages that double in size up to `max_page`: a
    caller that stops early (a prefix it compares differs) reads little more than it compared.

    Each turn is a row of its `id`, `role`, `status`, `content` and `seq`, not a Turn: making
    ORM objects of a 512-turn page took ~8 ms of the event loop's CPU, the row ~1 ms."""
    after = -1
    while True:
        rows = await session.execute(
            BRANCH_HISTORY_FROM, {**_lineage_params(branch), "limit": page, "after_seq": after}
        )
        turns = list(rows)
        if turns:
            yield turns
        if len(turns) < page:
            return
        after = turns[-1].seq
        page = min(page * 2, max_page)


async def user_turn_named(session: AsyncSession, branch: Branch, key: str, message_id: str) -> Turn | None:
    """The oldest user turn of the branch's history whose client id (metadata `key`) is
    `message_id`, or whose own id is when the client gave it none."""
    rows = await session.execute(
        select(Turn).from_statement(USER_TURN_NAMED),
        {**_lineage_params(branch), "key": key, "message_id": message_id},
    )
    return rows.scalars().first()


async def newest_turn(
    session: AsyncSession, branch: Branch, *, role: str | None = None, max_seq: int = NO_LIMIT
) -> Turn | None:
    """The newest turn of the branch's history with seq <= max_seq (and the role, if given)."""
    rows = await session.execute(
        select(Turn).from_statement(NEWEST_TURN),
        {**_lineage_params(branch), "role": role, "max_seq": max_seq},
    )
    return rows.scalars().first()


async def user_turn_before(session: AsyncSession, turn: Turn) -> Turn | None:
    """The user message a reply turn answers: the newest user turn before it on its own branch."""
    branch = await load_branch(session, turn.branch_id)
    return await newest_turn(session, branch, role="user", max_seq=turn.seq - 1)


async def list_branches(session: AsyncSession, conversation: Conversation) -> list[BranchSummary]:
    """The conversation's branches, oldest first, each with its fork point and newest turn."""
    rows = await session.execute(BRANCH_SUMMARIES, {"conversation_id": conversation.id})
    return [BranchSummary(**row._mapping) for row in rows]


async def _fork_point(session: AsyncSession, parent: Branch, fork_seq: int) -> tuple[Branch, int]:
    # A parent with no own turns at or below the fork point adds nothing: fork from its fork
    # point instead, so an edit of a branch's first message makes a sibling rather than a child.
    while parent.parent_branch_id is not None:
        own = await session.execute(OWN_TURN_AT_OR_BELOW, {"branch_id": parent.id, "fork_seq": fork_seq})
        if own.first() is not None:
            break
        above = await session.get(Branch, parent.parent_branch_id)
        if above is None:
            break
        parent, fork_seq = above, min(fork_seq, parent.fork_seq)
    return parent, fork_seq


async def create_branch(
    session: AsyncSession,
    conversation: Conversation,
    *,
    parent: Branch,
    fork_seq: int,
    branch_id: uuid.UUID | None = None,
) -> Branch:
    """A new branch of `conversation`: parent's history up to fork_seq, then its own turns."""
    if parent.tenant_id != conversation.tenant_id or parent.user_id != conversation.user_id:
        raise NotFound("branch not found", branch_id=str(parent.id))
    parent, fork_seq = await _fork_point(session, parent, fork_seq)
    own = branch_id or uuid.uuid4()
    branch = await session.get(Branch, own) if branch_id is not None else None
    if branch is None:
        branch = Branch(
            id=own,
            tenant_id=conversation.tenant_id,
            user_id=conversation.user_id,
            conversation_id=conversation.id,
        )
        session.add(branch)
    branch.parent_branch_id = parent.id
    branch.fork_seq = fork_seq
    branch.lineage_ids = [own, *parent.lineage_ids]
    branch.lineage_max_seqs = [NO_LIMIT, *(min(m, fork_seq) for m in parent.lineage_max_seqs)]
    await session.flush()
    return branch


async def activate_branch(session: AsyncSession, conversation: Conversation, branch: Branch) -> None:
    """Make `branch` the one new turns go to and prompts and memory follow.

    The caller holds the conversation row locked (``get_conversation(for_update=True)``).
    """
    if conversation.active_reply_id is not None:
        raise ConversationBusy(
            "a reply is streaming in this conversation", running_turn_id=str(conversation.active_reply_id)
        )
    if branch.conversation_id != conversation.id:
        raise NotFound("branch not found", branch_id=str(branch.id))
    if conversation.active_branch_id == branch.id:
        return
    conversation.active_branch_id = branch.id
    await session.flush()
    await session.execute(SYNC_MEMORY_FLAGS, {"conversation_id": conversation.id, **_lineage_params(branch)})


async def fork_branch(
    session: AsyncSession, conversation: Conversation, *, parent: Branch, fork_seq: int
) -> Branch:
    """A new branch of `parent` after `fork_seq`, made the active one: where a new answer goes.

    Regenerate, edit and every adapter that continues a conversation from an earlier point
    fork this way. The caller holds the conversation row locked.
    """
    branch = await create_branch(session, conversation, parent=parent, fork_seq=fork_seq)
    await activate_branch(session, conversation, branch)
    return branch


async def turns_off_active_branch(session: AsyncSession, turn_ids: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """Which of these turns are off their conversation's active branch (missing turns are not)."""
    if not turn_ids:
        return set()
    rows = await session.execute(OFF_ACTIVE_BRANCH, {"turn_ids": list(turn_ids)})
    return {row.id for row in rows}


# --- what each operation forks from -----------------------------------------------------------


def _finished(turn: Turn) -> None:
    if turn.status in (TurnStatus.STREAMING, TurnStatus.AWAITING_APPROVAL):
        raise TurnNotFinished("the turn has not finished yet", turn_id=str(turn.id), status=turn.status)


async def _on_active_branch(session: AsyncSession, conversation: Conversation, turn: Turn) -> Branch:
    active = await conversation_branch(session, conversation)
    if not on_lineage(active, turn):
        raise NotOnActiveBranch(
            "the turn is not on the conversation's active branch",
            turn_id=str(turn.id),
            active_branch_id=str(active.id),
        )
    return active


async def regenerate_point(
    session: AsyncSession, conversation: Conversation, turn: Turn
) -> tuple[Branch, int, Turn]:
    """(parent, fork_seq, user turn) to regenerate the reply `turn` belongs to.

    The turn must be part of the last reply of the active branch (nothing after it but the
    reply's own turns); the new branch forks just after the reply's user turn.
    """
    if turn.role == "user":
        raise InvalidInput("regenerate takes a reply's turn, not a user message", field="turn_id")
    _finished(turn)
    active = await _on_active_branch(session, conversation, turn)
    user_turn = await newest_turn(session, active, role="user")
    if user_turn is None or user_turn.seq > turn.seq:
        raise NotLastReply(
            "only the last reply of the active branch can be regenerated", turn_id=str(turn.id)
        )
    parent = await load_branch(session, user_turn.branch_id)
    return parent, user_turn.seq, user_turn


async def edit_point(session: AsyncSession, conversation: Conversation, turn: Turn) -> tuple[Branch, int]:
    """(parent, fork_seq) to replace the user message `turn`: the new branch forks just before it."""
    if turn.role != "user":
        raise InvalidInput("only a user message can be edited", field="turn_id")
    await _on_active_branch(session, conversation, turn)
    parent = await load_branch(session, turn.branch_id)
    return parent, turn.seq - 1


async def fork_conversation(
    session: AsyncSession, owner: Owner, source: Conversation, turn: Turn, *, title: str | None = None
) -> Conversation:
    """A new conversation whose history is `source`'s up to and including `turn` (shared, not copied)."""
    _finished(turn)
    if turn.conversation_id != source.id:
        # A turn the source shares from another conversation (a fork of a fork): only via its history.
        await _on_active_branch(session, source, turn)
    parent = await load_branch(session, turn.branch_id)
    fork_id = uuid.uuid4()
    fork = Conversation(
        id=fork_id,
        tenant_id=owner.tenant_id,
        user_id=owner.user_id,
        title=source.title if title is None else title,
        memory_mode=source.memory_mode,
        next_seq=turn.seq + 1,
        # Nothing of its own at or below the fork point: the memory watermark starts there.
        indexed_seq=turn.seq,
        active_branch_id=fork_id,
    )
    session.add(fork)
    await session.flush()  # the root branch row is made by the trigger of migration 0005
    await create_branch(session, fork, parent=parent, fork_seq=turn.seq, branch_id=fork_id)
    await session.refresh(fork)
    return fork
