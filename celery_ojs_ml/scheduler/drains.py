"""When the workers of one shape bucket drain, indexed so a placement picks one in O(log n).

Key decision: among interchangeable workers a job goes to the one whose jobs
end latest up to the job's own end (`fleet.aligned`), the first in bucket
order on a tie. That worker is the first whose drain time reaches the job's
end, or, where none does, the first with the latest drain time. A max
segment tree over bucket positions finds either with one descent, where a
scan would look at every busy worker of the shape for every decision. A
position is never reused: a worker that leaves the bucket leaves an empty
leaf, one that comes back is appended (bucket order is insertion order), and
the tree is rebuilt, compacted, only when it runs out of positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

_EMPTY = -math.inf


class Drains:
    """Drain times of one bucket's workers, in bucket order (see module doc)."""

    __slots__ = ("_at", "_next", "_size", "_tree", "_who")

    def __init__(self, items: Iterable[tuple[int, float]]) -> None:
        self._build(list(items))

    def _build(self, items: list[tuple[int, float]]) -> None:
        size = 1
        while size < 2 * len(items) + 1:
            size *= 2  # half the positions are free for workers that come back
        self._size = size
        self._tree = [_EMPTY] * (2 * size)
        self._who = [-1] * size
        self._at: dict[int, int] = {}
        for pos, (idx, drain) in enumerate(items):
            self._tree[size + pos] = drain
            self._who[pos] = idx
            self._at[idx] = pos
        for node in range(size - 1, 0, -1):
            self._tree[node] = max(self._tree[2 * node], self._tree[2 * node + 1])
        self._next = len(items)

    def add(self, idx: int, drain: float) -> None:
        """Append worker `idx`, which drains at `drain`, to the end of the bucket."""
        if self._next == self._size:
            tree, size = self._tree, self._size
            live = [(self._who[p], tree[size + p]) for p in sorted(self._at.values())]
            self._build(live)
        pos = self._next
        self._next += 1
        self._who[pos] = idx
        self._at[idx] = pos
        self._set(pos, drain)

    def remove(self, idx: int) -> None:
        """Take worker `idx` out of the bucket."""
        self._set(self._at.pop(idx), _EMPTY)

    def pick(self, end: float) -> int:
        """The first worker whose drain reaches `end`, else the first that drains latest
        (`max(..., key=aligned)` in bucket order); -1 when the bucket is empty."""
        tree, size = self._tree, self._size
        top = tree[1]
        if top == _EMPTY:
            return -1
        target = min(top, end)
        node = 1
        while node < size:
            node *= 2
            if tree[node] < target:
                node += 1
        return self._who[node - size]

    def _set(self, pos: int, drain: float) -> None:
        tree = self._tree
        node = self._size + pos
        tree[node] = drain
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
