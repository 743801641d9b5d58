"""OJS ML Extensions §7 scheduling hints as soft-score terms (`matching.hints`).

`ext_mlx_scheduling_spot_preference` and `ext_mlx_scheduling_data_locality` (§7.2)
are advisory: they move the 0-100 soft score, never the verdict. Scores are exact.
"""

from __future__ import annotations

import pytest

from celery_ojs_ml.matching import NO_HINTS, Hints, Verdict, match, score
from celery_ojs_ml.matching.hints import hint_terms, is_spot, near_data
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.testing.builders import worker_with

SPOT = worker_with(labels={"spot": "true"})
ON_DEMAND = worker_with(labels={"region": "us-east-1"})
NEAR = worker_with(labels={"data_locality": "s3://ml-data-us-east-1/,hdfs://rack-7/"})
PLAIN = normalize({"ext_ml_cpu_cores": 1}).requirements
LLAMA = normalize({"ext_ml_model_id": "llama-3.1-8b"}).requirements


def hints(**attrs: str) -> Hints:
    return Hints.of({f"ext_mlx_scheduling_{k}": v for k, v in attrs.items()})


def test_a_spot_preferring_job_scores_a_spot_worker_100_and_an_on_demand_one_0() -> None:
    """Extensions §7 `spot_preferred`."""
    wants = hints(spot_preference="spot_preferred")
    assert (score(PLAIN, SPOT, hints=wants), score(PLAIN, ON_DEMAND, hints=wants)) == (100, 0)


def test_an_on_demand_only_job_scores_a_spot_worker_0_and_never_refuses_it() -> None:
    """Extensions §7: hints are advisory, backends MUST NOT require them."""
    wants = hints(spot_preference="on_demand_only")
    assert (score(PLAIN, SPOT, hints=wants), score(PLAIN, ON_DEMAND, hints=wants)) == (0, 100)
    assert match(PLAIN, SPOT).verdict is Verdict.FITS


def test_any_spot_preference_and_no_hint_change_no_score() -> None:
    assert not hints(spot_preference="any")
    assert score(LLAMA, SPOT, hints=hints(spot_preference="any")) == score(LLAMA, SPOT) == 0


def test_data_locality_weighs_50_beside_model_locality() -> None:
    """Extensions §7.2 on a worker close to the data, without the job's model (§11.3)."""
    wants = hints(data_locality="s3://ml-data-us-east-1/train/")
    assert score(LLAMA, NEAR, hints=wants) == 50.0
    assert score(LLAMA, ON_DEMAND, hints=wants) == 0.0


@pytest.mark.parametrize(
    ("uri", "near"),
    [
        ("s3://ml-data-us-east-1/train/part-0.parquet", True),
        ("S3://ml-data-us-east-1/train/", True),
        ("hdfs://rack-7", True),
        ("s3://ml-data-us-east-1-copy/train/", False),
        ("gs://ml-data-us-east-1/train/", False),
    ],
)
def test_a_data_locality_prefix_holds_uris_under_it_at_a_path_boundary(
    uri: str, near: bool
) -> None:
    assert near_data(uri, NEAR.derived_labels()) is near


def test_only_a_true_spot_label_makes_a_spot_worker() -> None:
    assert [is_spot({"spot": v}) for v in ("true", "True", "1", "false", "")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert is_spot({}) is False


def test_hints_the_validator_would_refuse_are_ignored_not_raised() -> None:
    assert hints(spot_preference="spot") == NO_HINTS
    assert Hints.of({"ext_mlx_scheduling_data_locality": 7}) == NO_HINTS
    assert hint_terms(NO_HINTS, SPOT.derived_labels()) == []
