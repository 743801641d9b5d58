"""The label rules of OJS ML requirements: protected labels and well-formed affinity rules.

A job may not select on an administrative label (§15.4), and each affinity or
anti-affinity rule (§7.2, §7.3) must carry the values its operator needs: none
for `Exists`, exactly one number (or a major.minor version) for `Gt` and kin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from celery_ojs_ml.errors import Violation
from celery_ojs_ml.spec.resources import AffinityRule, AffinitySpec, MLRequirements
from celery_ojs_ml.spec.rules_sections import section_of

if TYPE_CHECKING:
    from celery_ojs_ml.spec.bounds import Bounds

_NUMERIC_OPS = frozenset({"Gt", "Gte", "Lt", "Lte"})
_VALUELESS_OPS = frozenset({"Exists", "DoesNotExist"})


def label_checks(m: MLRequirements, b: Bounds) -> Iterator[Violation]:
    """Protected labels a job selects on (§15.4) and ill-formed affinity rules (§7.2, §7.3)."""
    for key in m.ext_ml_node_selector or {}:
        if key in b.protected_label_keys:
            yield _protected("ext_ml_node_selector", key, f"ext_ml_node_selector.{key}")
    for attr, spec in (
        ("ext_ml_affinity", m.ext_ml_affinity),
        ("ext_ml_anti_affinity", m.ext_ml_anti_affinity),
    ):
        if spec is not None:
            yield from _affinity(attr, spec, b)


def _protected(attr: str, key: str, path: str) -> Violation:
    return Violation(
        path,
        f"uses the administrative label {key!r}, which jobs may not select on",
        "OJS ML §15.4",
        "remove it; administrators set such labels on workers "
        "(ojs_ml_protected_label_keys lists them)",
    )


def _affinity(attr: str, spec: AffinitySpec, b: Bounds) -> Iterator[Violation]:
    for kind, rule_list in (("required", spec.required), ("preferred", spec.preferred)):
        for i, rule in enumerate(rule_list):
            path = f"{attr}.{kind}[{i}]"
            if rule.key in b.protected_label_keys:
                yield _protected(attr, rule.key, f"{path}.key")
            yield from _rule(attr, path, rule, preferred=kind == "preferred")


def _rule(attr: str, path: str, rule: AffinityRule, *, preferred: bool) -> Iterator[Violation]:
    section = section_of(attr)
    op, values = rule.operator, rule.values
    if op in _VALUELESS_OPS and values:
        yield Violation(
            f"{path}.values",
            f"must be empty for operator {op}",
            section,
            f'drop "values", e.g. {{"key": "{rule.key}", "operator": "{op}"}}',
        )
    elif op not in _VALUELESS_OPS and not values:
        yield Violation(
            f"{path}.values",
            f"is required for operator {op}",
            section,
            f'give values, e.g. {{"key": "{rule.key}", "operator": "{op}", '
            f'"values": ["{_example_value(rule.key, op)}"]}}',
        )
    elif op in _NUMERIC_OPS:
        yield from _numeric_rule(path, rule, section)
    if rule.weight is not None and not preferred:
        yield Violation(
            f"{path}.weight",
            "only applies to preferred rules",
            section,
            "remove the weight or move the rule to preferred",
        )


def _numeric_rule(path: str, rule: AffinityRule, section: str) -> Iterator[Violation]:
    if len(rule.values) != 1:
        yield Violation(
            f"{path}.values",
            f"must hold exactly one value for {rule.operator}",
            section,
            f'e.g. "values": ["{_example_value(rule.key, rule.operator)}"]',
        )
        return
    value = rule.values[0]
    version = rule.key == "compute_capability"
    ok = _is_version(value) if version else _is_number(value)
    if not ok:
        kind = "a major.minor version" if version else "a number"
        yield Violation(
            f"{path}.values[0]",
            f"is {value!r} but {rule.operator} needs {kind}",
            section,
            f'e.g. "values": ["{_example_value(rule.key, rule.operator)}"]',
        )


def _example_value(key: str, op: str) -> str:
    if key == "compute_capability":
        return "8.0"
    return "4" if op in _NUMERIC_OPS else "nvidia-a100"


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return value.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity")


def _is_version(value: str) -> bool:
    major, dot, minor = value.partition(".")
    return major.isdigit() and (not dot or minor.isdigit())
