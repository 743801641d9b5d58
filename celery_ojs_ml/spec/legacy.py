"""Map the OJS ML v0.1 `meta.*` form onto v0.3 `ext_ml_*` attributes.

Key decision: v0.1 is translated, not modelled twice. `meta.resources`,
`meta.affinity`, `meta.checkpoint` and `meta.preemption` become the flat v0.3
keys and then go through the one v0.3 validator, so both forms obey the same
rules and produce the same canonical requirements. A v0.1 GPU block without a
count leaves the count unset, so the v0.3 default of one GPU applies rather
than the v0.1 default of zero, which would contradict a GPU type (§3.2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.errors import SpecError, Violation

_SECTION = "OJS ML v0.1 §2.2"
# (path inside meta, v0.3 attribute)
_PATHS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("resources", "gpu", "count"), "ext_ml_gpu_count"),
    (("resources", "gpu", "type"), "ext_ml_gpu_type"),
    (("resources", "gpu", "memory_gb"), "ext_ml_gpu_memory_gb"),
    (("resources", "cpu", "cores"), "ext_ml_cpu_cores"),
    (("resources", "memory_gb"), "ext_ml_memory_gb"),
    (("resources", "storage_gb"), "ext_ml_storage_gb"),
    (("affinity",), "ext_ml_affinity"),
    (("checkpoint", "enabled"), "ext_ml_checkpoint_enabled"),
    (("checkpoint", "interval_s"), "ext_ml_checkpoint_interval_s"),
    (("checkpoint", "storage_uri"), "ext_ml_checkpoint_storage_uri"),
    (("checkpoint", "max_checkpoints"), "ext_ml_checkpoint_max_count"),
    (("preemption", "preemptible"), "ext_ml_preemptible"),
    (("preemption", "grace_period_s"), "ext_ml_preemption_grace_period_s"),
    (("preemption", "checkpoint_on_preempt"), "ext_ml_checkpoint_on_preempt"),
)
LEGACY_KEYS = ("resources", "affinity", "checkpoint", "preemption")


def has_legacy(meta: Any) -> bool:
    """Whether an envelope's `meta` carries any v0.1 ML block."""
    return isinstance(meta, Mapping) and any(k in meta for k in LEGACY_KEYS)


def from_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The v0.3 attributes equivalent to a v0.1 `meta`; raises SpecError on bad shapes."""
    out: dict[str, Any] = {}
    violations: list[Violation] = []
    for path, attr in _PATHS:
        found, value, bad = _lookup(meta, path)
        if bad is not None:
            violations.append(bad)
        elif found:
            out[attr] = value
    if violations:
        raise SpecError(violations)
    return out


def _lookup(meta: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any, Violation | None]:
    node: Any = meta
    walked = "meta"
    for part in path:
        if not isinstance(node, Mapping):
            return (
                False,
                None,
                Violation(
                    walked,
                    "must be an object",
                    _SECTION,
                    'write it as an object, e.g. "resources": {"gpu": {"count": 1}}',
                ),
            )
        if part not in node:
            return False, None, None
        node = node[part]
        walked += f".{part}"
    return True, node, None


def merge(legacy: Mapping[str, Any], modern: Mapping[str, Any]) -> dict[str, Any]:
    """Combine both forms; the same attribute given twice with different values is an error."""
    clashes = [
        Violation(
            key,
            f"is {modern[key]!r} but the v0.1 meta form says {legacy[key]!r}",
            "OJS ML v0.1 §2.1",
            f"declare {key} once, in one form",
        )
        for key in legacy
        if key in modern and modern[key] != legacy[key]
    ]
    if clashes:
        raise SpecError(clashes)
    return {**legacy, **modern}


#: Where each v0.3 attribute lives in the v0.1 form, for error paths.
LEGACY_PATH: dict[str, str] = {attr: "meta." + ".".join(path) for path, attr in _PATHS}


def relabel(error: SpecError, legacy_attrs: Mapping[str, Any]) -> SpecError:
    """Rewrite violation paths of attributes that came from the v0.1 form."""
    out = []
    for v in error.violations:
        root, dot, rest = v.path.partition(".")
        if root in legacy_attrs and root in LEGACY_PATH:
            path = LEGACY_PATH[root] + (dot + rest if dot else "")
            v = Violation(path, v.problem, v.section, v.fix.replace(root, path))
        out.append(v)
    return SpecError(out)
