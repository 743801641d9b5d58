"""Shared test helpers: where the specs and examples live, and small builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_ojs_ml.errors import SpecError
from celery_ojs_ml.spec.normalize import normalize

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPEC_DIR = ROOT.parent / "shared" / "spec"


def spec_text(name: str) -> str:
    """The text of one spec document; fails loudly when shared/ is missing."""
    path = SPEC_DIR / name
    assert path.exists(), f"spec {path} is missing: tests read the specs from ../shared/spec"
    return path.read_text(encoding="utf-8")


def flat(**attrs: Any) -> dict[str, Any]:
    """Normalise keyword attributes (without the ext_ml_ prefix) to the flat canonical form."""
    return normalize({f"ext_ml_{k}": v for k, v in attrs.items()}).flat()


def rejects(attrs: dict[str, Any]) -> SpecError:
    """Assert normalisation rejects `attrs` and return the error."""
    with pytest.raises(SpecError) as info:
        normalize(attrs)
    return info.value
