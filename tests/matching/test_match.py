"""Tests for `celery_ojs_ml.matching.match`: verdicts, the 0-100 score and ranking.

Soft constraints (§7.2 preferred rules, §11.3 model locality) only move the
score; hard ones decide the verdict. Scores are asserted as exact numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.matching import FreeCapacity, MatchResult, Verdict, has_model, match, rank, score
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.testing.builders import worker_with


def job(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


def preferred(*rules: tuple[str, str, int | None]) -> dict[str, Any]:
    """`preferred` rules `(key, value, weight)`, each `key In [value]`."""
    out = []
    for key, value, weight in rules:
        r: dict[str, Any] = {"key": key, "operator": "In", "values": [value]}
        if weight is not None:
            r["weight"] = weight
        out.append(r)
    return {"preferred": out}


EAST = worker_with(labels={"region": "us-east-1"})
WEST_SPOT = worker_with(labels={"region": "us-west-2", "spot": "true"})
EAST_SPOT = worker_with(labels={"region": "us-east-1", "spot": "true"})
LLAMA = worker_with(models=[("llama-3.1-8b", "v1")])

SCORES: dict[str, tuple[MLRequirements, Capabilities, float]] = {
    "a job without soft constraints scores 100 everywhere": (job(gpu_count=0), EAST, 100.0),
    "a worker satisfying every preferred rule scores 100 (§7.2)": (
        job(affinity=preferred(("region", "us-east-1", 80), ("spot", "true", 20))),
        EAST_SPOT,
        100.0,
    ),
    "a worker satisfying no preferred rule scores 0 (§7.2)": (
        job(affinity=preferred(("region", "eu-west-1", 80))),
        EAST,
        0.0,
    ),
    "a worker satisfying the rule of weight 80 but not of 20 scores 80 (§7.2 weights)": (
        job(affinity=preferred(("region", "us-east-1", 80), ("spot", "true", 20))),
        EAST,
        80.0,
    ),
    "a worker satisfying the rule of weight 20 but not of 80 scores 20 (§7.2 weights)": (
        job(affinity=preferred(("region", "us-east-1", 80), ("spot", "true", 20))),
        WEST_SPOT,
        20.0,
    ),
    "a preferred rule without a weight counts as weight 1": (
        job(affinity=preferred(("region", "us-east-1", None), ("spot", "true", None))),
        EAST,
        50.0,
    ),
    "weights that do not sum to 100 are still normalised to 0-100": (
        job(affinity=preferred(("region", "us-east-1", 1), ("spot", "true", 2))),
        EAST,
        33.33,
    ),
    "preferred rules of weight 0 change nothing": (
        job(affinity=preferred(("region", "eu-west-1", 0))),
        EAST,
        100.0,
    ),
    "a worker holding the job's model scores 100 (§11.3 model locality)": (
        job(model_id="llama-3.1-8b"),
        LLAMA,
        100.0,
    ),
    "a worker without the job's model scores 0 (§11.3 model locality)": (
        job(model_id="llama-3.1-8b"),
        EAST,
        0.0,
    ),
    "a worker holding another version of the model gets no locality (§11.3)": (
        job(model_id="llama-3.1-8b", model_version="v2"),
        LLAMA,
        0.0,
    ),
    "locality weighs 50 against the preferred weights (§11.3, §7.2)": (
        job(model_id="llama-3.1-8b", affinity=preferred(("region", "us-east-1", 50))),
        EAST,
        50.0,
    ),
    "locality and a weight-100 rule together score 100 only when both hold": (
        job(model_id="llama-3.1-8b", affinity=preferred(("region", "us-east-1", 100))),
        LLAMA,
        33.33,
    ),
}


@pytest.mark.parametrize(("req", "worker", "expected"), list(SCORES.values()), ids=list(SCORES))
def test_score(req: MLRequirements, worker: Capabilities, expected: float) -> None:
    assert score(req, worker) == expected


def test_a_locality_weight_of_0_leaves_only_the_preferred_rules() -> None:
    req = job(model_id="llama-3.1-8b", affinity=preferred(("region", "us-east-1", 50)))
    assert score(req, EAST, locality_weight=0) == 100.0


@given(
    weights=st.lists(st.integers(min_value=0, max_value=100), max_size=6),
    held=st.lists(st.booleans(), min_size=6, max_size=6),
    model_loaded=st.booleans(),
)
def test_the_score_is_always_between_0_and_100(
    weights: list[int], held: list[bool], model_loaded: bool
) -> None:
    rules = [(f"k{i}", "yes", w) for i, w in enumerate(weights)]
    labels = {f"k{i}": "yes" for i in range(len(weights)) if held[i]}
    req = job(model_id="m", affinity=preferred(*rules))
    worker = worker_with(labels=labels, models=[("m", None)] if model_loaded else [])
    assert 0.0 <= score(req, worker) <= 100.0


VERDICTS: dict[str, tuple[MLRequirements, Capabilities, FreeCapacity | None, Verdict, float]] = {
    "a job that fits gets FITS and its score": (
        job(gpu_count=1, affinity=preferred(("region", "us-east-1", 10))),
        worker_with(gpus=1, labels={"region": "us-east-1"}),
        None,
        Verdict.FITS,
        100.0,
    ),
    "a job that must wait for free gpus keeps its score": (
        job(gpu_count=2, model_id="llama-3.1-8b"),
        worker_with(gpus=4, models=[("llama-3.1-8b", "v1")]),
        FreeCapacity(gpus=1),
        Verdict.WAIT,
        100.0,
    ),
    "a job that can never run scores 0": (
        job(gpu_count=8, model_id="llama-3.1-8b"),
        worker_with(gpus=4, models=[("llama-3.1-8b", "v1")]),
        None,
        Verdict.NEVER,
        0.0,
    ),
    "a job that can never run here scores 0 even while it would also wait": (
        job(gpu_count=2, cpu_cores=64),
        worker_with(gpus=4),
        FreeCapacity(gpus=1),
        Verdict.NEVER,
        0.0,
    ),
    "preferred rules that fail never block dispatch (§7.2 MUST NOT, §11.2)": (
        job(affinity=preferred(("region", "eu-west-1", 100))),
        EAST,
        None,
        Verdict.FITS,
        0.0,
    ),
    "a missing model never blocks dispatch when the worker can reach the registry (§11.2)": (
        job(model_id="llama-3.1-8b"),
        EAST,
        None,
        Verdict.FITS,
        0.0,
    ),
}


@pytest.mark.parametrize(
    ("req", "worker", "free", "verdict", "expected_score"),
    list(VERDICTS.values()),
    ids=list(VERDICTS),
)
def test_match_verdict_and_score(
    req: MLRequirements,
    worker: Capabilities,
    free: FreeCapacity | None,
    verdict: Verdict,
    expected_score: float,
) -> None:
    result = match(req, worker, free)
    assert (result.verdict, result.score) == (verdict, expected_score)


ELIGIBLE: dict[str, tuple[Verdict, bool]] = {
    "a worker that fits now is eligible": (Verdict.FITS, True),
    "a worker that fits once running work ends is eligible": (Verdict.WAIT, True),
    "a worker that can never run the job is not eligible": (Verdict.NEVER, False),
}


@pytest.mark.parametrize(("verdict", "eligible"), list(ELIGIBLE.values()), ids=list(ELIGIBLE))
def test_eligible(verdict: Verdict, eligible: bool) -> None:
    assert MatchResult(verdict).eligible is eligible


def test_a_match_result_as_json_has_eligible_verdict_reasons_and_score() -> None:
    result = match(job(gpu_count=8), worker_with(gpus=4))
    assert result.as_dict() == {
        "eligible": False,
        "verdict": "NEVER",
        "reasons": [
            {
                "resource": "gpu_count",
                "requested": 8,
                "available": 4,
                "capacity": 4,
                "verdict": "NEVER",
                "message": "gpu_count 4 < 8",
            }
        ],
        "score": 0.0,
    }


HAS_MODEL: dict[str, tuple[MLRequirements, bool]] = {
    "a loaded model of any version matches a job without a version": (
        job(model_id="llama-3.1-8b"),
        True,
    ),
    "a loaded model of the same version matches a pinned job": (
        job(model_id="llama-3.1-8b", model_version="v1"),
        True,
    ),
    "a loaded model of another version does not match a pinned job": (
        job(model_id="llama-3.1-8b", model_version="v2"),
        False,
    ),
    "another model does not match": (job(model_id="mistral-7b"), False),
}


@pytest.mark.parametrize(("req", "expected"), list(HAS_MODEL.values()), ids=list(HAS_MODEL))
def test_has_model(req: MLRequirements, expected: bool) -> None:
    assert has_model(LLAMA, req) is expected


def test_rank_puts_fits_before_wait_before_never_then_higher_scores_then_names() -> None:
    req = job(gpu_count=2, affinity=preferred(("region", "us-east-1", 100)))
    fleet = {
        "never": worker_with(gpus=1, labels={"region": "us-east-1"}),
        "wait-east": worker_with(gpus=4, labels={"region": "us-east-1"}),
        "fits-west": worker_with(gpus=2, labels={"region": "us-west-2"}),
        "fits-east-b": worker_with(gpus=2, labels={"region": "us-east-1"}),
        "fits-east-a": worker_with(gpus=8, labels={"region": "us-east-1"}),
    }
    ranked = rank(req, fleet, {"wait-east": FreeCapacity(gpus=0)})
    assert [(name, r.verdict.value, r.score) for name, r in ranked] == [
        ("fits-east-a", "FITS", 100.0),
        ("fits-east-b", "FITS", 100.0),
        ("fits-west", "FITS", 0.0),
        ("wait-east", "WAIT", 100.0),
        ("never", "NEVER", 0.0),
    ]


def test_model_locality_ranks_the_worker_holding_the_model_first_section_11_3() -> None:
    """§11.3: backends SHOULD prefer workers that have the model loaded."""
    req = job(model_id="llama-3.1-8b", gpu_count=1)
    fleet = {
        "a-cold": worker_with(gpus=1),
        "b-warm": worker_with(gpus=1, models=[("llama-3.1-8b", None)]),
    }
    assert [name for name, _ in rank(req, fleet)] == ["b-warm", "a-cold"]
