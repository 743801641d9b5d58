"""`EventCounters`: what each `ojs-*` event counts, with bounded labels."""

from __future__ import annotations

from typing import Any

from celery_ojs_ml.exporter import EventCounters
from celery_ojs_ml.exporter.counters import MAX_SERIES, OTHER

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(counters: EventCounters) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in counters.families()
        for s in family.samples
    }


def fed(*events: dict[str, Any]) -> Samples:
    counters = EventCounters()
    for event in events:
        counters.handle(event)
    return samples(counters)


def test_a_start_is_observed_in_the_wait_histogram_of_its_band() -> None:
    found = fed(
        {"type": "ojs-started", "uuid": "a", "band": "spot", "queue": "q", "wait_s": 3.0},
        {"type": "ojs-started", "uuid": "b", "band": "spot", "queue": "q", "wait_s": 100.0},
    )
    bucket = "ojs_ml_job_wait_seconds_bucket"
    assert found[(bucket, (("band", "spot"), ("le", "1.0")))] == 0
    assert found[(bucket, (("band", "spot"), ("le", "5.0")))] == 1
    assert found[(bucket, (("band", "spot"), ("le", "300.0")))] == 2
    assert found[(bucket, (("band", "spot"), ("le", "+Inf")))] == 2
    assert found[("ojs_ml_job_wait_seconds_count", (("band", "spot"),))] == 2
    assert found[("ojs_ml_job_wait_seconds_sum", (("band", "spot"),))] == 103.0


def test_a_start_without_a_known_wait_or_with_a_malformed_one_is_not_observed() -> None:
    found = fed(
        *(
            {"type": "ojs-started", "uuid": "a", "band": "spot", "wait_s": bad}
            for bad in (None, "3", True, -1.0, float("nan"), float("inf"))
        )
    )
    assert not [k for k in found if k[0].startswith("ojs_ml_job_wait_seconds")]


def test_preemptions_crashes_escalations_and_progress_are_counted_by_their_labels() -> None:
    found = fed(
        {"type": "ojs-preempted", "uuid": "a", "band": "spot", "how": "yielded"},
        {"type": "ojs-preempted", "uuid": "b", "band": "spot"},
        {"type": "ojs-crashed", "uuid": "c", "queue": "train", "crashes": 1, "dead": False},
        {"type": "ojs-escalated", "uuid": "d", "band_from": "spot", "band_to": "on-demand"},
        {"type": "ojs-progress", "uuid": "e", "queue": "train", "step": 1, "total": 5},
        {"type": "task-started", "uuid": "f"},
    )
    assert found == {
        ("ojs_ml_preemptions_total", (("band", "spot"),)): 2,
        ("ojs_ml_job_crashes_total", (("queue", "train"),)): 1,
        ("ojs_ml_escalations_total", (("band_from", "spot"), ("band_to", "on-demand"))): 1,
        ("ojs_ml_progress_events_total", (("queue", "train"),)): 1,
    }


def test_a_checkpoint_save_counts_its_bytes_and_duration() -> None:
    found = fed(
        {"type": "ojs-checkpoint-saved", "uuid": "a", "queue": "train", "size_bytes": 2048,
         "duration_s": 0.7},
        {"type": "ojs-checkpoint-saved", "uuid": "a", "queue": "train", "size_bytes": None},
    )  # fmt: skip
    assert found[("ojs_ml_checkpoint_saves_total", (("queue", "train"),))] == 2
    assert found[("ojs_ml_checkpoint_bytes_total", (("queue", "train"),))] == 2048
    assert found[("ojs_ml_checkpoint_save_seconds_bucket", (("le", "1.0"),))] == 1
    assert found[("ojs_ml_checkpoint_save_seconds_count", ())] == 1


def test_an_event_without_a_queue_takes_the_queue_its_job_started_in() -> None:
    found = fed(
        {"type": "ojs-started", "uuid": "job-1", "band": "spot", "queue": "train", "wait_s": 1},
        {"type": "ojs-progress", "uuid": "job-1", "step": 1},
        {"type": "ojs-checkpoint-saved", "uuid": "job-1", "size_bytes": 10},
        {"type": "ojs-progress", "uuid": "never-seen", "step": 1},
    )
    assert found[("ojs_ml_progress_events_total", (("queue", "train"),))] == 1
    assert found[("ojs_ml_progress_events_total", (("queue", ""),))] == 1
    assert found[("ojs_ml_checkpoint_saves_total", (("queue", "train"),))] == 1
    values = {v for _, labels in found for _, v in labels}
    assert values.isdisjoint({"job-1", "never-seen"}), "a task id is never a label"


def test_a_family_keeps_at_most_max_series_label_sets_and_counts_the_rest_as_other() -> None:
    found = fed(*({"type": "ojs-crashed", "queue": f"q{i}"} for i in range(MAX_SERIES + 5)))
    crashes = {k: v for k, v in found.items() if k[0] == "ojs_ml_job_crashes_total"}
    assert len(crashes) == MAX_SERIES + 1
    assert crashes[("ojs_ml_job_crashes_total", (("queue", OTHER),))] == 5
