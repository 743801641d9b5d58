"""Queue GPU budgets (OJS ML §10.3): `max_total_gpus` and `max_concurrent_gpu_jobs`.

Key decisions:
- A budget is a limit on what a logical queue holds fleet-wide at once, counted
  from what runs and what is assigned (the caller passes both, by task id, so
  nothing is counted twice and no counter can drift across crashes or a new
  leader). Only GPU jobs count, as the setting names say.
- A job over its queue's budget waits (§10.3 MUST NOT reject). It holds no
  reservation and preempts nothing, so the jobs of other queues, and smaller
  jobs of its own queue that still fit the budget, go on as if it were not
  there. Its `reason_pending` names the budget:
  `queue 'train' budget: 8/8 GPUs in use (max_total_gpus)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Budget:
    """One queue's §10.3 limits; None is unlimited."""

    max_total_gpus: int | None = None
    max_concurrent_gpu_jobs: int | None = None

    @property
    def limited(self) -> bool:
        return self.max_total_gpus is not None or self.max_concurrent_gpu_jobs is not None


@dataclass(slots=True)
class Use:
    """What a queue holds now: GPUs and GPU jobs."""

    gpus: int = 0
    jobs: int = 0


class BudgetBook:
    """Budget use of one pass: seeded from running and assigned jobs, grown by assignments."""

    def __init__(self, budgets: Mapping[str, Budget], held: Iterable[tuple[str, int]]) -> None:
        self.budgets = {q: b for q, b in budgets.items() if b.limited}
        self.use: dict[str, Use] = {q: Use() for q in self.budgets}
        for queue, gpus in held:
            self._add(queue, gpus)

    def blocks(self, queue: str, gpus: int, jobs: int = 1) -> str | None:
        """Why a `gpus`-GPU job of `queue` must wait for its budget; None when it may start.

        `jobs`: how many GPU jobs it is (a gang's ranks, `gpus` their total)."""
        budget = self.budgets.get(queue)
        if budget is None or gpus <= 0:
            return None
        use = self.use[queue]
        total = budget.max_total_gpus
        if total is not None and use.gpus + gpus > total:
            need = f"; the job needs {gpus}" if use.gpus < total else ""
            return f"queue '{queue}' budget: {use.gpus}/{total} GPUs in use (max_total_gpus){need}"
        most = budget.max_concurrent_gpu_jobs
        if most is not None and use.jobs + jobs > most:
            return (
                f"queue '{queue}' budget: {use.jobs}/{most} GPU jobs running "
                "(max_concurrent_gpu_jobs)"
            )
        return None

    def take(self, queue: str, gpus: int) -> None:
        """A job of `queue` was assigned (or planned to preempt) with `gpus` GPUs."""
        self._add(queue, gpus)

    def _add(self, queue: str, gpus: int) -> None:
        use = self.use.get(queue)
        if use is not None and gpus > 0:
            use.gpus += gpus
            use.jobs += 1

    def report(self) -> dict[str, dict[str, int | None]]:
        """`{queue: {gpus, max_total_gpus, jobs, max_concurrent_gpu_jobs}}` for `status`."""
        return {
            q: {
                "gpus": self.use[q].gpus,
                "max_total_gpus": b.max_total_gpus,
                "jobs": self.use[q].jobs,
                "max_concurrent_gpu_jobs": b.max_concurrent_gpu_jobs,
            }
            for q, b in sorted(self.budgets.items())
        }
