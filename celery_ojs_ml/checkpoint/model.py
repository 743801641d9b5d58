"""Checkpoint metadata (OJS ML §9.2) and the settings one job checkpoints under (§8.2, §9.1).

Key decisions:
- `CheckpointMeta` is the §9.2 `last_checkpoint` object with its wire names
  (`job_id`, `epoch`, `step`, `loss`, `metrics`, `storage_key`, `created_at`),
  plus three extension fields the helper needs: `sequence` (the commit order),
  `size_bytes` and `files`. It is pydantic so that a `last_checkpoint` coming
  from a message header (untrusted, possibly the v0.1 §4.4 short form) is
  validated the same way as one read back from Redis.
- `CheckpointSettings` is validated when it is built, so a bad
  `ext_ml_checkpoint_storage_uri` fails before any training step runs, with the
  same teaching message the publish-side validator prints.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from celery_ojs_ml.errors import OJSMLError, SpecError, Violation
from celery_ojs_ml.spec import uris
from celery_ojs_ml.spec.normalize import DEFAULT_BOUNDS, Bounds, normalize
from celery_ojs_ml.wire.settings import RestoreMode

STORAGE_URI = "ext_ml_checkpoint_storage_uri"
SETTING_KEYS = (
    "ext_ml_checkpoint_enabled",
    "ext_ml_checkpoint_interval_s",
    STORAGE_URI,
    "ext_ml_checkpoint_max_count",
    "ext_ml_checkpoint_on_preempt",
    "ext_ml_preemption_grace_period_s",
)
"""The attributes a job's checkpoint behaviour depends on (OJS ML §8.2, §9.1)."""
_URI_FIX = "use an allowed scheme, no '..', and a trailing slash, e.g. \"s3://bucket/checkpoints/\""


class CheckpointError(OJSMLError):
    """A checkpoint could not be saved, read or described as asked."""


class CheckpointMeta(BaseModel):
    """One committed checkpoint: the §9.2 `last_checkpoint` schema plus bookkeeping."""

    model_config = ConfigDict(frozen=True, extra="ignore", hide_input_in_errors=True)

    job_id: str = Field(min_length=1)
    """The job (Celery task id) the checkpoint belongs to (§9.1)."""
    epoch: int | None = Field(default=None, ge=0)
    """Epoch number at checkpoint time (§9.1); None for step-only training."""
    step: int | None = Field(default=None, ge=0)
    """Global step number at checkpoint time (§9.1)."""
    loss: float | None = None
    """Training loss at checkpoint time (§9.2); NaN/inf are stored as null."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    """Other training metrics, e.g. {"accuracy": 0.947} (§9.2)."""
    storage_key: str = Field(min_length=1)
    """URI of the payload: `<storage_uri><job id>/<sequence>/` (§9.2, §9.4)."""
    created_at: str | None = None
    """Commit time, RFC 3339 UTC, e.g. "2026-02-19T12:00:00.000Z" (§9.2)."""
    sequence: int | None = Field(default=None, ge=1)
    """Increasing (gaps allowed) within the job, from 1; None for a checkpoint named by URI."""
    size_bytes: int | None = Field(default=None, ge=0)
    """Total payload size in bytes."""
    files: list[str] = Field(default_factory=list)
    """Relative names of the payload files, e.g. ["model.pt", "optim.pt"]."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able record, e.g. for `ojs_last_checkpoint` or an event."""
        out: dict[str, Any] = json.loads(self.to_json())
        return out

    def to_json(self) -> str:
        """The record as compact JSON (the form stored in Redis)."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: bytes | str) -> CheckpointMeta:
        """Parse a record written by `to_json`."""
        return cls.model_validate_json(raw)


def parse_meta(value: Any, job_id: str) -> CheckpointMeta | str:
    """A `last_checkpoint` from a header (dict or JSON text), or the reason it is invalid.

    The v0.1 §4.4 short form (`epoch`, `loss`, `storage_key`) is accepted; a
    missing `job_id` is the current job's.
    """
    if isinstance(value, str | bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return "is not JSON"
    if not isinstance(value, Mapping):
        return f"is a {type(value).__name__}, not an object"
    try:
        return CheckpointMeta.model_validate({"job_id": job_id, **value})
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def build_meta(fields: Mapping[str, Any]) -> CheckpointMeta:
    """A `CheckpointMeta` from save() arguments, with an error that names the bad argument."""
    loss = fields.get("loss")
    clean = dict(fields)
    if isinstance(loss, float) and not math.isfinite(loss):
        clean["loss"] = None
    try:
        json.dumps(clean.get("metrics") or {})
        return CheckpointMeta.model_validate(clean)
    except ValidationError as exc:
        wrong = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        problem = f"has invalid fields ({wrong})"
    except (TypeError, ValueError) as exc:
        problem = f"has metrics that are not JSON values ({exc})"
    raise CheckpointError(
        f"the checkpoint metadata {problem} (OJS ML §9.2); pass plain numbers, e.g. "
        'save(epoch=3, step=1200, loss=float(loss), metrics={"accuracy": float(acc)})'
    )


def utc_timestamp(epoch_s: float) -> str:
    """RFC 3339 UTC with milliseconds, e.g. "2026-02-19T12:00:00.000Z"."""
    moment = datetime.fromtimestamp(epoch_s, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@dataclass(frozen=True, slots=True)
class CheckpointSettings:
    """How one job checkpoints; the defaults are the spec's (OJS ML §8.2, §9.1)."""

    storage_uri: str | None = None
    """`ext_ml_checkpoint_storage_uri`: payload prefix; a missing trailing '/' is added (§9.4)."""
    enabled: bool = False
    """`ext_ml_checkpoint_enabled`: periodic checkpoints, i.e. whether `due()` ever fires."""
    interval_s: float = 300
    """`ext_ml_checkpoint_interval_s`: seconds between periodic checkpoints."""
    max_count: int = 3
    """`ext_ml_checkpoint_max_count`: committed checkpoints kept (FIFO eviction)."""
    on_preempt: bool = False
    """`ext_ml_checkpoint_on_preempt`: the task is expected to save when preempted (§8.2)."""
    grace_period_s: float = 30
    """`ext_ml_preemption_grace_period_s`: time between the request and the forced stop."""
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """fsspec options for the storage URI, e.g. {"client_kwargs": {"endpoint_url": ...}}."""
    bounds: Bounds = DEFAULT_BOUNDS
    """Allowed schemes and prefixes (`ojs_ml_checkpoint_schemes`/`_prefixes`, §15.3)."""
    fsync: bool = True
    """fsync each payload file on `file://` before the commit (power-loss safety)."""
    restore: RestoreMode = "committed"
    """`ojs_ml_checkpoint_restore`: restore a header only if committed (§15.3, `restore.py`)."""

    def __post_init__(self) -> None:
        if self.storage_uri is not None:
            uri = self.storage_uri if self.storage_uri.endswith("/") else self.storage_uri + "/"
            object.__setattr__(self, "storage_uri", uri)
        problems = list(self._violations())
        if problems:
            raise SpecError(problems)

    def check_storage(self, uri: str) -> None:
        """Raise `SpecError` unless checkpoint storage may be opened at `uri`: the allowed
        schemes, prefixes and reach (`uris.checkpoint_problems`, OJS ML §15.3, Extensions
        §12.1). Run at construction and again where the helper opens storage."""
        problems = self._uri_violations(uri)
        if problems:
            raise SpecError(problems)

    def _uri_violations(self, uri: str) -> list[Violation]:
        schemes, prefixes = self.bounds.checkpoint_schemes, self.bounds.checkpoint_prefixes
        return [
            Violation(STORAGE_URI, p.text, p.section, p.fix or _URI_FIX)
            for p in uris.checkpoint_problems(uri, schemes, prefixes)
        ]

    def _violations(self) -> list[Violation]:
        out = []
        if self.storage_uri is not None:
            out += self._uri_violations(self.storage_uri)
        if self.interval_s <= 0:
            out.append(_positive("ext_ml_checkpoint_interval_s", self.interval_s, 300))
        if self.max_count < 1:
            out.append(_positive("ext_ml_checkpoint_max_count", self.max_count, 3))
        return out

    @classmethod
    def from_attrs(
        cls,
        attrs: Mapping[str, Any],
        *,
        bounds: Bounds = DEFAULT_BOUNDS,
        storage_options: Mapping[str, Any] | None = None,
        restore: RestoreMode = "committed",
    ) -> CheckpointSettings:
        """Settings from `ext_ml_*` attributes, validated and defaulted by the normaliser."""
        picked = {k: attrs[k] for k in SETTING_KEYS if attrs.get(k) is not None}
        uri = picked.get(STORAGE_URI)
        if isinstance(uri, str) and uri and not uri.endswith("/"):
            picked[STORAGE_URI] = uri + "/"
        flat = normalize(picked, bounds).flat()
        defaults = cls()
        return cls(
            storage_uri=flat.get(STORAGE_URI),
            enabled=bool(flat.get("ext_ml_checkpoint_enabled", defaults.enabled)),
            interval_s=flat.get("ext_ml_checkpoint_interval_s", defaults.interval_s),
            max_count=flat.get("ext_ml_checkpoint_max_count", defaults.max_count),
            on_preempt=bool(flat.get("ext_ml_checkpoint_on_preempt", defaults.on_preempt)),
            grace_period_s=flat.get("ext_ml_preemption_grace_period_s", defaults.grace_period_s),
            storage_options=dict(storage_options or {}),
            bounds=bounds,
            restore=restore,
        )


def _positive(name: str, value: float, example: int) -> Violation:
    return Violation(name, f"is {value!r}", "OJS ML §9.1", f'use >= 1, e.g. "{name}": {example}')
