"""A batch's callbacks (OJS Workflow Primitives §6.2, §6.3): validated as jobs, required on a
batch, refused elsewhere; and the chord a batch with callbacks becomes."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.canvas import chord

from celery_ojs_ml import OJSML
from celery_ojs_ml.errors import ConfigError, SpecError
from celery_ojs_ml.producer.workflows import DONE, FAILED
from celery_ojs_ml.spec.workflow import parse_workflow

JOBS = [{"type": "a"}, {"type": "b"}]


def test_each_callback_is_a_job_with_its_own_requirements_and_the_workflow_meta() -> None:
    """§6.3 and OJS ML §12.3: a callback inherits no step's resources."""
    wf = parse_workflow(
        {
            "workflow_type": "batch",
            "id": "wf-9",
            "jobs": [{"type": "a", "ext_ml_gpu_count": 2}],
            "callbacks": {"on_failure": {"type": "alert", "ext_ml_cpu_cores": 1}},
        }
    )
    alert = wf.callbacks["on_failure"]
    assert alert.canonical() == {"ext_ml_cpu_cores": 1}
    assert alert.meta["workflow"] == {"id": "wf-9"}


@pytest.mark.parametrize(
    ("doc", "paths", "words"),
    [
        (
            {"workflow_type": "batch", "jobs": JOBS, "callbacks": ["on_success"]},
            ["callbacks"],
            "must map on_complete, on_success, on_failure to jobs",
        ),
        (
            {"workflow_type": "chain", "steps": JOBS, "callbacks": {"on_success": {"type": "x"}}},
            ["callbacks"],
            "are a batch's, not a chain's",
        ),
        (
            {"workflow_type": "batch", "jobs": JOBS, "callbacks": {"on_done": {"type": "x"}}},
            ["callbacks.on_done"],
            "is not a callback",
        ),
        (
            {
                "workflow_type": "batch",
                "jobs": JOBS,
                "callbacks": {"on_success": {"type": "x", "ext_ml_cpu_cores": 0}},
            },
            ["callbacks.on_success.ext_ml_cpu_cores"],
            "ext_ml_cpu_cores",
        ),
    ],
    ids=[
        "callbacks that are a list",
        "a chain with callbacks",
        "an unknown callback name",
        "a callback breaking OJS ML",
    ],
)
def test_malformed_callbacks_are_refused_naming_them_ojs_workflows_6_2(
    doc: dict[str, Any], paths: list[str], words: str
) -> None:
    with pytest.raises(SpecError) as found:
        parse_workflow(doc)
    assert found.value.paths == paths
    assert words in str(found.value)


def test_a_batch_without_callbacks_is_a_group_ojs_workflows_6_2() -> None:
    """§6.2: "A batch without callbacks is semantically identical to a group"."""
    for doc in ({"workflow_type": "batch", "jobs": JOBS}, {"workflow_type": "batch",
                "jobs": JOBS, "callbacks": {}}):  # fmt: skip
        assert parse_workflow(doc).callbacks == {}


def _app(backend: str | None) -> Celery:
    app = Celery("t", broker="memory://", backend=backend, set_as_current=False)
    app.conf.ojs_ml_store_url = "redis://127.0.0.1:1/0"  # never contacted: nothing published
    OJSML(app)
    return app


def test_a_batch_with_callbacks_becomes_a_chord_whose_error_callback_is_the_failure_relay() -> None:
    app = _app("cache+memory://")
    doc = {
        "workflow_type": "batch",
        "jobs": JOBS,
        "callbacks": {
            "on_complete": {"type": "report", "args": [1]},
            "on_failure": {"type": "alert"},
        },
    }
    sig = app.ojs_ml.signature_for(doc)
    assert isinstance(sig, chord)
    body = sig.body
    assert body.task == DONE and set(body.kwargs["callbacks"]) == {"on_complete"}
    [errback] = body.options["link_error"]
    job_ids, failure = errback["args"]
    assert errback["task"] == FAILED
    assert job_ids == [t.id for t in sig.tasks]
    assert set(failure) == {"on_complete", "on_failure"}
    assert (
        failure["on_complete"]["options"]["task_id"]
        == body.kwargs["callbacks"]["on_complete"]["options"]["task_id"]
    )


def test_a_batch_with_callbacks_needs_a_result_backend() -> None:
    doc = {"workflow_type": "batch", "jobs": JOBS, "callbacks": {"on_success": {"type": "x"}}}
    with pytest.raises(ConfigError, match="needs a result backend"):
        _app(None).ojs_ml.signature_for(doc)
