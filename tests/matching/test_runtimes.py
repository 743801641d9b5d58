"""`ext_ml_runtime` (OJS ML Resources §6) and `ext_ml_model_format` (§4) as hard constraints.

§4: "A vLLM worker cannot load a GGUF model; a llama.cpp worker cannot load
safetensors. Declaring the format enables correct routing." A worker advertises its
§11 `runtimes`; the formats it loads come from `capabilities.runtimes.RUNTIME_FORMATS`,
its `models_loaded` and its own `model_formats`. Rows assert the exact reasons users see.
"""

from __future__ import annotations

from typing import Any, get_args

import pytest

from celery_ojs_ml.capabilities import Capabilities
from celery_ojs_ml.capabilities.runtimes import RUNTIME_FORMATS, formats_of, runtimes_of
from celery_ojs_ml.matching import Verdict, match, pending_message, rank
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import MLRequirements, ModelFormat, Runtime
from celery_ojs_ml.testing.builders import worker_with

FITS, NEVER = Verdict.FITS, Verdict.NEVER

VLLM = worker_with(gpus=1, gpu_type="nvidia-l4", runtimes=["vllm"])
LLAMA_CPP = worker_with(gpus=1, gpu_type="nvidia-l4", runtimes=["llama.cpp"])
TORCH_ALIAS = worker_with(gpus=1, gpu_type="nvidia-l4", runtimes=["Torch"])
NO_RUNTIMES = worker_with(gpus=1, gpu_type="nvidia-l4")
TRITON = worker_with(runtimes=["tritonserver"])
DECLARES_GGUF = worker_with(
    gpus=1, gpu_type="nvidia-l4", runtimes=["custom"], model_formats=["GGUF"]
)
HOLDS_GGUF = Capabilities.model_validate(
    {
        "gpu": {"type": "nvidia-l4", "count": 1},
        "models_loaded": [{"model_id": "llama-3.1-8b-q4", "model_format": "gguf"}],
    }
)


def job(**attrs: Any) -> MLRequirements:
    """Canonical requirements from attributes named without their `ext_ml_` prefix."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).requirements


Case = tuple[MLRequirements, Capabilities, Verdict, list[str]]

ROWS: dict[str, Case] = {
    "a vllm job fits a worker advertising vllm (§6, §11)": (
        job(runtime="vllm", gpu_count=1),
        VLLM,
        FITS,
        [],
    ),
    "a vllm job never fits a worker advertising only llama.cpp (§6 hard constraint)": (
        job(runtime="vllm", gpu_count=1),
        LLAMA_CPP,
        NEVER,
        ["runtime vllm not in [llama.cpp]"],
    ),
    "a job naming a runtime fits a worker that has not said which it runs (§11 optional)": (
        job(runtime="pytorch"),
        NO_RUNTIMES,
        FITS,
        [],
    ),
    "a worker's runtime alias counts under its §6 name, in any case": (
        job(runtime="pytorch"),
        TORCH_ALIAS,
        FITS,
        [],
    ),
    "a vllm worker never gets a gguf model (§4 rationale)": (
        job(model_format="gguf", gpu_count=1),
        VLLM,
        NEVER,
        ["model_format gguf not in [safetensors]"],
    ),
    "a llama.cpp worker gets a gguf model (§4)": (
        job(model_format="gguf", gpu_count=1),
        LLAMA_CPP,
        FITS,
        [],
    ),
    "a llama.cpp worker never gets a safetensors model (§4 rationale)": (
        job(model_format="safetensors", gpu_count=1),
        LLAMA_CPP,
        NEVER,
        ["model_format safetensors not in [gguf]"],
    ),
    "a triton worker loads onnx, torchscript and savedmodel models (§4)": (
        job(model_format="torchscript"),
        TRITON,
        FITS,
        [],
    ),
    "a worker declaring a format in model_formats gets it whatever its runtimes": (
        job(model_format="gguf", gpu_count=1),
        DECLARES_GGUF,
        FITS,
        [],
    ),
    "a worker holding a loaded model of the format gets that format (§11 models_loaded)": (
        job(model_format="gguf", gpu_count=1),
        HOLDS_GGUF,
        FITS,
        [],
    ),
    "runtime and format both failing give both reasons (§4, §6)": (
        job(runtime="vllm", model_format="onnx"),
        LLAMA_CPP,
        NEVER,
        ["runtime vllm not in [llama.cpp]", "model_format onnx not in [gguf]"],
    ),
    "a job naming neither fits a worker without runtimes": (
        job(gpu_count=1),
        NO_RUNTIMES,
        FITS,
        [],
    ),
}


@pytest.mark.parametrize(
    ("req", "worker", "verdict", "messages"), list(ROWS.values()), ids=list(ROWS)
)
def test_runtime_and_model_format_are_hard_constraints(
    req: MLRequirements, worker: Capabilities, verdict: Verdict, messages: list[str]
) -> None:
    result = match(req, worker)
    assert (result.verdict, [r.message for r in result.reasons]) == (verdict, messages)


def test_a_failed_runtime_reason_names_the_requested_and_the_advertised_runtimes() -> None:
    [reason] = match(job(runtime="tgi"), worker_with(runtimes=["vllm", "pytorch"])).reasons
    assert reason.as_dict() == {
        "resource": "runtime",
        "requested": "tgi",
        "available": ("pytorch", "vllm"),
        "capacity": ("pytorch", "vllm"),
        "verdict": "NEVER",
        "message": "runtime tgi not in [pytorch, vllm]",
    }


def test_the_pending_message_counts_runtime_and_format_reasons_across_the_fleet() -> None:
    req = job(runtime="vllm", model_format="safetensors", gpu_count=1)
    fleet = {"vllm": VLLM, "llama": LLAMA_CPP, "tgi": worker_with(gpus=1, runtimes=["tgi"])}
    ranked = rank(req, fleet)
    assert [(name, r.verdict) for name, r in ranked] == [
        ("vllm", FITS),
        ("llama", NEVER),
        ("tgi", NEVER),
    ]
    assert pending_message(r for name, r in ranked if name != "vllm") == (
        "0/2 workers eligible: 1 model_format safetensors not in [gguf], "
        "1 runtime vllm not in [llama.cpp], 1 runtime vllm not in [tgi]"
    )


def test_every_section_6_runtime_has_a_row_and_loads_only_section_4_formats() -> None:
    assert set(get_args(Runtime)) <= set(RUNTIME_FORMATS)
    assert set().union(*RUNTIME_FORMATS.values()) <= set(get_args(ModelFormat))


def test_the_worker_formats_are_its_runtimes_its_loaded_models_and_its_own() -> None:
    worker = worker_with(
        runtimes=["onnxruntime", "TF"],
        models=[("m", None)],
        model_formats=["custom"],
    )
    loaded = worker.model_copy(
        update={"models_loaded": (*worker.models_loaded, HOLDS_GGUF.models_loaded[0])}
    )
    assert runtimes_of(loaded) == {"onnx", "tensorflow"}
    assert formats_of(loaded) == {"onnx", "savedmodel", "gguf", "custom"}
