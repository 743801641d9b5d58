"""Tests for `celery_ojs_ml.matching.format.pending_message`: the one line users see.

The fleets are real: each message is what `match` decides for those workers.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import (
    FreeCapacity,
    MatchResult,
    Reason,
    Verdict,
    match,
    pending_message,
)
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.testing.builders import worker_with


def job(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


A100_80GB = job(gpu_type="nvidia-a100", gpu_memory_gb=80)
A100_40 = worker_with(gpus=1, gpu_type="nvidia-a100", memory_gb=40)
A100_80 = worker_with(gpus=1, gpu_type="nvidia-a100", memory_gb=80)
T4 = worker_with(gpus=1, gpu_type="nvidia-t4")

Fleet = list[tuple[Capabilities, FreeCapacity | None]]

MESSAGES: dict[str, tuple[MLRequirements, Fleet, str]] = {
    "two small a100s and a t4 give 0/3 with every reason counted per worker": (
        A100_80GB,
        [(A100_40, None), (A100_40, None), (T4, None)],
        "0/3 workers eligible: 2 gpu_memory_gb 40 < 80, "
        "1 gpu_memory_gb 16 < 80, 1 gpu_type nvidia-t4 not in [nvidia-a100]",
    ),
    "a fleet that all fits gives just the count": (
        A100_80GB,
        [(A100_80, None), (A100_80, None)],
        "2/2 workers eligible",
    ),
    "a worker that only has to wait counts as eligible and still says why": (
        job(gpu_count=1),
        [(A100_80, FreeCapacity(gpus=0)), (worker_with(), None)],
        "1/2 workers eligible: 1 accelerator cpu != gpu, 1 gpu_count free 0 < 1",
    ),
    "reasons seen as often are listed in alphabetical order": (
        job(cpu_cores=64, memory_gb=512),
        [(worker_with(), None)],
        "0/1 workers eligible: 1 cpu_cores 32 < 64, 1 memory_gb 256 < 512",
    ),
}


@pytest.mark.parametrize(("req", "fleet", "text"), list(MESSAGES.values()), ids=list(MESSAGES))
def test_pending_message(req: MLRequirements, fleet: Fleet, text: str) -> None:
    assert pending_message(match(req, w, free) for w, free in fleet) == text


def test_an_empty_fleet_says_there_are_no_live_workers() -> None:
    assert pending_message([]) == "0/0 workers eligible: no live workers"


def test_the_noun_names_what_is_counted() -> None:
    results = [match(job(gpu_count=1), worker_with())]
    assert pending_message(results, noun="nodes") == "0/1 nodes eligible: 1 accelerator cpu != gpu"


def never(message: str) -> Reason:
    """A NEVER reason with a fixed message (no `{}` fields), so the test controls the text."""
    return Reason("label:k", "v", None, None, Verdict.NEVER, message)


def test_more_reasons_than_the_limit_end_with_how_many_more() -> None:
    results = [MatchResult(Verdict.NEVER, (never(f"reason {i}"),)) for i in range(5)]
    assert pending_message(results, limit=3) == (
        "0/5 workers eligible: 1 reason 0, 1 reason 1, 1 reason 2, and 2 more"
    )


def test_a_worker_counts_once_for_a_message_it_repeats() -> None:
    twice = MatchResult(Verdict.NEVER, (never("same"), never("same")))
    assert pending_message([twice]) == "0/1 workers eligible: 1 same"
