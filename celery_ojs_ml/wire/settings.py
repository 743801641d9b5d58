"""`ojs_ml_*` settings, read once from `app.conf` into a typed, cached model.

Key decision (after celery-redbeat): every setting is namespaced, validated at
start-up, and a bad value fails with the list of valid values, so a typo never
silently turns a feature off.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from celery_ojs_ml.errors import ConfigError
from celery_ojs_ml.spec.bounds import Bounds
from celery_ojs_ml.spec.envelope import ParseOptions
from celery_ojs_ml.spec.policy import QueuePolicy

RestoreMode = Literal["committed", "own_directory"]
"""`ojs_ml_checkpoint_restore`: what an `ojs_last_checkpoint` header must be to be restored."""
PREFIX = "ojs_ml_"
_BOUND_FIELDS = tuple(Bounds.__dataclass_fields__)


class OJSMLSettings(BaseModel):
    """Every `ojs_ml_*` setting with its default (docs/settings.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    store_url: str | None = None
    """Redis URL of the plugin's store; defaults to the broker URL when that is Redis."""
    store_prefix: str = "ojs"
    """Key prefix in the store."""
    store_transport_options: dict[str, Any] = Field(default_factory=dict)
    """Connection options of the store (`store.connect`): for a `sentinel://` URL
    `master_name` (required), `sentinel_kwargs`, ..., as kombu's `broker_transport_options`."""
    store_wait_replicas: int = Field(default=0, ge=0, le=16)
    """After the writes a failover must not undo, wait until this many replicas hold them
    (Redis WAIT, at most `store_wait_timeout_ms`); 0: do not wait."""
    store_wait_timeout_ms: int = Field(default=100, ge=1, le=5000)
    """Longest `store_wait_replicas` waits; short of them the plugin logs and goes on."""
    deny_unsatisfiable: bool = False
    """RFC 27 DENY: raise at publish when no live worker could ever run the job, and deny
    (fail and dead-letter) a waiting job once every worker that could run it has been gone
    `deny_after_s`."""
    deny_after_s: float = Field(default=300.0, gt=0, le=7 * 86400.0)
    """With `deny_unsatisfiable`: how long the workers that could run a waiting job may be
    gone (left the fleet) before the scheduler denies it; one back within it saves the job."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """Seconds between worker advertisements; the TTL is three heartbeats."""
    subscription_poll_s: float = Field(default=0.5, gt=0)
    """How often a worker looks for newly registered requirement classes."""
    max_hold_s: float = Field(default=10.0, gt=0)
    """Longest a worker holds a message that no longer fits before requeueing it."""
    recycle_gpu_children: Literal["warm", "cuda", "always", "never"] = "warm"
    """GPU prefork workers: keep children warm, bound to their devices ("warm"), retire
    children that initialised CUDA ("cuda"), every child ("always"), or none ("never")."""
    require_pinning: bool = False
    """Refuse to start a GPU worker whose pool cannot pin devices (anything but prefork)."""
    pin_cpus: bool = True
    """Prefork: run each ML job that asks for `ext_ml_cpu_cores` on that many CPUs of its
    own (`worker.cpu_cores`); the pool child gets the worker's CPUs back after the job."""
    limit_memory: bool = True
    """Prefork: bound the address space of a job without GPUs or TPU chips by its
    `ext_ml_memory_gb` (`child.limits`); past it the job fails with a MemoryError naming it."""
    lease_ttl_s: float = Field(default=30.0, gt=0)
    """A running ML job's lease expires this long after its worker's last heartbeat."""
    lease_write_delay_ms: float = Field(default=20.0, ge=0, le=1000)
    """On a busy worker, how long a new lease waits to share one batched write (idle: 2 ms)."""
    max_header_bytes: int = Field(default=65536, ge=1024)
    """Largest `ext_ml_*` headers (and `ojs_last_checkpoint`) a worker accepts in one message."""
    max_crashes: int = Field(default=3, ge=0)
    """Re-publish a job whose worker died at most this often, then dead-letter it."""
    max_preemptions: int | None = Field(default=None, ge=0)
    """Past this many preemptions a job is no longer preemptible (None: no cap)."""
    allow_on_demand_preemption: bool = False
    """Let reserved jobs preempt preemptible on-demand jobs (spot is always preemptible)."""
    checkpoint_storage_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """URI prefix -> fsspec storage options for checkpoint payloads (docs/checkpoint.md)."""
    checkpoint_restore: RestoreMode = "committed"
    """Restore an `ojs_last_checkpoint` header only when the store committed it (OJS ML §15.3)."""
    locality_weight: int = Field(default=50, ge=0, le=100)
    """Weight of model locality in the 0-100 score (§11.3)."""
    scheduler: Literal["auto", "thread", "off"] = "auto"
    """Stand for election as the fleet scheduler: "auto" in a child process (a thread where
    the app has no import path or the broker is memory://), "thread" in the worker's main
    process, "off" never."""
    prefetch: int = Field(default=2, ge=0, le=64)
    """Jobs the scheduler may deliver to a worker ahead of free capacity, to wait at its gate
    and start the moment a job there ends (0: off). They are the next jobs in fleet order
    planned on that worker, only while it has no free GPU and each fits in what any one
    running job there frees (`leader.prefetch`)."""
    pipeline: bool = True
    """With warm children (`ojs_ml_recycle_gpu_children = "warm"`, prefork): a job that
    would wait at the gate, whose requirements equal those of a job running here, is
    written to that job's child behind it, and takes its devices as it ends
    (`worker.pipelining`). The child starts it as it returns the running job's result.
    False: a held job is written to its child only when the running job's result has
    come back and its devices are free."""
    grants: bool = True
    """Throughput mode. While nothing waits, the scheduler grants a class of simple jobs
    to the worker it placed the last one on, and publishers send the class's next jobs
    straight to that worker's queue (`scheduler.grants`): no pass per job, and the
    class's backlog queues on the holder as in plain Celery. Revoked, with the queued
    jobs taken back into the pending set, the moment a job waits, another worker could
    start one of the class, the holder leaves, or a job sent under it has waited there
    `grant_wait_s`. Needs a Redis broker that is also the store; off with fair-share
    weights, and for queues with budgets (docs/scheduling.md). False: one scheduler
    decision per job."""
    grant_wait_s: float = Field(default=1.0, gt=0, le=60)
    """Longest a job sent under a grant waits on its holder, queued or held at the gate,
    before it goes back to the scheduler (and the grant ends): a job that waits longer
    is ordered, annotated and placed by the scheduler as any other."""
    model_registry_access: bool = False
    """Advertise `model_registry_access: true` (§4): this worker can fetch any model version,
    so jobs pinned to a version it has not loaded may run here. Default: only loaded ones."""
    gpu_sharing: Literal["off", "vram"] = "off"
    """"vram": jobs that opt in with `ojs_ml_gpu_share` share this worker's GPUs, each
    taking milli-GPU of one device by VRAM or fraction (docs/sharing.md); "off": whole GPUs."""
    reservation_depth: int = Field(default=1, ge=1, le=1000)
    """How many blocked jobs, first in fleet order, hold a reservation (backfill guard)."""
    min_runtime_before_preemption_s: float = Field(default=60.0, ge=0)
    """A running job younger than this is never preempted (Slurm's PreemptExemptTime)."""
    leader_ttl_s: float = Field(default=5.0, gt=0.5, le=300)
    """The scheduler lock's TTL: another worker takes over this long after the leader dies."""
    assignment_timeout_s: float = Field(default=15.0, gt=0)
    """An assignment its worker has not taken within this is taken back and reassigned."""
    scheduler_interval_s: float = Field(default=0.5, gt=0, le=60)
    """Longest gap between two scheduling passes (wake-ups start one at once)."""
    estimate_depth: int = Field(default=2000, ge=0, le=1_000_000)
    """How many blocked jobs, first in fleet order, a full pass gives a start estimate
    (Slurm's bf_max_job_test); the rest wait with `t_estimate` unknown."""
    drain_defer_s: float = Field(default=3600.0, ge=0, le=86_400.0)
    """A job with a time limit whose start now would keep a large worker from draining
    4 h or more longer is decided after the other jobs of a pass, then preferring a place
    that holds no drain, until it has waited this long (`scheduler.defer`); 0: never."""
    queue_depth: int = Field(default=100, ge=1, le=1_000_000)
    """How many waiting jobs, first in fleet (or fair) order, a pass decides between full
    passes (Slurm's default_queue_depth); the rest wait for the next full pass."""
    full_pass_s: float = Field(default=1.0, gt=0, le=3600)
    """How often a pass decides every waiting job (backfill deep in the queue, annotations)."""
    reservation_timeout_s: float = Field(default=3600.0, gt=0)
    """How long `ml.reserve` holds a reservation when neither `timeout_s` nor the
    requirements' `ext_ml_reservation_timeout_s` says (OJS ML §8.3)."""
    max_reservation_s: float = Field(default=7 * 86400.0, gt=0)
    """Longest any reservation is held: caps `timeout_s` and a job's extension."""
    model_cache_size: int = Field(default=2, ge=1, le=1000)
    """Models one pool child keeps loaded (`ml.model`), least recently used evicted first."""
    model_cache_vram_gb: float | None = Field(default=None, gt=0)
    """Declared VRAM (`vram_gb=`) one pool child's models may add up to, and at most the
    running job's VRAM; None: the job's VRAM only (child/models.py evicts before loading)."""
    fair_share: dict[str, float] = Field(default_factory=dict)
    """Queue -> weight: GPUs are shared between competing queues in proportion to their
    weights (weighted max-min within each band; unlisted queues weigh 1)."""
    fair_share_half_life_s: float = Field(default=0.0, ge=0, le=90 * 86400.0)
    """With `fair_share` weights: each queue's GPU use also counts, decayed with this
    half-life (Slurm's fair-share factor), so a queue that held more than its share gives
    way until its use decays; 0: only the GPUs held now count."""
    advertise_address: str | None = None
    """The address this worker advertises for gangs: `MASTER_ADDR` when it holds rank 0
    (None: the host's primary address)."""
    queue_policies: dict[str, QueuePolicy] = Field(default_factory=dict)
    """Queue name -> {ml_defaults, ml_limits} (OJS ML §10)."""
    bounds: dict[str, Any] = Field(default_factory=dict)
    """Upper bounds and allow-lists (§15), collected from `ojs_ml_max_*` etc."""

    @field_validator("fair_share")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {q: w for q, w in value.items() if not w > 0}
        if bad:
            raise ValueError(f"fair_share weights must be > 0, got {bad}; e.g. {{'train': 2}}")
        return value

    @model_validator(mode="after")
    def _half_life_needs_weights(self) -> OJSMLSettings:
        if self.fair_share_half_life_s > 0 and not self.fair_share:
            raise ValueError(
                "fair_share_half_life_s needs fair_share weights (it decays their usage); "
                "set ojs_ml_fair_share, e.g. {'a': 1, 'b': 1}, or the half-life to 0"
            )
        return self

    @field_validator("recycle_gpu_children", mode="before")
    @classmethod
    def _recycle_from_bool(cls, value: Any) -> Any:
        """True means the safe default ("cuda"), False means "never"."""
        if isinstance(value, bool):
            return "cuda" if value else "never"
        return value

    @cached_property
    def defaulted_queues(self) -> frozenset[str]:
        """Logical queues whose policy sets `ml_defaults`: every task sent there is an ML job."""
        return frozenset(q for q, p in self.queue_policies.items() if p.ml_defaults)

    def parse_options(self) -> ParseOptions:
        """The validator options these settings imply."""
        return ParseOptions(bounds=make_bounds(self.bounds), policies=self.queue_policies)


def make_bounds(values: Mapping[str, Any]) -> Bounds:
    """A `Bounds` from setting values; sets become frozensets, lists tuples."""
    converted: dict[str, Any] = {}
    for key, value in values.items():
        default = getattr(Bounds(), key)
        if isinstance(value, str) and (default is None or isinstance(default, frozenset | tuple)):
            raise ConfigError(
                f"{PREFIX}{key} must be a list, not the string {value!r}; "
                f"e.g. app.conf.{PREFIX}{key} = [{json.dumps(value)}]"
            )
        if isinstance(default, frozenset) or (default is None and value is not None):
            converted[key] = frozenset(value)
        elif isinstance(default, tuple):
            converted[key] = tuple(value)
        else:
            converted[key] = value
    return Bounds(**converted)


def read_settings(conf: Mapping[str, Any]) -> OJSMLSettings:
    """Collect `ojs_ml_*` keys from a Celery config and validate them."""
    raw = {k[len(PREFIX) :]: v for k, v in conf.items() if k.startswith(PREFIX) and v is not None}
    bounds = {k: raw.pop(k) for k in list(raw) if k in _BOUND_FIELDS}
    known = set(OJSMLSettings.model_fields) - {"bounds"}
    unknown = sorted(set(raw) - known)
    if unknown:
        valid = sorted(PREFIX + k for k in (*known, *_BOUND_FIELDS))
        raise ConfigError(f"unknown setting(s) {[PREFIX + k for k in unknown]}; valid: {valid}")
    try:
        make_bounds(bounds)
        return OJSMLSettings(**raw, bounds=bounds)
    except ConfigError:
        raise
    except (ValidationError, TypeError, ValueError) as exc:
        raise ConfigError(f"invalid ojs_ml_* setting: {exc}") from None
