"""Every `ojs_*` message header the plugin reads or writes, defined once.

Key decision: a header is either a public input (the job's declared labels and
logical queue, the `ojs_ml_*` requirement keys) or plugin-private. Private
headers are set only by the plugin's own code: the router strips them from
every producer message (`strip_private`), and only a publish inside
`plugin_publish()` (a re-publish, a gang's ranks) keeps them. The groups below
are the one source for every strip list.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

# -- public inputs: a producer may set these ----------------------------------------------
LOGICAL = "ojs_logical_queue"
"""The job's logical queue (its policy, budgets and defaults)."""
LABELS = "ojs_labels"
"""A job's own labels (OJS ML §7.3), named by other jobs' affinity rules."""
CWD = "ojs_cwd"
"""A Flux jobspec's `attributes.system.cwd`: the pool child runs the task there
(`child.run_env`); the gate refuses one that is not a directory (`worker.run_env`)."""
ENVIRONMENT = "ojs_environment"
"""A Flux jobspec's `attributes.system.environment`, set in the pool child for the run
only; checked again by the gate (`spec.flux_env`)."""

# -- set by the router at publish ---------------------------------------------------------
CLASS = "ojs_class"
"""The job's requirement class: the hash of its hard constraints."""
BAND = "ojs_band"
"""The job's priority band."""
PENDING = "ojs_pending"
"""Why no live worker could run the job at publish."""
GANG = "ojs_gang"
"""A gang rank's {id, size, rank}."""
GRANT = "ojs_grant"
"""The grant epoch a job was published under, straight to the grant's holder."""
GRANT_AT = "ojs_grant_at"
"""When a granted job was published (the leader's grant-wait check)."""

# -- set by the leader on one delivery ----------------------------------------------------
ASSIGN = "ojs_assign"
"""The assignment's token; the gate starts the job only while it is current."""
VICTIMS = "ojs_victims"
"""The running jobs an assignment preempts."""
PREFETCH = "ojs_prefetch"
"""An assignment sent ahead of the capacity it waits for."""
RENDEZVOUS = "ojs_rendezvous"
"""A gang placement's rendezvous (address, port, ranks)."""
SUBMITTED = "ojs_submitted_at"
"""When the job was admitted (its pending record's `submitted_at`): the gate's
`ojs-started` event reports the wait from it."""

# -- set by the worker's gate for its pool child ------------------------------------------
DEVICES = "ojs_devices"
NODE = "ojs_node"
PIN = "ojs_pin"
LEASE = "ojs_lease"
SHARE = "ojs_gpu_share"
TPU_CHIPS = "ojs_tpu_chips"
"""The TPU chip indices of the run (`worker.tpu_chips`); the child pins them (`child.tpu_env`)."""
BATCH = "ojs_batch"
"""The other requests a batched call carries (`wire.batch`), on its first request."""
CPUS = "ojs_cpus"
"""The CPU ids the run's pool child is pinned to (`worker.cpu_cores`, `child.limits`)."""
MEMORY_LIMIT = "ojs_memory_limit"
"""The `ext_ml_memory_gb` the child bounds the run's address space by (`child.limits`)."""

# -- carried across the plugin's own re-publishes -----------------------------------------
CRASHES = "ojs_crashes"
PREEMPTIONS = "ojs_preemptions"
LAST_CHECKPOINT = "ojs_last_checkpoint"

# -- store and broker records -------------------------------------------------------------
MSG = "ojs_msg"
WAKE = "ojs_wake"

GATE = (DEVICES, NODE, PIN, LEASE, SHARE, TPU_CHIPS, BATCH, CPUS, MEMORY_LIMIT)
"""What the gate computes for each run; never taken from a message."""
DELIVERY = (ASSIGN, VICTIMS, PREFETCH, RENDEZVOUS, GRANT, GRANT_AT, SUBMITTED)
"""Set for one delivery; a new publish is delivered afresh."""
REPUBLISH_DROPS = frozenset(
    (DEVICES, NODE, PIN, LEASE, ASSIGN, VICTIMS, PREFETCH, PENDING, CLASS, BAND, TPU_CHIPS)
).union((BATCH, CPUS, MEMORY_LIMIT))
"""Left out of a job's record (lease, dead letter, re-publish): set again for each run. A
lease keeps `ojs_grant` (the leader's grant wait reads it) and `ojs_rendezvous` (a gang
rank's crash handling reads it); a new publish drops both (`DELIVERY`), and the gate
computes the share again (`GATE`)."""
COUNTERS = (CRASHES, PREEMPTIONS)
PRIVATE = frozenset(
    (*GATE, *DELIVERY, PENDING, CLASS, BAND, GANG, *COUNTERS, LAST_CHECKPOINT, MSG, WAKE)
)
"""Every header only the plugin may set."""

_TRUSTED = threading.local()


@contextmanager
def plugin_publish() -> Iterator[None]:
    """Mark this thread's publishes as the plugin's own: their private headers are kept."""
    depth = getattr(_TRUSTED, "depth", 0)
    _TRUSTED.depth = depth + 1
    try:
        yield
    finally:
        _TRUSTED.depth = depth


def trusted() -> bool:
    """True inside `plugin_publish()`."""
    return getattr(_TRUSTED, "depth", 0) > 0


def strip_private(headers: MutableMapping[str, Any]) -> list[str]:
    """Remove the private headers a producer set; returns their names (for the log)."""
    found = [k for k in headers if k in PRIVATE]
    for key in found:
        del headers[key]
    return found
