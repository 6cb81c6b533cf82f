"""Whether a user has anything recall could find: checked while a reply is accepted.

A user with no memory rows and no turn waiting for the indexer gets no memories from any
search, whatever the question. Encoding the question and running the search statement for
such a user was most of what memory added before a new user's first token (and, on a busy
encoder, their queue). The door checks this in the transaction that stores the reply's
turns, before it starts encoding the query ahead (``memory.recall.prepared_queries``), and
the reply's recall then skips the encode and the search (``Recaller.search(nothing_stored=...)``);
it still rewrites the message and announces ``memory.retrieved`` as any recall does.

What the check counts is a superset of what a search can return: any memory row of the user
in any generation, deleted or not yet purged aside, and any conversation of theirs that
remembers and has a turn above its watermark (the turns ``memory.recall.unindexed`` reads
from). The reply's own new turns are stored after the check, and a search excludes them
anyway. A search runs against the generation it reads then; the check records the one it
saw and whether that generation is still made by its encoder, and the recall skips only if
it reads that same generation: a generation taken over or switched in between is searched
as before (and refused as before, ``ForeignGeneration``).

Once a user is seen to have memory, this process does not check them again (``Remembering``):
users mostly keep theirs, and one who has since lost it all is searched as every user was
before the check existed. Only "nothing stored" must be current, and it is read each time.

The check reads a snapshot taken as the reply is accepted; a search reads one a few
milliseconds later. Memory indexed in between (from another of the user's conversations)
is not found by this reply, as it would not be by a reply accepted a moment earlier.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.recall.index import Generation
from memory.record.conversations import Owner

# Users seen with memory, per process: enough for every user active in a while.
DEFAULT_REMEMBERED_OWNERS = 50_000

# Both through the owners' indexes (memory_items: tenant, user, index; conversations: tenant,
# user, created_at); the first row found ends each. The generation's key is read with them,
# so that a taken-over generation is never skipped (its search raises ForeignGeneration).
_ANYTHING_STORED = text(
    """
    SELECT EXISTS (
               SELECT 1 FROM memory_items m
               WHERE m.tenant_id = :tenant_id AND m.user_id = :user_id AND m.deleted_at IS NULL
           )
           OR EXISTS (
               SELECT 1 FROM conversations c
               WHERE c.tenant_id = :tenant_id AND c.user_id = :user_id
                 AND c.deleted_at IS NULL AND c.memory_mode <> 'none'
                 AND c.next_seq - 1 > GREATEST(c.indexed_seq, c.memory_forgotten_seq)
           ) AS stored,
           (SELECT g.spec_key FROM memory_indexes g WHERE g.id = :index_id) AS index_key
    """
)


@dataclass(frozen=True, slots=True)
class NothingStored:
    """The user had nothing to recall when their reply was accepted, with this generation."""

    generation_id: int
    generation_key: str

    def holds_for(self, generation: Generation) -> bool:
        """The recall reads the generation the check saw: its search would find nothing."""
        return (generation.id, generation.key) == (self.generation_id, self.generation_key)


async def nothing_stored(session: AsyncSession, owner: Owner, generation: Generation) -> NothingStored | None:
    """``NothingStored`` if ``owner`` has no memory row and no turn waiting to be indexed; else None."""
    row = (
        await session.execute(
            _ANYTHING_STORED,
            {"tenant_id": owner.tenant_id, "user_id": owner.user_id, "index_id": generation.id},
        )
    ).one()
    if row.stored or row.index_key != generation.key:
        return None
    return NothingStored(generation.id, generation.key)


class Remembering:
    """The users this process has seen with something stored, the most recently seen kept."""

    def __init__(self, *, max_entries: int = DEFAULT_REMEMBERED_OWNERS) -> None:
        self.max_entries = max_entries
        self._owners: OrderedDict[Owner, None] = OrderedDict()

    def __contains__(self, owner: Owner) -> bool:
        if owner not in self._owners:
            return False
        self._owners.move_to_end(owner)
        return True

    def add(self, owner: Owner) -> None:
        self._owners[owner] = None
        self._owners.move_to_end(owner)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)
