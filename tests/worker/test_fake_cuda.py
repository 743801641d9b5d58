"""The simulated CUDA driver's stand-in library (`testing.fake_cuda`)."""

from __future__ import annotations

import ctypes
import os
import types

import pytest

from celery_ojs_ml.testing import fake_cuda


def test_the_stand_in_is_a_loadable_shared_object_of_this_python() -> None:
    path = fake_cuda.shared_object()
    assert os.path.isfile(path) and ".so" in path
    ctypes.CDLL(path)  # raises OSError if it cannot be mapped


def test_a_module_linked_into_the_interpreter_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Debian's and Ubuntu's python3 link `_bisect` into the interpreter: no __file__.
    real = fake_cuda.importlib.import_module
    builtin = types.ModuleType("_bisect")
    monkeypatch.setattr(
        fake_cuda.importlib,
        "import_module",
        lambda name: builtin if name == "_bisect" else real(name),
    )
    path = fake_cuda.shared_object()
    assert "_bisect" not in os.path.basename(path) and os.path.isfile(path)


def test_no_shared_object_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_cuda.importlib, "import_module", lambda name: types.ModuleType(name))
    with pytest.raises(RuntimeError, match="simulated CUDA driver needs one"):
        fake_cuda.shared_object()
