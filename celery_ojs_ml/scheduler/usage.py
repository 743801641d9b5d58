"""Fair share with memory: each queue's GPU use, decayed with a half-life (Slurm's fair share).

Key decisions:
* A queue's usage U is the GPU-seconds it held, each decayed by
  2^(-age / half_life) (Slurm's `PriorityDecayHalfLife`). Between two passes
  the holdings are taken as constant (the holdings the earlier pass saw), so
  U(t + dt) = U(t) * 2^(-dt/h) + G * tau * (1 - 2^(-dt/h)) with tau = h / ln 2
  is exact for holdings that change only at passes. A queue holding G GPUs
  for ever tends to U = G * tau.
* Slurm's classic fair-share factor is F = 2^(-U_norm / S_norm), with U_norm
  the queue's share of all decayed usage and S_norm its share of the weights
  (https://slurm.schedmd.com/priority_multifactor.html, "Fair-share Factor";
  https://slurm.schedmd.com/classic_fair_share.html). Ordering queues by F,
  highest first, is ordering them by U / w, lowest first: the normalising sums
  are common to all queues. `factors` reports F; the order uses U / w.
* Fair order (`scheduler.fair`) starts each queue's count at its decayed mean
  of GPUs held, U / tau, plus the GPUs it holds now: a queue that has held G
  GPUs steadily starts at 2G, so on a steady fleet the order is the
  memoryless one, and a queue that flooded the fleet before another arrived
  gives way to it until its usage decays. Half-life 0 (the default) keeps no
  memory at all.
* The state is a few numbers per queue; the leader persists it (JSON) so that
  a new leader continues it, decayed over the time between.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Usage:
    """Each queue's decayed GPU-seconds as of `at`, and what it held since (see module doc)."""

    half_life_s: float
    at: float | None = None
    """Scheduler clock of the last `advance`; None: nothing observed yet."""
    gpu_s: Mapping[str, float] = field(default_factory=dict)
    """Decayed GPU-seconds per queue at `at`."""
    held: Mapping[str, float] = field(default_factory=dict)
    """GPUs each queue held at `at`; taken as held until the next `advance`."""

    @property
    def tau(self) -> float:
        """Mean life of a GPU-second of usage, `half_life_s / ln 2` (0: no memory)."""
        return self.half_life_s / math.log(2) if self.half_life_s > 0 else 0.0

    def advance(self, now: float, held: Mapping[str, float]) -> Usage:
        """The usage at `now`: decayed since `at`, plus what was held since, decayed."""
        if self.half_life_s <= 0:
            return self
        if self.at is None:
            return Usage(self.half_life_s, now, {}, dict(held))
        keep = decay(max(0.0, now - self.at), self.half_life_s)
        gpu_s: dict[str, float] = {}
        for queue in {*self.gpu_s, *self.held}:
            used = self.gpu_s.get(queue, 0.0) * keep + self.held.get(queue, 0.0) * self.tau * (
                1.0 - keep
            )
            if used > 1e-6 or held.get(queue):
                gpu_s[queue] = used
        return Usage(self.half_life_s, max(now, self.at), gpu_s, dict(held))

    def mean_gpus(self) -> dict[str, float]:
        """Each queue's decayed mean of GPUs held, `U / tau`: what fair order starts from."""
        tau = self.tau
        return {q: u / tau for q, u in self.gpu_s.items()} if tau else {}

    def factors(self, weights: Mapping[str, float]) -> dict[str, float]:
        """Slurm's classic fair-share factor F = 2^(-U_norm / S_norm) of every queue that
        has usage or a weight (1.0: no usage; 0.5: used exactly its share)."""
        queues = {*self.gpu_s, *weights}
        total_u = sum(self.gpu_s.values())
        total_w = sum(max(weights.get(q, 1.0), 1e-9) for q in queues)
        out: dict[str, float] = {}
        for q in queues:
            u = self.gpu_s.get(q, 0.0) / total_u if total_u > 0 else 0.0
            s = max(weights.get(q, 1.0), 1e-9) / total_w
            out[q] = 2.0 ** (-u / s)
        return out

    def dumps(self) -> str:
        """JSON of the state (`loads` reads it back)."""
        data = {"at": self.at, "gpu_s": dict(self.gpu_s), "held": dict(self.held)}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def loads(cls, raw: str | bytes | None, half_life_s: float) -> Usage:
        """The state `dumps` wrote, with this half-life; empty on anything unreadable."""
        try:
            data: Any = json.loads(raw) if raw else {}
            at = data.get("at")
            return cls(
                half_life_s,
                None if at is None else float(at),
                {str(q): float(u) for q, u in (data.get("gpu_s") or {}).items()},
                {str(q): float(g) for q, g in (data.get("held") or {}).items()},
            )
        except (ValueError, TypeError, AttributeError):
            return cls(half_life_s)


def decay(dt: float, half_life_s: float) -> float:
    """What is left of one unit of usage after `dt` seconds: 2^(-dt / half_life_s)."""
    return 2.0 ** (-dt / half_life_s) if half_life_s > 0 else 0.0
