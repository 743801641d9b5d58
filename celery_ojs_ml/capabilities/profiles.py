"""Simulated worker fleets and the `--ojs-ml-capabilities` worker option.

`PROFILES` holds §11 capability objects for machines a demo or test needs
without owning them; any catalogue GPU id also works as `<gpu-id>x<N>` (e.g.
`nvidia-h200x4`) and any §3.3 TPU type as `tpu-<type>-<topology>`.

`resolve_capabilities` turns the option value into `Capabilities`. Key
decision: problems with the option itself (unknown profile, missing or
unreadable file, malformed JSON/YAML) are `ConfigError`s, because the operator
must fix the command line; a well-formed document that breaks the spec keeps
its `SpecError`, whose paths point into the document.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery_ojs_ml.capabilities.model import Capabilities
from celery_ojs_ml.capabilities.parse import parse_capabilities
from celery_ojs_ml.capabilities.probe import probe
from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.spec.catalogue import GPU_MODELS, TPU_TYPES

ENV_VAR = "OJS_ML_CAPABILITIES"
OPTION = "--ojs-ml-capabilities"
_FORMS = "auto, a JSON object, profile:NAME, or the path of a JSON or YAML file"

#: §11 runtimes a simulated machine advertises: a GPU node's serving and training stack,
#: a CPU node's CPU inference runtimes, a TPU node's frameworks.
GPU_RUNTIMES = ["pytorch", "tensorflow", "onnx", "triton", "vllm", "tgi"]
CPU_RUNTIMES = ["pytorch", "tensorflow", "onnx", "llama.cpp"]
TPU_RUNTIMES = ["tensorflow", "pytorch"]

#: GPU models whose multi-GPU machines are usually NVLink boards (SXM/OAM).
_NVLINK_BOARDS = frozenset(
    {"nvidia-a100", "nvidia-h100", "nvidia-h200", "nvidia-b200", "nvidia-v100"}
)


def _gpu_machine(gpu_type: str, count: int, cores: int, ram: float, **extra: Any) -> dict[str, Any]:
    gpu: dict[str, Any] = {"type": gpu_type, "count": count, **extra.pop("gpu", {})}
    if count > 1 and "interconnect" not in gpu:
        gpu["interconnect"] = "nvlink" if gpu_type in _NVLINK_BOARDS else "pcie"
    return {
        "accelerator": "gpu",
        "gpu": gpu,
        "cpu_cores": cores,
        "memory_gb": ram,
        "runtimes": list(GPU_RUNTIMES),
        **extra,
    }


PROFILES: dict[str, dict[str, Any]] = {
    "nvidia-a100x8": _gpu_machine(
        "nvidia-a100", 8, 96, 1024, gpu={"memory_gb": 80}, storage_gb=8000, shm_size_gb=256
    ),
    "nvidia-a100x2": _gpu_machine(
        "nvidia-a100", 2, 24, 256, gpu={"memory_gb": 80}, storage_gb=2000, shm_size_gb=64
    ),
    "nvidia-h100x8": _gpu_machine("nvidia-h100", 8, 192, 2048, storage_gb=30000, shm_size_gb=512),
    "nvidia-l4x1": _gpu_machine("nvidia-l4", 1, 8, 32, storage_gb=450, shm_size_gb=8),
    "nvidia-t4x1": _gpu_machine("nvidia-t4", 1, 4, 16, storage_gb=125, shm_size_gb=4),
    "cpu": {
        "accelerator": "cpu",
        "cpu_cores": 32,
        "memory_gb": 128,
        "storage_gb": 500,
        "shm_size_gb": 32,
        "runtimes": CPU_RUNTIMES,
    },
    "tpu-v5e-2x4": {
        "accelerator": "tpu",
        "tpu": {"type": "v5e", "topology": "2x4", "chip_count": 8},
        "cpu_cores": 224,
        "memory_gb": 384,
        "storage_gb": 1000,
        "shm_size_gb": 96,
        "runtimes": TPU_RUNTIMES,
    },
}

_GENERIC_GPU = re.compile(r"^(?P<gpu>[a-z0-9.-]+)x(?P<count>\d+)$")
_GENERIC_TPU = re.compile(r"^tpu-(?P<type>v\w+)-(?P<topology>\d+x\d+(x\d+)?)$")


def profile_names() -> list[str]:
    """The named profiles, sorted."""
    return sorted(PROFILES)


def profile(name: str) -> dict[str, Any]:
    """A fresh copy of the §11 capability object of a named or generic profile."""
    found = copy.deepcopy(PROFILES[name]) if name in PROFILES else _generic(name)
    if found is None:
        raise _unknown_profile(name)
    found["labels"] = {**found.get("labels", {}), "profile": name}
    return found


def _generic(name: str) -> dict[str, Any] | None:
    gpu = _GENERIC_GPU.match(name)
    if gpu and gpu["gpu"] in GPU_MODELS and int(gpu["count"]) >= 1:
        count = int(gpu["count"])
        row = GPU_MODELS[gpu["gpu"]]
        extra = {"gpu": {"memory_gb": row.max_memory_gb}, "shm_size_gb": 32 * count}
        return _gpu_machine(
            row.id, count, 12 * count, 128 * count, storage_gb=1000 * count, **extra
        )
    tpu = _GENERIC_TPU.match(name)
    if tpu and tpu["type"] in TPU_TYPES:
        return {
            "accelerator": "tpu",
            "tpu": {"type": tpu["type"], "topology": tpu["topology"]},
            "runtimes": list(TPU_RUNTIMES),
        }
    return None


def _unknown_profile(name: str) -> ConfigError:
    return ConfigError(
        f'unknown capability profile "{name}"; use one of {", ".join(profile_names())}, '
        f"<gpu-id>x<N> such as nvidia-h200x4 (gpu ids: {', '.join(GPU_MODELS)}) "
        f"or tpu-<type>-<topology> such as tpu-v5p-4x4 (types: {', '.join(TPU_TYPES)})"
    )


def resolve_capabilities(
    value: str | None, *, env: Mapping[str, str] | None = None
) -> Capabilities:
    """Capabilities for `--ojs-ml-capabilities=auto|PATH|JSON|profile:NAME`.

    None falls back to the `OJS_ML_CAPABILITIES` environment variable, then to
    `auto` (probe this machine).
    """
    if is_probed(value, env=env):
        return probe()
    value = (value or (os.environ if env is None else env).get(ENV_VAR) or "").strip()
    if value.startswith(("{", "[")):
        return parse_capabilities(_json(value))
    if value.startswith("profile:"):
        return parse_capabilities(profile(value.removeprefix("profile:").strip()))
    return parse_capabilities(_load_file(Path(value)))


def is_probed(value: str | None, *, env: Mapping[str, str] | None = None) -> bool:
    """Whether `resolve_capabilities(value)` probes this machine (`auto`)."""
    if value is None:
        value = (os.environ if env is None else env).get(ENV_VAR) or "auto"
    value = value.strip()
    return value.lower() == "auto" or not value


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{OPTION} is not valid JSON ({err}); pass {_FORMS}, "
            f"""e.g. {OPTION}='{{"gpu": {{"type": "nvidia-a100", "count": 8}}}}'"""
        ) from None


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(
            f"capabilities file {path} does not exist; pass {_FORMS}, "
            f"e.g. {OPTION}=/etc/ojs-ml/capabilities.yaml"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"capabilities file {path} cannot be read ({err})") from None
    if path.suffix.lower() == ".json":
        return _parse_text(path, text, json.loads, json.JSONDecodeError)
    import yaml

    return _parse_text(path, text, yaml.safe_load, yaml.YAMLError)


def _parse_text(path: Path, text: str, load: Any, error: type[Exception]) -> Any:
    try:
        return load(text)
    except error as err:
        detail = str(err).replace("\n", " ")
        raise ConfigError(
            f"capabilities file {path} is not valid JSON or YAML ({detail})"
        ) from None
