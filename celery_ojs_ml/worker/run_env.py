"""The gate's check of a job's working directory and environment (Flux RFC 25 §Attributes).

A Flux jobspec's `attributes.system.cwd` and `environment` travel as the `ojs_cwd`
and `ojs_environment` headers (`producer.submission`); the pool child applies them
around the run (`child.run_env`). Here, in the worker's main process, a job is
refused (dead-lettered, its result a failure with the reason) before it gets
anything when they cannot be applied.

Key decisions:
- The headers are checked again with the publish-time rules (`spec.flux_env`):
  a raw message can carry anything.
- The directory must exist on this worker: the gate can still refuse the job
  cleanly, while the child could only run it somewhere else.
- Only the prefork pool gives each task a process of its own; under the others a
  working directory or an environment would be every running task's, so such a
  job is refused with the reason.
"""

from __future__ import annotations

import os
from typing import Any

from celery_ojs_ml.spec.bounds import Bounds
from celery_ojs_ml.spec.flux_env import CWD_PATH, run_env_problem
from celery_ojs_ml.spec.resources import MLRequirements
from celery_ojs_ml.wire import headers as h
from celery_ojs_ml.wire.inbound import BadMessage, InboundCheck


class RunEnvCheck(InboundCheck):
    """`InboundCheck`, plus the job's working directory and environment on this worker."""

    def __init__(self, bounds: Bounds, max_header_bytes: int, *, prefork: bool) -> None:
        super().__init__(bounds, max_header_bytes)
        self.prefork = prefork

    def requirements(self, headers: dict[str, Any]) -> MLRequirements | None:
        req = super().requirements(headers)
        if req is not None and (h.CWD in headers or h.ENVIRONMENT in headers):
            problem = run_env_problem_here(headers, self.prefork)
            if problem is not None:
                raise BadMessage(problem)
        return req


def run_env_problem_here(headers: dict[str, Any], prefork: bool) -> str | None:
    """Why this worker cannot run a job with these cwd/environment headers; None if it can."""
    cwd, env = headers.get(h.CWD), headers.get(h.ENVIRONMENT)
    problem = run_env_problem(cwd, env)
    if problem is not None:
        return problem
    if not prefork:
        return (
            f"{CWD_PATH} and environment need the prefork pool (under the others they "
            "would be every running task's); run the worker with --pool prefork"
        )
    if cwd is not None and not os.path.isdir(cwd):
        return (
            f"{CWD_PATH} {cwd!r} is not a directory on this worker (Flux RFC 25 §Attributes); "
            "create it on every worker of the queue, or give a directory that exists there"
        )
    return None
