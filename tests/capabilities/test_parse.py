"""Reading the three capability forms (OJS ML §11, v0.1 §2.3, v0.1 §6.1)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_ojs_ml.capabilities import (
    Capabilities,
    capabilities_to_dict,
    parse_capabilities,
)
from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.catalogue import GPU_MODELS
from celery_ojs_ml.testing.builders import worker_with

SECTION_11_EXAMPLE: dict[str, Any] = {
    "worker_id": "gpu-worker-01",
    "capabilities": {
        "accelerator": "gpu",
        "gpu": {
            "type": "nvidia-a100",
            "count": 8,
            "memory_gb": 80,
            "compute_capability": "8.0",
            "interconnect": "nvlink",
        },
        "cpu_cores": 96,
        "memory_gb": 1024,
        "storage_gb": 8000,
        "shm_size_gb": 256,
        "models_loaded": [
            {"model_id": "llama-3.1-70b", "model_version": "v2.1", "model_format": "safetensors"},
            {"model_id": "llama-3.1-8b", "model_version": "v2.1", "model_format": "safetensors"},
        ],
        "runtimes": ["vllm", "pytorch"],
        "labels": {
            "region": "us-east-1",
            "zone": "us-east-1a",
            "instance_type": "p4d.24xlarge",
            "cluster": "ml-training-prod",
        },
    },
}

V01_LABELS_EXAMPLE: dict[str, Any] = {
    "worker_id": "gpu-worker-01",
    "labels": [
        "gpu:nvidia-a100",
        "gpu_count:4",
        "gpu_memory_gb:80",
        "cpu_cores:32",
        "memory_gb:256",
        "region:us-east-1",
        "spot:true",
    ],
}

V01_FETCH_EXAMPLE: dict[str, Any] = {
    "queues": ["ml-training"],
    "count": 1,
    "worker_id": "gpu-worker-01",
    "capabilities": {
        "gpu": {"count": 4, "type": "nvidia-a100", "memory_gb": 80},
        "cpu": {"cores": 32},
        "memory_gb": 256,
    },
}


def _error(doc: Any) -> str:
    with pytest.raises(SpecError) as caught:
        parse_capabilities(doc)
    return str(caught.value)


def test_the_section_11_example_worker_parses_with_its_derived_labels() -> None:
    worker = parse_capabilities(SECTION_11_EXAMPLE)
    assert worker.worker_id == "gpu-worker-01"
    assert [m.model_id for m in worker.models_loaded] == ["llama-3.1-70b", "llama-3.1-8b"]
    assert worker.runtimes == ("vllm", "pytorch")
    assert worker.derived_labels() == {
        "region": "us-east-1",
        "zone": "us-east-1a",
        "instance_type": "p4d.24xlarge",
        "cluster": "ml-training-prod",
        "accelerator": "gpu",
        "gpu_type": "nvidia-a100",
        "gpu_count": "8",
        "gpu_memory_gb": "80",
        "compute_capability": "8.0",
        "gpu_interconnect": "nvlink",
        "cpu_cores": "96",
        "memory_gb": "1024",
        "storage_gb": "8000",
        "shm_size_gb": "256",
        "worker_id": "gpu-worker-01",
    }


def test_the_v0_1_label_example_worker_parses_with_its_derived_labels() -> None:
    worker = parse_capabilities(V01_LABELS_EXAMPLE)
    assert worker.derived_labels() == {
        "region": "us-east-1",
        "spot": "true",
        "accelerator": "gpu",
        "gpu_type": "nvidia-a100",
        "gpu_count": "4",
        "gpu_memory_gb": "80",
        "compute_capability": "8.0",
        "cpu_cores": "32",
        "memory_gb": "256",
        "worker_id": "gpu-worker-01",
    }


def test_the_v0_1_fetch_example_worker_parses_with_its_derived_labels() -> None:
    worker = parse_capabilities(V01_FETCH_EXAMPLE)
    assert worker.derived_labels() == {
        "accelerator": "gpu",
        "gpu_type": "nvidia-a100",
        "gpu_count": "4",
        "gpu_memory_gb": "80",
        "compute_capability": "8.0",
        "cpu_cores": "32",
        "memory_gb": "256",
        "worker_id": "gpu-worker-01",
    }


def test_a_worker_declaring_v0_1_labels_gets_the_same_capabilities_as_in_section_11_form() -> None:
    section_11 = {
        "worker_id": "gpu-worker-01",
        "capabilities": {
            "gpu": {"type": "nvidia-a100", "count": 4, "memory_gb": 80},
            "cpu_cores": 32,
            "memory_gb": 256,
            "labels": {"region": "us-east-1", "spot": "true"},
        },
    }
    assert parse_capabilities(V01_LABELS_EXAMPLE) == parse_capabilities(section_11)


def test_a_worker_sending_a_v0_1_fetch_object_gets_the_same_capabilities_as_in_section_11() -> None:
    section_11 = {
        "gpu": {"type": "nvidia-a100", "count": 4, "memory_gb": 80},
        "cpu_cores": 32,
        "memory_gb": 256,
    }
    assert parse_capabilities(V01_FETCH_EXAMPLE) == parse_capabilities(
        section_11, worker_id="gpu-worker-01"
    )


def test_a_bare_label_list_and_a_bare_inner_object_parse_too() -> None:
    assert parse_capabilities(V01_LABELS_EXAMPLE["labels"]).gpu_count == 4
    assert parse_capabilities(SECTION_11_EXAMPLE["capabilities"]).gpu_count == 8


def test_a_label_naming_a_gpu_without_a_count_means_one_gpu() -> None:
    assert parse_capabilities(["gpu:nvidia-t4"]).gpu_count == 1


def test_tpu_labels_map_onto_the_tpu_object() -> None:
    worker = parse_capabilities(["tpu:v5e", "tpu_topology:2x4"])
    assert (worker.accelerator, worker.tpu) == ("tpu", worker.tpu)
    assert worker.tpu is not None and worker.tpu.chip_count == 8


def test_the_worker_id_argument_is_used_only_when_the_document_names_no_worker() -> None:
    assert parse_capabilities({"cpu_cores": 4}, worker_id="celery@a").worker_id == "celery@a"
    assert parse_capabilities(SECTION_11_EXAMPLE, worker_id="celery@a").worker_id == "gpu-worker-01"
    assert parse_capabilities(worker_with(), worker_id="celery@a").worker_id == "celery@a"


def test_a_tpu_worker_advertises_its_slice_next_to_the_section_11_fields() -> None:
    worker = parse_capabilities({"tpu": {"type": "v5p", "topology": "4x4x4", "chip_count": 64}})
    assert worker.accelerator == "tpu"
    assert worker.derived_labels()["tpu_chip_count"] == "64"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"capabilities": {"gpu": {"type": "nvidia-a100", "count": -1}}},
            'capabilities.gpu.count is -1 (OJS ML §11); set a count >= 0, e.g. "count": 8',
        ),
        (
            {"gpu": {"type": "nvidia-a100"}},
            'capabilities.gpu.count is missing (OJS ML §11); set a count >= 0, e.g. "count": 8',
        ),
        (
            {"gpu": {"type": "nvidia-a100", "count": 2, "interconnect": "infiniband"}},
            'capabilities.gpu.interconnect is "infiniband" (OJS ML §11); set nvlink or pcie, '
            'e.g. "interconnect": "nvlink"',
        ),
        (
            {"gpu": {"type": "a100", "count": 2}},
            'capabilities.gpu.type is "a100" (OJS ML §11); set a {vendor}-{model} id, '
            'e.g. "type": "nvidia-a100"',
        ),
        (
            {"gpu": {"count": 2, "compute_capability": "eight"}},
            'capabilities.gpu.compute_capability is "eight" (OJS ML §11); '
            'set a "major.minor" version, e.g. "compute_capability": "8.0"',
        ),
        (
            {"tpu": {"type": "v5e", "topology": "2by4"}},
            'capabilities.tpu.topology is "2by4" (OJS ML §11); '
            'set AxB or AxBxC, e.g. "topology": "2x4"',
        ),
        (
            {"cpu_core": 32},
            'capabilities.cpu_core is not a known field (OJS ML §11); did you mean "cpu_cores"? '
            "use one of worker_id, accelerator, gpu, tpu, cpu_cores, memory_gb, storage_gb, "
            "shm_size_gb, models_loaded, model_registry_access, runtimes, model_formats, "
            "labels, gpu_devices",
        ),
        (
            {"models_loaded": [{"model_version": "v1"}]},
            "capabilities.models_loaded[0].model_id is missing (OJS ML §11); "
            'set a model id, e.g. "model_id": "llama-3.1-8b"',
        ),
        (
            {"labels": {"tags": ["a"]}},
            'capabilities.labels.tags is ["a"] (OJS ML §11); set string keys and values, '
            'e.g. "labels": {"region": "us-east-1"}',
        ),
        (
            {"worker_id": 7, "capabilities": {}},
            'worker_id is 7 (OJS ML §11); set a string id, e.g. "worker_id": "gpu-worker-01"',
        ),
        (
            "gpu:nvidia-a100",
            'capabilities is "gpu:nvidia-a100" (OJS ML §11); pass the §11 object, '
            'e.g. {"capabilities": {"gpu": {"type": "nvidia-a100", "count": 8}}}',
        ),
    ],
    ids=[
        "negative-count",
        "missing-count",
        "unknown-interconnect",
        "type-without-vendor",
        "bad-compute-capability",
        "bad-topology",
        "misspelt-field",
        "model-without-id",
        "non-string-label",
        "non-string-worker-id",
        "not-an-object",
    ],
)
def test_a_bad_section_11_document_is_rejected_with_a_teaching_message(
    doc: Any, message: str
) -> None:
    assert _error(doc) == message


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"accelerator": "gpu", "cpu_cores": 8},
            'capabilities.accelerator is "gpu" but gpu.count is 0 (OJS ML §3.1); '
            'declare the GPUs, e.g. "gpu": {"type": "nvidia-a100", "count": 8}',
        ),
        (
            {"accelerator": "tpu"},
            'capabilities.accelerator is "tpu" but no tpu is set (OJS ML §3.1); '
            'declare the TPU slice, e.g. "tpu": {"type": "v5e", "topology": "2x4"}',
        ),
        (
            {"accelerator": "cpu", "gpu": {"type": "nvidia-a100", "count": 2}},
            'capabilities.accelerator is "cpu" but gpu.count is 2 (OJS ML §3.1); '
            'leave accelerator out to infer it, or set it to match, e.g. "accelerator": "gpu"',
        ),
        (
            {"gpu": {"type": "nvidia-t4", "count": 1, "compute_capability": "8.0"}},
            'capabilities.gpu.compute_capability is "8.0" but nvidia-t4 has 7.5 (OJS ML §3.2); '
            'leave it out or set it, e.g. "compute_capability": "7.5"',
        ),
        (
            {"gpu": {"type": "nvidia-t4", "count": 1, "memory_gb": 80}},
            "capabilities.gpu.memory_gb is 80 but nvidia-t4 has at most 16 GB (OJS ML §3.2); "
            'declare the VRAM of one device, e.g. "memory_gb": 16',
        ),
    ],
    ids=[
        "gpu-without-gpus",
        "tpu-without-tpu",
        "cpu-with-gpus",
        "cc-off-catalogue",
        "vram-off-catalogue",
    ],
)
def test_a_document_that_contradicts_itself_or_the_catalogue_is_rejected(
    doc: Any, message: str
) -> None:
    assert _error(doc) == message


def test_label_errors_name_the_label_and_show_a_label_example() -> None:
    assert _error(["gpu:nvidia-t4", "gpu_count:-1", "spot", "gpu_type:nvidia-l4"]) == (
        'labels[2] is "spot" (OJS ML v0.1 §2.3); write each label as "key:value", '
        'e.g. "region:us-east-1"; '
        'labels[3] is "gpu_type:nvidia-l4" but labels[0] already set "gpu" (OJS ML v0.1 §2.3); '
        "give each key one value; "
        'labels[1] is "gpu_count:-1" (OJS ML v0.1 §2.3); set a count >= 0, e.g. "gpu_count:8"'
    )


def test_a_label_contradicting_the_catalogue_is_reported_at_that_label() -> None:
    assert _error(["gpu:nvidia-t4", "compute_capability:8.0"]) == (
        'labels[1] is "8.0" but nvidia-t4 has 7.5 (OJS ML §3.2); '
        'leave it out or set it, e.g. "compute_capability": "7.5"'
    )


def test_fetch_form_errors_name_the_cpu_cores_the_worker_wrote() -> None:
    assert _error({"cpu": {"cores": 0}}) == (
        'capabilities.cpu.cores is 0 (OJS ML v0.1 §6.1); set a count >= 1, e.g. "cores": 32'
    )
    assert _error({"cpu": {"cores": 4}, "cpu_cores": 4}) == (
        "capabilities.cpu and cpu_cores are both set (OJS ML v0.1 §6.1); "
        'give one of them, e.g. "cpu": {"cores": 32}'
    )


def test_every_problem_in_a_document_is_reported_at_once() -> None:
    with pytest.raises(SpecError) as caught:
        parse_capabilities(
            {"gpu": {"type": "nvidia-a100", "count": -1}, "cpu_cores": 0, "memory_gb": -5}
        )
    assert caught.value.paths == [
        "capabilities.gpu.count",
        "capabilities.cpu_cores",
        "capabilities.memory_gb",
    ]


def test_the_canonical_form_of_the_section_11_example_is_the_example() -> None:
    assert capabilities_to_dict(parse_capabilities(SECTION_11_EXAMPLE)) == SECTION_11_EXAMPLE


def test_the_canonical_form_shows_catalogue_values_and_registry_access() -> None:
    worker = worker_with(gpus=1, gpu_type="nvidia-t4", model_registry_access=True)
    assert capabilities_to_dict(worker) == {
        "capabilities": {
            "accelerator": "gpu",
            "gpu": {"type": "nvidia-t4", "count": 1, "memory_gb": 16, "compute_capability": "7.5"},
            "cpu_cores": 32,
            "memory_gb": 256,
            "model_registry_access": True,
        }
    }


_sizes = (
    st.none()
    | st.integers(0, 4096).map(float)
    | st.floats(0.1, 4096, allow_nan=False).map(lambda x: round(x, 1))
)
_workers = st.builds(
    worker_with,
    gpus=st.integers(0, 16),
    gpu_type=st.sampled_from([*GPU_MODELS, "nvidia-rtx-4090", None]),
    interconnect=st.sampled_from([None, "nvlink", "pcie"]),
    cpu_cores=st.integers(1, 512),
    ram_gb=st.floats(0, 8192, allow_nan=False),
    labels=st.dictionaries(st.sampled_from(["region", "zone", "spot"]), st.text(max_size=8)),
    models=st.lists(
        st.tuples(st.sampled_from(["bert", "llama"]), st.none() | st.just("v1")), max_size=2
    ),
    worker_id=st.none() | st.just("celery@w1"),
    storage_gb=_sizes,
    shm_size_gb=_sizes,
    runtimes=st.lists(st.sampled_from(["vllm", "pytorch"]), max_size=2).map(tuple),
    model_registry_access=st.booleans(),
)


@given(_workers)
def test_the_canonical_form_survives_json_and_parses_back_to_an_equal_worker(
    worker: Capabilities,
) -> None:
    doc = json.loads(json.dumps(capabilities_to_dict(worker)))
    assert parse_capabilities(doc) == worker
