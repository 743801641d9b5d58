"""Per-worker GPU and resource allocation after Flux RFC 27, pure and clock-injected.

`Allocator` is the state machine; `Allocation`, `Pending` and `Denied` are its
SUCCESS, ANNOTATE and DENY answers. `policy` holds the backfill and victim
rules, `devices` the best-fit choice of GPU indices.
"""

from celery_ojs_ml.allocator.core import Allocator
from celery_ojs_ml.allocator.devices import free_runs, pick_devices
from celery_ojs_ml.allocator.model import Allocation, AllocatorError, Demand, Denied, Pending
from celery_ojs_ml.allocator.policy import choose_victims, is_victim, with_preemption_limits

__all__ = [
    "Allocation",
    "Allocator",
    "AllocatorError",
    "Demand",
    "Denied",
    "Pending",
    "choose_victims",
    "free_runs",
    "is_victim",
    "pick_devices",
    "with_preemption_limits",
]
