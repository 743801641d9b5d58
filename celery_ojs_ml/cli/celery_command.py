"""`celery ojs-ml ...`: the same verbs as `celery-ojs-ml`, through `celery.commands`."""

from celery_ojs_ml.cli.main import cli as ojs_ml

__all__ = ["ojs_ml"]
