"""Celery integration: the `OJSML(app)` plugin, router, worker bootsteps and hooks."""
