"""`celery ojs-ml ...`: the same verbs as `celery-ojs-ml`, through `celery.commands`.

Key decision: every `celery` run loads this entry point, so importing the
control module here registers the `ojs_ml_*` inspect commands in the client
too: plain `celery -b URL inspect ojs_ml_status` works without `-A`.
"""

from celery_ojs_ml.cli.main import cli as ojs_ml
from celery_ojs_ml.worker import control  # noqa: F401  (registers ojs_ml_* inspect commands)

__all__ = ["ojs_ml"]
