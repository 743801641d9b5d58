"""Every example in the specs validates, and its normalised form stays stable.

The example files in examples/jobs/ are the spec's own JSON blocks; a test
checks they still match the spec text, so the snapshot covers the specs.
Regenerate snapshots with `OJS_ML_UPDATE_SNAPSHOTS=1 pytest tests/spec`. A
missing snapshot is written on a developer's machine but fails under CI=true,
where it can only mean that a new example's snapshot was not committed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_ojs_ml.spec.documents import canonical, load_text, parse_document
from tests.helpers import EXAMPLES, spec_text

SNAPSHOTS = Path(__file__).parent / "snapshots"
JOB_FILES = sorted((EXAMPLES / "jobs").glob("*.*"))
SPEC_FILES = ("ojs-ml-resources-v0.3.md", "ojs-ml-extensions-v0.1.md", "ojs-ml-resources-v0.1.md")


def _spec_examples() -> list[tuple[str, Any]]:
    found = []
    for name in SPEC_FILES:
        for i, block in enumerate(re.findall(r"```json\n(.*?)```", spec_text(name), re.S)):
            try:
                doc = json.loads(block)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict) and ("type" in doc or "workflow_type" in doc):
                found.append((f"{name}#{i}", doc))
    return found


SPEC_EXAMPLES = _spec_examples()


def test_the_spec_examples_were_found() -> None:
    assert len(SPEC_EXAMPLES) >= 18


@pytest.mark.parametrize(("where", "doc"), SPEC_EXAMPLES, ids=[w for w, _ in SPEC_EXAMPLES])
def test_every_example_job_and_workflow_in_the_specs_validates(where: str, doc: Any) -> None:
    canonical(parse_document(doc))


@pytest.mark.parametrize(("where", "doc"), SPEC_EXAMPLES, ids=[w for w, _ in SPEC_EXAMPLES])
def test_every_spec_example_is_kept_verbatim_in_examples_jobs(where: str, doc: Any) -> None:
    copies = [json.loads(p.read_text()) for p in JOB_FILES if p.suffix == ".json"]
    assert doc in copies, f"{where} is missing from examples/jobs/"


@pytest.mark.parametrize("path", JOB_FILES, ids=[p.name for p in JOB_FILES])
def test_the_normalised_form_of_each_example_is_stable(path: Path) -> None:
    out = canonical(parse_document(load_text(path.read_text())))
    snap = SNAPSHOTS / f"{path.stem}.json"
    if not os.environ.get("OJS_ML_UPDATE_SNAPSHOTS") and not snap.exists() and _under_ci():
        pytest.fail(
            f"the snapshot {snap} is missing; generate it with "
            "`OJS_ML_UPDATE_SNAPSHOTS=1 pytest tests/spec` and commit it"
        )
    if os.environ.get("OJS_ML_UPDATE_SNAPSHOTS") or not snap.exists():
        snap.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    assert out == json.loads(snap.read_text())


def _under_ci() -> bool:
    """CI=true (GitHub Actions, GitLab, most others): a missing snapshot is an error there."""
    return os.environ.get("CI", "").lower() in ("true", "1")


@pytest.mark.parametrize("path", JOB_FILES, ids=[p.name for p in JOB_FILES])
def test_normalising_the_normalised_form_changes_nothing(path: Path) -> None:
    out = canonical(parse_document(load_text(path.read_text())))
    for flat in out if isinstance(out, list) else [out]:
        again = canonical(parse_document({"type": "x", **flat}))
        assert again == flat


def test_a_missing_snapshot_fails_under_ci_instead_of_being_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under CI a missing snapshot is a forgotten file, not a baseline to record."""
    monkeypatch.setattr(sys.modules[__name__], "SNAPSHOTS", tmp_path)
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("OJS_ML_UPDATE_SNAPSHOTS", raising=False)
    path = JOB_FILES[0]

    with pytest.raises(pytest.fail.Exception) as info:
        test_the_normalised_form_of_each_example_is_stable(path)

    assert str(info.value) == (
        f"the snapshot {tmp_path / (path.stem + '.json')} is missing; generate it with "
        "`OJS_ML_UPDATE_SNAPSHOTS=1 pytest tests/spec` and commit it"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_missing_snapshot_is_written_outside_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "SNAPSHOTS", tmp_path)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("OJS_ML_UPDATE_SNAPSHOTS", raising=False)

    test_the_normalised_form_of_each_example_is_stable(JOB_FILES[0])

    assert [p.name for p in tmp_path.iterdir()] == [f"{JOB_FILES[0].stem}.json"]
