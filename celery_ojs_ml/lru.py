"""A bounded least-recently-used map for the plugin's memo tables.

Key decision: every memo the plugin keeps in a long-lived process (parsed
requirements, resolved routes, eligibility verdicts, capabilities) is keyed by
something a producer controls, such as a checkpoint URI per run. An unbounded
dict would grow with the traffic; this map keeps at most `maxsize` entries and
drops the least recently used one first, so a hot working set stays cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A mapping of at most `maxsize` entries, evicting the least recently used."""

    __slots__ = ("_data", "maxsize")

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, e.g. LRU(1024), but got {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value of `key` (now the most recently used), or None."""
        try:
            self._data.move_to_end(key)
        except KeyError:
            return None
        return self._data[key]

    def __setitem__(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        """Forget every entry."""
        self._data.clear()
