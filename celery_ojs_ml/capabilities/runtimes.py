"""Which ML runtimes a worker has, and which model formats they load (OJS ML §4, §6, §11).

A job's `ext_ml_runtime` and `ext_ml_model_format` are hard constraints
(`matching.filters`): "a vLLM worker cannot load a GGUF model; a llama.cpp worker
cannot load safetensors" (§4). A worker advertises its `runtimes` (§11), free-form
names that `canonical_runtime` maps onto the §6 names (`torch` is `pytorch`,
`onnxruntime` is `onnx`); the formats it loads are those its runtimes load by
`RUNTIME_FORMATS`, plus the formats of its `models_loaded` and any it declares in
`model_formats`.

Key decision: the table names only the §4 formats each runtime loads natively, so it
never promises a format a runtime needs a converter for; a worker that has one
declares the format in `model_formats`. `installed_runtimes` is the probe: it finds
modules with `importlib.util.find_spec` and binaries with `shutil.which`, and imports
nothing (importing torch or vllm takes seconds and may initialise CUDA).
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable

from celery_ojs_ml.capabilities.model import Capabilities

RUNTIME_FORMATS: dict[str, frozenset[str]] = {
    "pytorch": frozenset({"safetensors", "torchscript"}),
    "tensorflow": frozenset({"savedmodel"}),
    "onnx": frozenset({"onnx"}),
    "triton": frozenset({"onnx", "torchscript", "savedmodel"}),
    "vllm": frozenset({"safetensors"}),
    "tgi": frozenset({"safetensors"}),
    "llama.cpp": frozenset({"gguf"}),
    "custom": frozenset({"custom"}),
}
"""§6 runtime (and llama.cpp, which §4 names) -> the §4 formats it loads natively."""

ALIASES: dict[str, str] = {
    "torch": "pytorch",
    "tf": "tensorflow",
    "onnxruntime": "onnx",
    "onnx-runtime": "onnx",
    "tritonserver": "triton",
    "triton-inference-server": "triton",
    "text-generation-inference": "tgi",
    "llama-cpp": "llama.cpp",
    "llama_cpp": "llama.cpp",
    "llamacpp": "llama.cpp",
    "llama-cpp-python": "llama.cpp",
}
"""Other names workers use for a runtime of `RUNTIME_FORMATS`."""

PROBES: tuple[tuple[str, str | None, str | None], ...] = (
    ("pytorch", "torch", None),
    ("tensorflow", "tensorflow", None),
    ("onnx", "onnxruntime", None),
    ("triton", None, "tritonserver"),
    ("vllm", "vllm", None),
    ("tgi", None, "text-generation-launcher"),
    ("llama.cpp", "llama_cpp", "llama-server"),
)
"""(runtime, module, binary): the runtime is installed when the module or binary is found."""


def canonical_runtime(name: str) -> str:
    """A worker's runtime name as §6 spells it: lower-cased, aliases resolved."""
    key = name.strip().lower()
    return ALIASES.get(key, key)


def runtimes_of(caps: Capabilities) -> frozenset[str]:
    """The worker's runtimes, canonical (`canonical_runtime`)."""
    return frozenset(canonical_runtime(r) for r in caps.runtimes)


def formats_of(caps: Capabilities) -> frozenset[str]:
    """Every §4 format the worker loads: its runtimes', its loaded models' and its own."""
    found = {f for r in runtimes_of(caps) for f in RUNTIME_FORMATS.get(r, ())}
    found.update(m.model_format.strip().lower() for m in caps.models_loaded if m.model_format)
    found.update(f.strip().lower() for f in caps.model_formats)
    return frozenset(found)


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken install, or a module without a spec
        return False


def installed_runtimes(
    find: Callable[[str], bool] = _module_found,
    which: Callable[[str], str | None] = shutil.which,
) -> tuple[str, ...]:
    """The runtimes of `PROBES` installed here, in that order; nothing is imported."""
    return tuple(
        runtime
        for runtime, module, binary in PROBES
        if (module is not None and find(module)) or (binary is not None and which(binary))
    )
