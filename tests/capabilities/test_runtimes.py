"""Probing the §11 `runtimes` a worker advertises (OJS ML Resources §6, §11).

`installed_runtimes` finds modules and binaries without importing them; `probe()`
advertises what it finds, and a declared list always wins.
"""

from __future__ import annotations

import subprocess
import sys

from celery_ojs_ml.capabilities import capabilities_to_dict, parse_capabilities, probe
from celery_ojs_ml.capabilities.runtimes import installed_runtimes
from celery_ojs_ml.testing.fake_nvml import A100_80GB, FakeNVML


def test_a_runtime_is_installed_when_its_module_or_its_binary_is_found() -> None:
    modules = {"torch", "llama_cpp"}
    binaries = {"tritonserver": "/opt/tritonserver/bin/tritonserver"}
    found = installed_runtimes(find=modules.__contains__, which=binaries.get)
    assert found == ("pytorch", "triton", "llama.cpp")


def test_nothing_found_advertises_no_runtime() -> None:
    assert installed_runtimes(find=lambda _: False, which=lambda _: None) == ()


def test_probing_runtimes_imports_none_of_them() -> None:
    """A fresh interpreter: finding torch (installed with the dev extras) must not import it."""
    code = (
        "import sys; from celery_ojs_ml.capabilities.runtimes import installed_runtimes; "
        "found = installed_runtimes(); "
        "print(','.join(found)); "
        "print(any(m in sys.modules for m in ('torch', 'vllm', 'tensorflow', 'onnxruntime')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    found, imported = done.stdout.split()
    assert imported == "False"
    assert set(found.split(",")) - {""} <= {"pytorch", "tensorflow", "onnx", "vllm", "llama.cpp"}


def test_the_probe_advertises_the_runtimes_it_is_given_or_finds() -> None:
    given = probe(nvml=FakeNVML.of(A100_80GB, 1), runtimes=["vllm"])
    found = probe(nvml=FakeNVML.of(A100_80GB, 1))
    assert given.runtimes == ("vllm",)
    assert found.runtimes == installed_runtimes()


def test_model_formats_travel_in_the_advertisement_and_an_empty_list_is_left_out() -> None:
    declared = parse_capabilities({"runtimes": ["custom"], "model_formats": ["gguf"]})
    bare = parse_capabilities({"cpu_cores": 4})
    doc = capabilities_to_dict(declared)
    assert doc["capabilities"]["model_formats"] == ["gguf"]
    assert parse_capabilities(doc) == declared
    assert "model_formats" not in capabilities_to_dict(bare)["capabilities"]
