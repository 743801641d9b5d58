"""Simulated fleets and the `--ojs-ml-capabilities` option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from celery_ojs_ml.capabilities import PROFILES, parse_capabilities, resolve_capabilities
from celery_ojs_ml.capabilities.profiles import profile
from celery_ojs_ml.errors import ConfigError, SpecError

UNKNOWN_PROFILE = (
    'unknown capability profile "nvidia-a100x"; use one of cpu, nvidia-a100x2, nvidia-a100x8, '
    "nvidia-h100x8, nvidia-l4x1, nvidia-t4x1, tpu-v5e-2x4, <gpu-id>x<N> such as nvidia-h200x4 "
    "(gpu ids: nvidia-a100, nvidia-h100, nvidia-h200, nvidia-l4, nvidia-l40s, nvidia-t4, "
    "nvidia-v100, nvidia-a10g, nvidia-b200, amd-mi250, amd-mi300x) or tpu-<type>-<topology> "
    "such as tpu-v5p-4x4 (types: v4, v5e, v5p, v6e)"
)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_named_profile_is_a_valid_section_11_worker(name: str) -> None:
    worker = parse_capabilities(profile(name))
    assert worker.labels["profile"] == name


def test_the_a100x8_profile_is_the_section_11_example_machine() -> None:
    worker = resolve_capabilities("profile:nvidia-a100x8")
    assert worker.gpu is not None
    assert worker.gpu.model_dump(exclude_none=True) == {
        "type": "nvidia-a100",
        "count": 8,
        "memory_gb": 80,
        "compute_capability": "8.0",
        "interconnect": "nvlink",
    }
    assert (worker.cpu_cores, worker.memory_gb) == (96, 1024)


@pytest.mark.parametrize(
    ("name", "accelerator", "gpus", "interconnect"),
    [
        ("nvidia-l4x1", "gpu", 1, None),
        ("nvidia-t4x1", "gpu", 1, None),
        ("nvidia-h100x8", "gpu", 8, "nvlink"),
        ("nvidia-a100x2", "gpu", 2, "nvlink"),
        ("cpu", "cpu", 0, None),
        ("tpu-v5e-2x4", "tpu", 0, None),
    ],
)
def test_each_named_profile_has_the_hardware_its_name_says(
    name: str, accelerator: str, gpus: int, interconnect: str | None
) -> None:
    worker = resolve_capabilities(f"profile:{name}")
    assert (worker.accelerator, worker.gpu_count) == (accelerator, gpus)
    assert (worker.gpu.interconnect if worker.gpu else None) == interconnect


def test_any_catalogue_gpu_makes_a_generic_profile() -> None:
    worker = resolve_capabilities("profile:nvidia-h200x4")
    assert worker.gpu is not None
    assert (worker.gpu.type, worker.gpu.count, worker.gpu.memory_gb) == ("nvidia-h200", 4, 141)
    assert worker.gpu.interconnect == "nvlink"
    assert (
        resolve_capabilities("profile:nvidia-l40sx4").derived_labels()["gpu_interconnect"] == "pcie"
    )


def test_a_generic_profile_of_a_multi_size_gpu_has_the_largest_variant() -> None:
    assert resolve_capabilities("profile:nvidia-v100x4").derived_labels()["gpu_memory_gb"] == "32"


def test_any_catalogue_tpu_makes_a_generic_profile() -> None:
    worker = resolve_capabilities("profile:tpu-v5p-4x4x4")
    assert worker.tpu is not None
    assert (worker.accelerator, worker.tpu.chip_count) == ("tpu", 64)


def test_profiles_are_fresh_copies() -> None:
    profile("nvidia-a100x8")["gpu"]["count"] = 1
    assert PROFILES["nvidia-a100x8"]["gpu"]["count"] == 8


@pytest.mark.parametrize("name", ["nvidia-a100x", "nvidia-a100x0", "rtx-4090x1", "tpu-v9-2x2"])
def test_an_unknown_profile_is_a_config_error_listing_the_valid_ones(name: str) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_capabilities(f"profile:{name}")
    assert str(caught.value) == UNKNOWN_PROFILE.replace('"nvidia-a100x"', f'"{name}"')


def test_no_option_falls_back_to_the_environment_variable() -> None:
    worker = resolve_capabilities(None, env={"OJS_ML_CAPABILITIES": "profile:nvidia-t4x1"})
    assert worker.gpu is not None and worker.gpu.type == "nvidia-t4"


def test_no_option_and_no_environment_variable_probe_this_machine() -> None:
    worker = resolve_capabilities(None, env={})
    assert worker.cpu_cores is not None and worker.cpu_cores >= 1
    assert resolve_capabilities("auto").accelerator == worker.accelerator


def test_a_json_object_is_read_as_a_capability_document() -> None:
    worker = resolve_capabilities(
        '{"gpu": {"type": "nvidia-a100", "count": 8}, "cpu": {"cores": 64}}'
    )
    assert (worker.gpu_count, worker.cpu_cores) == (8, 64)


def test_a_json_list_is_read_as_v0_1_labels() -> None:
    worker = resolve_capabilities('["gpu:nvidia-l4", "gpu_count:2", "region:eu-west-1"]')
    assert (worker.gpu_count, worker.labels) == (2, {"region": "eu-west-1"})


def test_malformed_json_is_a_config_error_showing_a_correct_option() -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_capabilities("{gpu: 8}")
    assert str(caught.value) == (
        "--ojs-ml-capabilities is not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 2 (char 1)); pass auto, a JSON object, profile:NAME, or the path "
        "of a JSON or YAML file, e.g. "
        """--ojs-ml-capabilities='{"gpu": {"type": "nvidia-a100", "count": 8}}'"""
    )


def test_a_json_document_breaking_the_spec_keeps_its_spec_error() -> None:
    with pytest.raises(SpecError) as caught:
        resolve_capabilities('{"gpu": {"type": "nvidia-a100", "count": -1}}')
    assert caught.value.paths == ["capabilities.gpu.count"]


def test_a_json_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "caps.json"
    path.write_text(json.dumps({"worker_id": "w1", "capabilities": {"cpu_cores": 4}}))
    worker = resolve_capabilities(str(path))
    assert (worker.worker_id, worker.cpu_cores, worker.accelerator) == ("w1", 4, "cpu")


def test_a_yaml_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text("gpu:\n  type: nvidia-l4\n  count: 1\nlabels:\n  region: eu-west-1\n")
    worker = resolve_capabilities(str(path))
    assert worker.derived_labels()["gpu_memory_gb"] == "24"


def test_a_missing_file_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        resolve_capabilities(str(path))
    assert str(caught.value) == (
        f"capabilities file {path} does not exist; pass auto, a JSON object, profile:NAME, or the "
        "path of a JSON or YAML file, e.g. --ojs-ml-capabilities=/etc/ojs-ml/capabilities.yaml"
    )


def test_a_malformed_yaml_file_is_a_config_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "caps.yaml"
    path.write_text("gpu: [unclosed\n")
    with pytest.raises(ConfigError) as caught:
        resolve_capabilities(str(path))
    assert str(caught.value).startswith(f"capabilities file {path} is not valid JSON or YAML (")
