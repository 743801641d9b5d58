"""`celery-ojs-ml metrics`: its options and what it says without an app."""

from __future__ import annotations

from click.testing import CliRunner

from celery_ojs_ml.cli.main import cli


def test_metrics_serves_on_port_9808_of_the_loopback_address_by_default() -> None:
    result = CliRunner().invoke(cli, ["metrics", "--help"])
    assert result.exit_code == 0, result.output
    assert "--port INTEGER RANGE" in result.output and "[default: 9808;" in result.output
    assert "[default: 127.0.0.1]" in result.output


def test_metrics_without_an_app_is_a_usage_error_that_shows_how_to_pass_one() -> None:
    result = CliRunner(env={"CELERY_APP": ""}).invoke(cli, ["metrics"])
    assert result.exit_code == 2
    assert "celery -A proj ojs-ml metrics" in result.output
