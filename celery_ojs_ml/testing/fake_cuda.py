"""A small shared object to map under the CUDA driver's name, where there is no GPU.

The tests and `bench/inference.py` stand in for a framework's first CUDA call by
loading a copy of some shared library as `libcuda.so.1`; the plugin's detection
(`child.pinning.cuda_initialised`) reads `/proc/self/maps` as it would for the
real driver. Which standard-library modules are shared objects depends on how
Python was built (a distribution's Python links `_bisect` into the interpreter), so
the first one that is a file is taken.
"""

from __future__ import annotations

import importlib

_CANDIDATES = ("_bisect", "_ctypes", "_json", "_csv", "select", "math", "_struct")


def shared_object() -> str:
    """The path of a loadable shared object of this Python's standard library."""
    for name in _CANDIDATES:
        path = getattr(importlib.import_module(name), "__file__", None)
        if isinstance(path, str) and ".so" in path:
            return path
    raise RuntimeError(
        "no standard-library extension module is a shared object in this Python "
        f"(tried {', '.join(_CANDIDATES)}); the simulated CUDA driver needs one"
    )
