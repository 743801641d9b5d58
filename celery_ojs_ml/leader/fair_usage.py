"""The leader's fair-share memory (`ojs_ml_fair_share_half_life_s`): decayed GPU use per queue.

Key decisions:
* The pure state and its math are `scheduler.usage.Usage`; the leader
  advances it once per pass with the GPUs each queue holds (running and
  assigned, as the pass counts them) and hands the core each queue's decayed
  mean (`schedule(..., usage=)`), so the replay and the leader share one code.
* It persists in one small key, `<prefix>:{ml}:scheduler:fairshare` (JSON, a
  few numbers per queue), at most once a second, with a TTL of 20 half-lives
  (usage older than that has decayed below a millionth). A new leader reads it
  at `hello` and continues it, decayed over the time between: at most a
  second of holdings is lost at a failover.
* Without a half-life (or weights) it does nothing and writes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_ojs_ml.scheduler import Policy
from celery_ojs_ml.scheduler.fair import held_gpus
from celery_ojs_ml.scheduler.usage import Usage

from .pass_state import PassState

log = logging.getLogger("celery_ojs_ml.leader.loop")

_WRITE_EVERY_S = 1.0
"""Least time between two writes of the usage key."""


class FairUsage:
    """Decayed GPU use per queue, kept across passes and leaders (see module doc)."""

    def __init__(self, store: Any, policy: Policy) -> None:
        self.store = store
        self.half_life_s = policy.fair_share_half_life_s if policy.weights else 0.0
        self.usage = Usage(self.half_life_s)
        self._written = float("-inf")

    @property
    def on(self) -> bool:
        """Whether a half-life is set (with fair-share weights)."""
        return self.half_life_s > 0

    def _key(self) -> str:
        return str(self.store.key("scheduler", "fairshare"))

    def hello(self) -> None:
        """A new leadership: continue the usage the last leader persisted."""
        if not self.on:
            return
        try:
            self.usage = Usage.loads(self.store.client.get(self._key()), self.half_life_s)
        except Exception as exc:  # the store is down: start from nothing, the next pass retries
            log.warning("ojs-ml: could not read the fair-share usage: %s", exc)
            self.usage = Usage(self.half_life_s)
        self._written = float("-inf")

    def advance(self, state: PassState) -> dict[str, float] | None:
        """Count the GPUs held since the last pass and return each queue's decayed mean of
        GPUs held, for `schedule(..., usage=)`; None without a half-life."""
        if not self.on:
            return None
        held = {q: float(n) for q, n in held_gpus(state.fleet, state.inflight).items()}
        self.usage = self.usage.advance(state.now, held)
        if state.now - self._written >= _WRITE_EVERY_S:
            self._written = state.now
            ttl_ms = int(max(60.0, 20 * self.half_life_s) * 1000)
            self.store.client.set(self._key(), self.usage.dumps(), px=ttl_ms)
        return self.usage.mean_gpus()
