"""The docs cover every setting and every docs page is linked from the README."""

from __future__ import annotations

from pathlib import Path

from celery_ojs_ml.spec.normalize import Bounds
from celery_ojs_ml.wire.settings import PREFIX, OJSMLSettings

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_documented_in_docs_settings_md() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    fields = set(OJSMLSettings.model_fields) - {"bounds"}  # bounds are `ojs_ml_max_*` etc.
    missing = sorted(PREFIX + f for f in fields if f"`{PREFIX}{f}`" not in text)
    assert missing == [], f"add these settings to docs/settings.md: {missing}"


def test_every_bound_and_allow_list_is_documented_in_docs_settings_md() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    missing = sorted(
        PREFIX + f for f in Bounds.__dataclass_fields__ if f"`{PREFIX}{f}`" not in text
    )
    assert missing == [], f"add these settings to docs/settings.md: {missing}"


def test_every_bound_and_allow_list_is_listed_with_its_default_in_docs_security_md() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    missing = sorted(
        PREFIX + f for f in Bounds.__dataclass_fields__ if f"`{PREFIX}{f}`" not in text
    )
    assert missing == [], f"add these settings to docs/security.md: {missing}"


def test_every_page_in_docs_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    missing = [p for p in pages if f"](docs/{p})" not in readme]
    assert missing == [], f"link these pages from README.md: {missing}"
