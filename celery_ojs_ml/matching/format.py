"""The one formatter of pending messages, shared by the CLI, events and the store.

Key decision (after Kubernetes' `0/3 nodes are available: ...`): reasons are
counted across workers by their message and listed most common first, so one
line explains why a job waits on a whole fleet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from celery_ojs_ml.matching.match import MatchResult


def pending_message(
    results: Iterable[MatchResult], *, noun: str = "workers", limit: int = 8
) -> str:
    """`0/3 workers eligible: 2 gpu_memory_gb 40 < 80, 1 gpu_type t4 not in [a100]`."""
    results = list(results)
    if not results:
        return f"0/0 {noun} eligible: no live {noun}"
    # Eligible means what `MatchResult.eligible` means (FITS or WAIT), so the
    # count agrees with `match --json`; WAIT workers still list their reasons.
    eligible = sum(1 for r in results if r.eligible)
    # A worker counts once per distinct message, however many reasons repeat it. Workers
    # alike share one result object: each distinct one is formatted once.
    same = Counter(map(id, results))
    counts: Counter[str] = Counter()
    for r in {id(r): r for r in results}.values():
        for msg in dict.fromkeys(x.message for x in r.reasons):
            counts[msg] += same[id(r)]
    head = f"{eligible}/{len(results)} {noun} eligible"
    if not counts:
        return head
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{n} {msg}" for msg, n in ordered[:limit])
    rest = len(ordered) - limit
    return head + ": " + shown + (f", and {rest} more" if rest > 0 else "")
