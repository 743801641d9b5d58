"""The `celery-ojs-ml demo`: the specs' example jobs placed on a three-node simulated fleet.

Modules: `app` (the Celery app and tasks real demo workers load), `jobs` (the example
documents and which node may run each job), `watch` and `table` (job states and the
live table), `session` (submit, watch, judge), `embedded` (in-process workers on
`memory://` and fakeredis), `fleet` (real `celery worker` processes on Redis), `cli`.

Key decision: the demo drives the real plugin end to end (router, store,
worker gate) and judges its own outcome with the same matching code the
plugin uses, so a wrong placement or a job stuck without a reason makes the
demo exit non-zero instead of printing a pretty but wrong table.
"""
