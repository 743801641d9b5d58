"""Which requests form one batch, and when a forming batch goes (pure: no Celery, no I/O).

Key decisions:
* Requests batch together only when one allocation fits them all by
  construction: the same task, the same requirement class (the hash of the
  hard constraints: device demand and a pinned model version among them), band
  and model id. A gang rank never batches.
* A batch forms around the first request that got an allocation (its head)
  and goes when it is full, or when it has waited `max_wait_s` with its devices
  free. Requests that queued while the devices were busy do not wait at all:
  a batch that finds requests of its kind waiting goes at once (the dynamic
  batching rule of Triton's scheduler: the delay only applies to an idle
  instance).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_ojs_ml.wire import headers as h

GroupKey = tuple[Hashable, ...]
_MODEL = "ext_ml_model_id"


def group_key(name: str, headers: Mapping[str, Any]) -> GroupKey | None:
    """The batch group of a request of task `name`: its task, requirement class (which
    fixes its device demand), band and model; None where it never batches (a gang rank)."""
    if h.RENDEZVOUS in headers or h.GANG in headers:
        return None
    cls = headers.get(h.CLASS)
    if not isinstance(cls, str):  # not routed by the plugin: its ML headers stand for it
        cls = repr(sorted((k, repr(v)) for k, v in headers.items() if k.startswith("ext_ml_")))
    return (name, cls, headers.get(h.BAND), headers.get(_MODEL))


@dataclass(slots=True)
class Forming:
    """A batch that holds its allocation and waits for more requests."""

    key: GroupKey
    head: Any
    alloc: Any
    max_size: int
    deadline: float
    followers: list[Any] = field(default_factory=list)
    timer: Any = None
    """The event-loop timer that sends it at its deadline (cancelled when it goes early)."""

    @property
    def size(self) -> int:
        return 1 + len(self.followers)

    @property
    def full(self) -> bool:
        return self.size >= self.max_size

    @property
    def room(self) -> int:
        return max(0, self.max_size - self.size)


class FormingBook:
    """The batches forming on one worker, by group (at most one per group)."""

    def __init__(self) -> None:
        self.by_key: dict[GroupKey, Forming] = {}

    def joinable(self, key: GroupKey) -> Forming | None:
        """The forming batch of `key` with room for one more, or None."""
        found = self.by_key.get(key)
        return found if found is not None and not found.full else None

    def add(self, batch: Forming) -> None:
        self.by_key[batch.key] = batch

    def pop(self, key: GroupKey) -> Forming | None:
        return self.by_key.pop(key, None)

    def due(self, now: float) -> list[Forming]:
        """The forming batches whose deadline has passed."""
        return [b for b in self.by_key.values() if b.deadline <= now]

    def __len__(self) -> int:
        return len(self.by_key)

    def all(self) -> list[Forming]:
        return list(self.by_key.values())


def take_waiting(
    waiting: Iterable[Any], key: GroupKey, key_of: Callable[[Any], GroupKey | None], room: int
) -> list[Any]:
    """The first `room` of `waiting` (in the order given: the hold queue's) in group `key`."""
    out: list[Any] = []
    if room <= 0:
        return out
    for item in waiting:
        if key_of(item) == key:
            out.append(item)
            if len(out) >= room:
                break
    return out


def goes_now(batch: Forming, found_waiting: bool, now: float) -> bool:
    """Whether a batch just formed goes at once: it is full, requests of its kind were
    waiting (they queued while the devices were busy), or it may not wait at all."""
    return batch.full or found_waiting or batch.deadline <= now
