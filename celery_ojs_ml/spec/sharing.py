"""The GPU-share opt-in (`ojs_ml_gpu_share`): its cross-field rules.

Key decision: a share is this project's extension, not an OJS ML attribute, so
it lives under the project's namespace (`ojs_ml_*`, like the settings) rather
than inventing an `ext_ml_*` key. A share is one device, sized by the job's own
`ext_ml_gpu_memory_gb` (`true`) or by a fraction of a GPU; a `dedicated` job
never shares. The worker side (milli-GPU accounting) is `allocator.sharing`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.resources import MLRequirements, gpu_share

if TYPE_CHECKING:
    from celery_ojs_ml.spec.bounds import Bounds

KEY = "ojs_ml_gpu_share"
SECTION = "celery-ojs-ml GPU sharing, docs/sharing.md"
EXAMPLE = '"ojs_ml_gpu_share": true, "ext_ml_gpu_memory_gb": 10'


def share_checks(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    """A share needs its VRAM amount (when `true`) and is one GPU (the accelerator rule
    `_accelerator_conflicts` sees a share as a GPU job)."""
    share = gpu_share(m)
    if share is None:
        return
    if share is True and m.ext_ml_gpu_memory_gb is None:
        yield Violation(
            KEY,
            "is true (share one GPU by VRAM) but ext_ml_gpu_memory_gb is not set",
            SECTION,
            f"say how much VRAM the job needs, e.g. {EXAMPLE}, "
            'or share a fraction of a GPU, e.g. "ojs_ml_gpu_share": 0.25',
        )
    if m.ext_ml_gpu_count not in (None, 1):
        yield Violation(
            "ext_ml_gpu_count",
            f"is {m.ext_ml_gpu_count} but {KEY} is set; a GPU share is one device",
            SECTION,
            f'set "ext_ml_gpu_count": 1 (or leave it out), or remove {KEY} to take whole GPUs',
        )


def share_vs_mlx(mlx: Mapping[str, Any]) -> list[Violation]:
    """`dedicated` GPU affinity takes whole workers, so it never shares a GPU."""
    if mlx.get("ext_mlx_scheduling_gpu_affinity") != "dedicated":
        return []
    return [
        Violation(
            KEY,
            "is set but ext_mlx_scheduling_gpu_affinity is dedicated; a dedicated job "
            "never shares a GPU",
            SECTION,
            f'remove {KEY}, or use "ext_mlx_scheduling_gpu_affinity": "pack"',
        )
    ]
