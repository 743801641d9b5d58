"""Pool-child side: a Flux job's working directory and environment around its task body.

`task_prerun` changes to the job's `ojs_cwd` and sets its `ojs_environment`
(`wire.headers`; Flux RFC 25 `attributes.system.cwd` and `environment`);
`task_postrun` puts both back as they were, so the next task in the child sees
neither.

Key decisions:
- Applied first and restored last (`child.pinning`): the plugin's own variables
  (devices, TPU chips, a gang's rendezvous) are set after the job's, and the
  job may not name them anyway (`spec.flux_env`); a forged name is dropped here.
- Only under the prefork pool (`ojs_pin`), where the process is the task's;
  the gate refuses such a job elsewhere, and one whose directory is missing
  (`worker.run_env`). A directory removed in between is logged, and the task
  runs where the child was.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.spec.flux_env import environment_of, is_reserved, run_env_problem
from celery_ojs_ml.wire.headers import CWD, ENVIRONMENT, PIN

log = logging.getLogger(__name__)
_SAVED_ENV = "ojs_saved_run_env"
_SAVED_CWD = "ojs_saved_cwd"


def set_run_env(request: Any) -> None:
    """`task_prerun`: change to the job's directory and set its variables."""
    cwd, env = getattr(request, CWD, None), getattr(request, ENVIRONMENT, None)
    if (cwd is None and env is None) or not getattr(request, PIN, False):
        return
    problem = run_env_problem(cwd, env)
    if problem is not None:  # the gate refuses these: a message it did not see
        log.error("ojs-ml: ignoring the cwd and environment of %s: %s", request.id, problem)
        return
    if isinstance(env, Mapping) and env:
        wanted = {k: v for k, v in environment_of(env).items() if not is_reserved(k)}
        setattr(request, _SAVED_ENV, {k: os.environ.get(k) for k in wanted})
        os.environ.update(wanted)
    if isinstance(cwd, str):
        _change_dir(request, cwd)


def _change_dir(request: Any, cwd: str) -> None:
    try:
        before = os.getcwd()
    except OSError:  # the child's own directory is gone: come back to / after
        before = "/"
    try:
        os.chdir(cwd)
    except OSError as exc:
        log.error("ojs-ml: %s runs in %s: cannot change to its cwd %r: %s", request.id,
                  before, cwd, exc)  # fmt: skip
        return
    setattr(request, _SAVED_CWD, before)


def restore_run_env(request: Any) -> None:
    """`task_postrun`: the directory and the variables as they were before the task."""
    saved = getattr(request, _SAVED_ENV, None)
    if isinstance(saved, dict):
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    before = getattr(request, _SAVED_CWD, None)
    if isinstance(before, str):
        try:
            os.chdir(before)
        except OSError as exc:
            log.warning("ojs-ml: cannot change back to %r after %s: %s", before, request.id, exc)
