"""Workflows: chain, group and batch; steps are independent jobs (OJS ML §12.3)."""

from __future__ import annotations

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.workflow import parse_workflow


def test_a_step_without_ml_attributes_inherits_nothing_from_its_neighbours_section_12_3() -> None:
    """§12.3: a step that does not specify ext_ml_* MUST NOT inherit other steps' resources."""
    wf = parse_workflow(
        {
            "workflow_type": "chain",
            "steps": [
                {"type": "prep"},
                {"type": "train", "ext_ml_gpu_type": "nvidia-h100", "ext_ml_gpu_count": 8},
                {"type": "deploy"},
            ],
        }
    )
    assert [s.canonical() for s in wf.steps] == [
        {},
        {"ext_ml_accelerator": "gpu", "ext_ml_gpu_type": "nvidia-h100", "ext_ml_gpu_count": 8},
        {},
    ]


def test_workflow_metadata_propagates_to_every_step_section_14_5() -> None:
    wf = parse_workflow(
        {
            "workflow_type": "group",
            "id": "wf-1",
            "name": "sweep",
            "meta": {"experiment_id": "exp-7"},
            "jobs": [{"type": "a"}, {"type": "b", "meta": {"experiment_id": "own"}}],
        }
    )
    assert wf.steps[0].meta == {
        "experiment_id": "exp-7",
        "workflow": {"id": "wf-1", "name": "sweep"},
    }
    assert wf.steps[1].meta["experiment_id"] == "own"


def test_each_step_is_validated_on_its_own_and_errors_name_the_step() -> None:
    with pytest.raises(SpecError) as info:
        parse_workflow(
            {
                "workflow_type": "chain",
                "steps": [
                    {"type": "ok"},
                    {"type": "bad", "ext_ml_gpu_count": 0, "ext_ml_gpu_type": "nvidia-t4"},
                    {"ext_ml_cpu_cores": 0},
                ],
            }
        )
    assert info.value.paths == [
        "steps[1].ext_ml_gpu_count",
        "steps[2].type",
        "steps[2].ext_ml_cpu_cores",
    ]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"workflow_type": "dag", "steps": []},
            "workflow_type is 'dag'; must be chain, group or batch",
        ),
        ({"workflow_type": "chain", "jobs": [{"type": "a"}]}, "steps must be a non-empty array"),
        ({"workflow_type": "group", "jobs": []}, "jobs must be a non-empty array"),
    ],
    ids=["an unknown workflow type", "a chain needs steps", "a group needs jobs"],
)
def test_malformed_workflows_are_rejected(doc: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_workflow(doc)


def test_a_batch_carries_its_jobs_and_callbacks() -> None:
    wf = parse_workflow(
        {
            "workflow_type": "batch",
            "jobs": [{"type": "a"}, {"type": "b"}],
            "callbacks": {"on_complete": {"type": "notify"}},
        }
    )
    assert [s.type for s in wf.steps] == ["a", "b"]
    assert {name: job.type for name, job in wf.callbacks.items()} == {"on_complete": "notify"}
