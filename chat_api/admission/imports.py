"""Admitted imports: history stored in bulk is charged to the user's hourly import quota.

An import is accepted in a second and costs minutes of embedding, so every way to store
history in bulk (the import route, the OpenAI adapter's unmatched history, any adapter
to come) goes through `Admission.admit_import`: the import rules of `memory.record.imports`
(turns per request, characters per message, well-formed items) and then
IMPORT_TURNS_PER_HOUR, a token bucket refilled evenly over the hour. A whole batch must
fit in what is left; the turns it did not create (skipped as already imported, or the
request failed) are given back by `settle`, so resending an interrupted import is
charged only for what it adds.
"""

from __future__ import annotations

from types import TracebackType

from chat_api.admission.bucket import TokenBuckets
from memory.record.conversations import Owner
from memory.record.imports import ImportTurn


class AdmittedImport:
    """Turns this user may import now, already charged; `settle(created)` returns the rest."""

    def __init__(self, quota: TokenBuckets[Owner], owner: Owner, turns: list[ImportTurn]) -> None:
        self._quota = quota
        self.owner = owner
        self.turns = turns
        self._open = True

    def settle(self, created: int) -> None:
        """The import is over and created `created` turns; the others are given back (once)."""
        if self._open:
            self._open = False
            self._quota.give_back(self.owner, len(self.turns) - created)

    def __enter__(self) -> AdmittedImport:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.settle(0)  # nothing, if settled already; everything, if the import failed
