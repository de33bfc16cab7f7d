"""The trainer's memory of the groups it trained lately, so a group read twice is refused.

Why: the stream emits each group to ``rollouts.scored`` once (``streams.faust.txn``), but a bug or
a future failure mode there would otherwise train a group twice, silently. The trainer
keeps the ids of the last ``RECENT_GROUPS`` groups it consumed in its checkpoint state, so
the memory survives restarts exactly as far as the weights do: a group replayed after a
crash (its gradient lost with the weights) is not in the restored memory and trains again;
a group whose gradient is in the weights is. Refusals are counted (metrics, the run's
summary) and listed in the training ledger, where ``rollstream audit`` reports them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

RECENT_GROUPS = 65_536
"""Group ids remembered: far more than a staleness window of steps holds (a group id
is a few dozen bytes, so the checkpoint grows by a few MiB at most)."""


class RecentGroups:
    """A bounded set of group ids, oldest forgotten first."""

    def __init__(self, ids: Iterable[str] = (), limit: int = RECENT_GROUPS) -> None:
        if limit < 1:
            raise ValueError(f"RecentGroups limit must be >= 1, got {limit}")
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self.limit = limit
        for group_id in ids:
            self.add(group_id)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, group_id: str) -> None:
        if group_id in self._ids:
            return
        if len(self._order) >= self.limit:
            self._ids.discard(self._order.popleft())
        self._order.append(group_id)
        self._ids.add(group_id)

    def to_state(self) -> list[str]:
        """Oldest first: what ``RecentGroups(ids)`` restores."""
        return list(self._order)
