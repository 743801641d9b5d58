"""A Celery app whose settings allow https artifacts from one host, for `validate -A`.

`celery-ojs-ml validate -A tests.cli.artifactapp:app job.json` validates with
these `ojs_ml_*` settings instead of the defaults; nothing is ever published.
"""

from __future__ import annotations

from celery import Celery

from celery_ojs_ml import OJSML

app = Celery("artifactapp", broker="memory://", set_as_current=False)
app.conf.ojs_ml_artifact_schemes = ["s3", "https"]
app.conf.ojs_ml_artifact_prefixes = ["s3://ml-models/", "https://models.example/"]
OJSML(app)
