"""A job's own labels (OJS ML §7.3): job_type, queue and the declared `ml_labels`."""

from __future__ import annotations

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.wire.labels import declared_labels, job_labels


def test_a_job_is_labelled_with_its_task_name_its_queue_and_its_declared_labels() -> None:
    headers = {"ojs_logical_queue": "serve", "ojs_labels": {"app": "llm", "tier": "gold"}}
    assert job_labels("ml.infer", headers) == {
        "job_type": "ml.infer",
        "queue": "serve",
        "app": "llm",
        "tier": "gold",
    }


@pytest.mark.parametrize("bad", [["app"], {"app": 1}, {1: "x"}, {"": "x"}, "app=llm"])
def test_declared_labels_that_are_not_string_pairs_raise_a_spec_error_naming_the_option(
    bad: object,
) -> None:
    with pytest.raises(SpecError) as err:
        declared_labels(bad)
    assert err.value.violations[0].path == "ml_labels"
    assert "ml_labels=" in err.value.violations[0].fix


def test_a_forged_labels_header_is_ignored_by_the_worker_side_not_fatal() -> None:
    assert job_labels("t", {"ojs_labels": "garbage"}) == {"job_type": "t"}
