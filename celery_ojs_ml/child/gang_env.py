"""A gang rank in its pool child: torch.distributed's `env://` around the task body.

Key decision: the leader's `ojs_rendezvous` header (`wire.headers.RENDEZVOUS`)
becomes `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE`, `RANK`, `LOCAL_RANK` and
`LOCAL_WORLD_SIZE` for the rank's run only, and the environment is put back
after it; one rank per worker, so `LOCAL_RANK` is 0 and `LOCAL_WORLD_SIZE` 1.
A rank runs with `ignore_result` (a failure that re-places its gang stores
nothing), so its success is stored here (`store_rank_result`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.wire.headers import RENDEZVOUS

ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def env_of(found: Any) -> dict[str, str]:
    """The launcher environment of an `ojs_rendezvous` header ({} when it is not one)."""
    if not isinstance(found, Mapping):
        return {}
    try:
        return {
            "MASTER_ADDR": str(found["master_addr"]),
            "MASTER_PORT": str(int(found["master_port"])),
            "WORLD_SIZE": str(int(found["world_size"])),
            "RANK": str(int(found["rank"])),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
    except (KeyError, TypeError, ValueError):
        return {}


def set_env(request: Any) -> None:
    """`task_prerun`: export the rendezvous of a gang rank, remembering what was there."""
    env = env_of(getattr(request, RENDEZVOUS, None))
    if env:
        request.ojs_saved_env = {k: os.environ.get(k) for k in ENV_KEYS}
        os.environ.update(env)


def restore_env(request: Any) -> None:
    """`task_postrun`: put the environment back as it was before the rank ran."""
    saved = getattr(request, "ojs_saved_env", None)
    if not isinstance(saved, dict):
        return
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def is_rank(request: Any) -> bool:
    """Whether a task's request is a gang rank's (it carries the gang's rendezvous)."""
    return request is not None and isinstance(getattr(request, RENDEZVOUS, None), Mapping)


def store_rank_result(sender: Any = None, result: Any = None, **_: Any) -> None:
    """A gang rank's success, stored in the pool child (from its `task_postrun` hook,
    `child.hooks.child_postrun`). Takes `task_success`'s arguments."""
    request: Any = getattr(sender, "request", None)
    if is_rank(request):
        sender.backend.store_result(request.id, result, "SUCCESS", request=request)
