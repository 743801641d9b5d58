"""The `celery-ojs-ml demo`: the specs' example jobs placed on a three-node simulated fleet.

Modules: `app` (the demo Celery app and its tasks, also what real workers load
with `celery -A celery_ojs_ml.demo.app worker`), `jobs` (the example documents
and which node may run each job), `watch` (job states from the result backend
and the store), `table` (the live table), `session` (submit, watch, judge),
`embedded` (three in-process workers on `memory://` and fakeredis), `fleet`
(real `celery worker` processes against Redis) and `cli` (the click command).

Key decision: the demo drives the real plugin end to end (router, store,
worker gate) and judges its own outcome with the same matching code the
plugin uses, so a wrong placement or a job stuck without a reason makes the
demo exit non-zero instead of printing a pretty but wrong table.
"""
