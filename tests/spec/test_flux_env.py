"""A jobspec's `attributes.system.cwd` and `environment` (Flux RFC 25 §Attributes): what
the publish path accepts, and the names the plugin keeps for itself."""

from __future__ import annotations

from typing import Any

import pytest

from celery_ojs_ml.child import gang_env, pinning, sharing, tpu_env
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec import flux_env
from celery_ojs_ml.spec.flux import parse_jobspec

SLOT = {"type": "slot", "count": 1, "label": "default", "with": [{"type": "core", "count": 1}]}
TASK = {"command": ["app"], "slot": "default", "count": {"per_slot": 1}}


def doc(**system: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "resources": [SLOT],
        "tasks": [TASK],
        "attributes": {"system": {"duration": 60, **system}},
    }


def test_a_jobspec_carries_its_cwd_and_environment_as_text_flux_rfc25_attributes() -> None:
    job = parse_jobspec(doc(cwd="/scratch/a", environment={"OMP_NUM_THREADS": 4, "X": "y"}))
    assert job.cwd == "/scratch/a"
    assert job.environment == {"OMP_NUM_THREADS": "4", "X": "y"}


def test_a_jobspec_without_them_has_no_cwd_and_an_empty_environment() -> None:
    job = parse_jobspec(doc())
    assert (job.cwd, job.environment) == (None, {})


@pytest.mark.parametrize(
    "name", ["CUDA_VISIBLE_DEVICES", "RANK", "MASTER_PORT", "TPU_VISIBLE_CHIPS", "LD_PRELOAD"]
)
def test_a_variable_the_plugin_sets_is_refused_at_publish_naming_it_flux_rfc25_attributes(
    name: str,
) -> None:
    with pytest.raises(SpecError) as found:
        parse_jobspec(doc(environment={"FOO": "1", name: "0"}))
    assert found.value.paths == [f"attributes.system.environment.{name}"]
    assert f"remove {name}: the plugin sets it" in str(found.value)


def test_every_variable_the_pool_child_sets_for_a_run_is_reserved() -> None:
    """The child's own lists, so a new variable there cannot be overridden by a job."""
    own = [*gang_env.ENV_KEYS, *tpu_env.NAMES, pinning.CVD, pinning.ORDER, sharing.MPS_LIMIT]
    assert [n for n in own if not flux_env.is_reserved(n)] == []


@pytest.mark.parametrize(
    ("system", "path", "words"),
    [
        ({"cwd": "relative/dir"}, "attributes.system.cwd", "must be an absolute path"),
        ({"cwd": 7}, "attributes.system.cwd", "must be an absolute path"),
        ({"cwd": "/" + "a" * 5000}, "attributes.system.cwd", "over 4096"),
        ({"environment": ["FOO=1"]}, "attributes.system.environment", "must be a mapping"),
        ({"environment": {"1BAD": "x"}}, "attributes.system.environment", "not a variable name"),
        ({"environment": {"FLAG": True}}, "attributes.system.environment.FLAG", "a string or"),
        ({"environment": {"V": "x" * 5000}}, "attributes.system.environment.V", "over 4096"),
        (
            {"environment": {f"V{i}": "x" for i in range(129)}},
            "attributes.system.environment",
            "129 variables, over 128",
        ),
        (
            {"environment": {f"V{i}": "x" * 4000 for i in range(9)}},
            "attributes.system.environment",
            "over 32768",
        ),
    ],
    ids=[
        "a relative cwd",
        "a cwd that is not a string",
        "a cwd over PATH_MAX",
        "an environment that is a list",
        "a name that is not a variable name",
        "a boolean value",
        "a value over 4096 characters",
        "more than 128 variables",
        "more than 32 KiB in all",
    ],
)
def test_a_malformed_cwd_or_environment_is_refused_with_a_teaching_message_flux_rfc25(
    system: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(SpecError) as found:
        parse_jobspec(doc(**system))
    assert found.value.paths == [path]
    assert words in str(found.value)
    assert "Flux RFC 25 §Attributes" in str(found.value)


def test_a_forged_header_is_described_with_the_same_words_at_the_worker() -> None:
    assert flux_env.run_env_problem("/ok", {"A": "1"}) is None
    problem = flux_env.run_env_problem(None, {"CUDA_VISIBLE_DEVICES": "3"})
    assert problem is not None
    assert problem.startswith("attributes.system.environment.CUDA_VISIBLE_DEVICES is set by")
