"""The docs cover every setting (the issue: "Document every setting")."""

from __future__ import annotations

from pathlib import Path

from celery_ojs_ml.integration.settings import PREFIX, OJSMLSettings

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_documented_in_docs_settings_md() -> None:
    text = (ROOT / "docs" / "settings.md").read_text()
    fields = set(OJSMLSettings.model_fields) - {"bounds"}  # bounds are `ojs_ml_max_*` etc.
    missing = sorted(PREFIX + f for f in fields if f"`{PREFIX}{f}`" not in text)
    assert missing == [], f"add these settings to docs/settings.md: {missing}"
