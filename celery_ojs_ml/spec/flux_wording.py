"""Shared wording of the jobspec V1 checks: RFC 25 section names, fix examples, value rendering.

Both passes (`flux_rules`, `flux_schema`) cite these sections and examples,
so a problem reads the same whichever pass finds it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_RFC = "Flux RFC 25"
OVERVIEW = f"{_RFC} §Overview"
LANGUAGE = f"{_RFC} §Jobspec Language Definition"
RESOURCES = f"{_RFC} §Resources"
GRAPH = f"{_RFC} §V1-Specific Resource Graph Restrictions"
TASKS = f"{_RFC} §Tasks"
ATTRIBUTES = f"{_RFC} §Attributes"
SCHEMA = f"{_RFC} §Schema"

DOCUMENT = "<document>"
CORE_EXAMPLE = '{"type": "core", "count": 2}'
SLOT_EXAMPLE = (
    '{"type": "slot", "count": 1, "label": "default", "with": [{"type": "core", "count": 2}]}'
)
TASK_EXAMPLE = '{"command": ["app"], "slot": "default", "count": {"per_slot": 1}}'
DURATION_FIX = 'give the run time in seconds, e.g. "duration": 3600 (0 means unlimited)'


def describe(holder: Mapping[str, Any], key: str) -> str:
    """`is <value>` for `holder[key]`, or `is missing`."""
    return f"is {show(holder[key])}" if key in holder else "is missing"


def show(value: Any) -> str:
    """A value as JSON, cut to 60 characters."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
