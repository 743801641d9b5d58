"""The demo's jobs: the examples as submitted, who may run each, and the GPU substitutions."""

from __future__ import annotations

import json

import pytest

from celery_ojs_ml.demo.jobs import EXAMPLES, FILES, DemoJob, Submission, load, short_label
from tests.demo.oracle import EXPECTED


@pytest.fixture(scope="module")
def submissions() -> list[Submission]:
    return load("run1")


def _jobs(submissions: list[Submission]) -> dict[str, DemoJob]:
    return {j.label: j for s in submissions for j in s.jobs}


def test_the_oracle_agrees_with_matching_on_every_job(submissions: list[Submission]) -> None:
    found = {label: job.eligible for label, job in _jobs(submissions).items()}
    assert found == {label: nodes for label, (nodes, _) in EXPECTED.items()}


def test_the_demo_submits_the_spec_examples_and_the_impossible_job() -> None:
    assert [f for f in FILES if f.startswith("v03-13.")] == [
        f"v03-13.{i}-{n}.json"
        for i, n in enumerate(
            [
                "llm-inference-job",
                "large-scale-training-job",
                "tpu-training-job",
                "cost-optimized-hyperparameter-sweep",
                "cpu-only-inference-job",
            ],
            start=1,
        )
    ]
    assert {"v03-12.1-training-pipeline-example.json", "zz-impossible-16x-b200.json"} <= set(FILES)


def test_a_workflow_step_asking_for_a_gpu_the_fleet_lacks_gets_the_nearest_one(
    submissions: list[Submission],
) -> None:
    jobs = _jobs(submissions)
    assert jobs["§12.1 chain 2/4"].note == "nvidia-h100 -> nvidia-a100"
    assert jobs["§12.2 group 3/3"].note == "nvidia-t4 -> nvidia-l4"
    chain = next(s for s in submissions if s.source.startswith("v03-12.1"))
    assert chain.doc["steps"][1]["ext_ml_gpu_type"] == "nvidia-a100"
    assert chain.doc["steps"][1]["ext_ml_gpu_interconnect"] == "nvlink"  # the rest as published


def test_a_job_that_fits_nowhere_even_with_a_substitute_is_submitted_as_published(
    submissions: list[Submission],
) -> None:
    sub = next(s for s in submissions if s.source.startswith("v03-13.2"))
    original = json.loads((EXAMPLES / "jobs" / f"{sub.source}.json").read_text())
    assert sub.doc == {**original, "id": f"{original['id']}-run1"}
    assert sub.jobs[0].note == ""
    assert not sub.jobs[0].runnable


def test_task_ids_are_unique_per_run_and_chain_steps_name_their_predecessor() -> None:
    first, second = _jobs(load("aaa")), _jobs(load("bbb"))
    assert {j.task_id for j in first.values()}.isdisjoint(j.task_id for j in second.values())
    assert len({j.task_id for j in first.values()}) == len(first)
    chain = [first[f"§12.1 chain {i}/4"] for i in range(1, 5)]
    assert [c.after for c in chain] == [None, *(c.task_id for c in chain[:-1])]
    assert all(first[f"§12.2 group {i}/3"].after is None for i in range(1, 4))


def test_only_a_job_without_hard_constraints_is_left_to_plain_celery_routing(
    submissions: list[Submission],
) -> None:
    plain = [label for label, job in _jobs(submissions).items() if not job.routed]
    assert plain == ["§12.1 chain 4/4"]  # ml.deploy asks only for a CPU


LABELS = {
    "a v0.3 example is named by its section": (
        "v03-13.1-llm-inference-job",
        "§13.1 llm-inference-job",
    ),
    "another file keeps its name": ("zz-impossible-16x-b200", "zz-impossible-16x-b200"),
}


@pytest.mark.parametrize("stem,label", list(LABELS.values()), ids=list(LABELS))
def test_short_label(stem: str, label: str) -> None:
    assert short_label(stem) == label
