"""Placement by the OJS ML Extensions §7 hints: spot preference and data locality (§7.2).

Between workers where a job fits now, the hint decides; a hint never makes a job
wait (§7: backends MUST NOT require them), and a job without hints is placed
exactly as before (the weights: docs/scheduling.md, "Placement score").
"""

from __future__ import annotations

from dataclasses import replace

from celery_ojs_ml.matching import Hints
from celery_ojs_ml.scheduler import PendingJob, WorkerState
from celery_ojs_ml.scheduler.grants import job_grantable
from tests.scheduler.helpers import NOW, caps, decide, job


def labelled(name: str, profile: str = "nvidia-l4x1", **labels: str) -> WorkerState:
    """An idle worker of `profile` with own `labels`."""
    found = caps(profile, name)
    return WorkerState.of(name, found.model_copy(update={"labels": {**found.labels, **labels}}))


def hinted(task_id: str, **hints: str) -> PendingJob:
    """A one-GPU job with `ext_mlx_scheduling_<hint>` values."""
    found = Hints.of({f"ext_mlx_scheduling_{k}": v for k, v in hints.items()})
    return replace(job(task_id, gpu_count=1), hints=found)


def placed(pending: PendingJob, fleet: list[WorkerState]) -> str:
    [assignment] = decide([pending], fleet).assignments
    return assignment.worker


def test_a_job_preferring_spot_lands_on_the_spot_worker_when_both_fit() -> None:
    """Extensions §7 `spot_preferred`, whichever worker comes first in the fleet."""
    on_demand, spot = labelled("a"), labelled("b", spot="true")
    assert placed(hinted("j", spot_preference="spot_preferred"), [on_demand, spot]) == "b"
    assert placed(hinted("j", spot_preference="spot_preferred"), [spot, on_demand]) == "b"


def test_an_on_demand_only_job_lands_on_the_worker_not_labelled_spot() -> None:
    """Extensions §7 `on_demand_only`."""
    spot, on_demand = labelled("a", spot="true"), labelled("b")
    assert placed(hinted("j", spot_preference="on_demand_only"), [spot, on_demand]) == "b"


def test_data_locality_prefers_the_worker_labelled_with_the_datas_location() -> None:
    """Extensions §7.2: a worker whose `data_locality` prefix holds the URI wins."""
    far = labelled("a", data_locality="s3://eu-data/")
    near = labelled("b", data_locality="s3://us-data/,hdfs://rack-7/")
    found = hinted("j", data_locality="s3://us-data/imagenet/train/")
    assert placed(found, [far, near]) == "b"


def test_a_hint_outweighs_packing_onto_the_fuller_worker() -> None:
    """A spot 8-GPU worker wins over a fitting on-demand 1-GPU worker that packs better."""
    small, big = labelled("small"), labelled("big", "nvidia-a100x8", spot="true")
    assert placed(job("plain", gpu_count=1), [small, big]) == "small"
    assert placed(hinted("j", spot_preference="spot_preferred"), [small, big]) == "big"


def test_a_hint_no_worker_satisfies_never_keeps_the_job_waiting() -> None:
    """Extensions §7: hints are advisory; the job starts on the worker it fits."""
    assert placed(hinted("j", spot_preference="spot_preferred"), [labelled("a")]) == "a"
    assert placed(hinted("j", data_locality="gs://far/"), [labelled("a")]) == "a"


def test_a_job_with_no_hint_or_any_is_placed_as_without_hints() -> None:
    fleet = [labelled("a", spot="true"), labelled("b", "nvidia-a100x8"), labelled("c")]
    pending = [job(f"j{i}", at=NOW - 10 + i, gpu_count=1) for i in range(3)]
    anyway = [
        replace(j, hints=Hints.of({"ext_mlx_scheduling_spot_preference": "any"})) for j in pending
    ]
    assert decide(anyway, fleet) == decide(pending, fleet)


def test_a_job_with_a_hint_is_never_granted_to_a_worker_by_its_class() -> None:
    """A grant places by class alone (`scheduler.grants`), which the hints do not enter."""
    assert job_grantable(job("plain", gpu_count=1))
    assert not job_grantable(hinted("j", spot_preference="spot_preferred"))
    assert not job_grantable(hinted("j", data_locality="s3://us-data/"))
