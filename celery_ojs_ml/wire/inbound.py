"""Worker side: what the gate accepts from a message before it allocates anything.

Responsibility: turn a message's headers into the requirements the gate
allocates for, or a `BadMessage` with the reason, never anything else. Anyone
who can publish to the broker can put any `ojs_*` or `ext_ml_*` header on a
message, so nothing here trusts them (`InboundCheck.requirements`).

Key decision: parsed requirements are memoised in a bounded LRU keyed by the
`ext_ml_*` headers. The key's length is the size of those headers, so the size
bound costs nothing on the hot path. The `ext_mlx_*` attributes are checked
again too, with the app's artifact allow-lists (OJS ML Extensions §12.1), and
their verdicts memoised the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_ojs_ml.errors import OJSMLError
from celery_ojs_ml.lru import LRU
from celery_ojs_ml.spec.bounds import Bounds
from celery_ojs_ml.spec.classes import class_id
from celery_ojs_ml.spec.mlx import PREFIX as MLX_PREFIX
from celery_ojs_ml.spec.mlx import validate_mlx
from celery_ojs_ml.spec.normalize import normalize
from celery_ojs_ml.spec.resources import PROJECT_KEYS, MLRequirements
from celery_ojs_ml.wire import headers as h

HEADER_CLASS = h.CLASS
GATE_HEADERS = h.GATE
"""Set by the gate on dispatch; a producer's values are forged and dropped."""
COUNTERS = (h.CRASHES, h.PREEMPTIONS, "retries")
"""Counters the worker does arithmetic on later (re-publish, preemption cap)."""
HEADER_LAST = h.LAST_CHECKPOINT
_MAX_COUNTER = 1_000_000
_CACHE_SIZE = 1024


class BadMessage(OJSMLError):
    """A message's OJS ML headers cannot be run; the reason says which and why."""


class InboundCheck:
    """Validates ML messages for one worker (or the leader's intake), with that app's bounds."""

    def __init__(self, bounds: Bounds, max_header_bytes: int) -> None:
        self.bounds = bounds
        self.max_header_bytes = max_header_bytes
        self._cache: LRU[str, tuple[MLRequirements, str]] = LRU(_CACHE_SIZE)
        self._mlx_ok: LRU[str, bool] = LRU(_CACHE_SIZE)
        """`ext_mlx_*` header sets that passed `check_mlx`."""

    def requirements(self, headers: dict[str, Any]) -> MLRequirements | None:
        """The job's requirements, None for a plain task; raises `BadMessage`.

        Requirements are re-validated with the app's own bounds (the same ones the router
        used), the plugin's private headers are dropped (only the gate sets them), and
        the counters and records the plugin reads later are type-checked now, while the
        message can still be refused cleanly instead of failing deep in a timer or a child.
        """
        for key in GATE_HEADERS:
            headers.pop(key, None)
        cid = headers.get(HEADER_CLASS)
        if cid is None:
            return None
        if not isinstance(cid, str) or not cid:
            raise BadMessage(f"header {HEADER_CLASS} must be a class id string, got {cid!r}")
        _check_counters(headers)
        _check_checkpoint(headers, self.max_header_bytes)
        self.check_mlx(headers)
        req, own = self._parse(headers)
        if own != cid:
            raise BadMessage(
                f"header {HEADER_CLASS} {cid!r} does not match the job's ext_ml_* requirements "
                f"(class {own!r}); publish it through the OJS ML router, e.g. "
                "task.apply_async(headers={...}) on an app with OJSML(app)"
            )
        return req

    def check_mlx(self, headers: Mapping[str, Any]) -> None:
        """Raise `BadMessage` unless the `ext_mlx_*` headers pass the validator with the
        app's artifact allow-lists: a producer that skips the router cannot send a
        `file://` or internal-host artifact URI (OJS ML Extensions §12.1)."""
        attrs = {
            k: v for k, v in headers.items() if isinstance(k, str) and k.startswith(MLX_PREFIX)
        }
        if not attrs:
            return
        key = repr(sorted(attrs.items()))
        if self._mlx_ok.get(key):
            return
        b = self.bounds
        try:
            validate_mlx(attrs, uri_schemes=b.artifact_schemes, uri_prefixes=b.artifact_prefixes)
        except OJSMLError as exc:
            raise BadMessage(f"invalid ext_mlx_* attributes: {exc}") from None
        if len(key) <= self.max_header_bytes:
            self._mlx_ok[key] = True

    def parse(self, headers: Mapping[str, Any]) -> MLRequirements:
        """The requirements of trusted headers (a lease's), memoised; raises `BadMessage`."""
        return self._parse(headers)[0]

    def _parse(self, headers: Mapping[str, Any]) -> tuple[MLRequirements, str]:
        """The requirements and their class id (memoised)."""
        # `is_requirement_key`, inlined: this runs on every message's ~30 headers
        attrs = {
            k: v
            for k, v in headers.items()
            if isinstance(k, str) and (k.startswith("ext_ml_") or k in PROJECT_KEYS)
        }
        key = repr(sorted(attrs.items()))
        found = self._cache.get(key)
        if found is not None:
            return found
        if len(key) > self.max_header_bytes:
            raise BadMessage(
                f"the ext_ml_* headers take {len(key)} bytes, over ojs_ml_max_header_bytes "
                f"({self.max_header_bytes}); send large data in the task arguments"
            )
        try:
            req = normalize(attrs, self.bounds).requirements
        except OJSMLError as exc:
            raise BadMessage(f"invalid requirements: {exc}") from None
        found = self._cache[key] = (req, class_id(req))
        return found

    def cache_size(self) -> int:
        """Parsed requirement sets currently memoised (bounded)."""
        return len(self._cache)


def _check_counters(headers: Mapping[str, Any]) -> None:
    for key in COUNTERS:
        value = headers.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_COUNTER:
            raise BadMessage(
                f"header {key} must be an integer from 0 to {_MAX_COUNTER}, got {value!r:.80}"
            )


def _check_checkpoint(headers: Mapping[str, Any], limit: int) -> None:
    value = headers.get(HEADER_LAST)
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise BadMessage(
            f"header {HEADER_LAST} must be a checkpoint record (an object with storage_key "
            f"and job_id), got {type(value).__name__}"
        )
    if len(repr(value)) > limit:
        raise BadMessage(f"header {HEADER_LAST} is over ojs_ml_max_header_bytes ({limit})")
