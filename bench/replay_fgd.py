"""`bench/replay.py --mode fgd`: the GPU allocation rate of a policy, as FGD measures it.

Methodology (Weng et al., ATC'23; `hkust-adsl/kubernetes-scheduler-simulator`),
written down in docs/performance.md:

* the cluster is the 1,213 GPU nodes of `openb_node_list_gpu_node.csv`;
* the workload is the pod list shuffled with the seed (`--order creation`: in
  creation order), inflated to 130% of the cluster's GPU capacity (milli-GPU) by
  appending pods drawn uniformly, with replacement, from the same list (seeded);
* pods are placed one at a time, none departs; a pod that fits nowhere fails
  and later pods still try; pods without GPUs take CPU and memory only;
* the allocation rate (allocated milli-GPU / capacity) is read when the arrived
  load (milli-GPU of every pod so far, placed or not) first reaches 80, 90, ...
  130% of capacity.

Which GPU of a node a pod takes is the live allocator's own rule
(`celery_ojs_ml.allocator.sharing.place`) for every policy; the policies only
choose the node. Nodes in the same state (model, free CPU, free memory, free
milli per GPU) are interchangeable, so they are grouped and each policy scores
a state once per pod, not each node: the result is the same, only faster.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator, Sequence

from bench.trace import Node, Pod
from celery_ojs_ml.allocator.sharing import FULL, after, place
from celery_ojs_ml.scheduler.frag import Kind as FragKind
from celery_ojs_ml.scheduler.model import DEFAULT_POLICY
from celery_ojs_ml.scheduler.score import Workload, placement
from celery_ojs_ml.scheduler.vectors import INF

_UNSEEN: tuple[int, ...] = (-1,)
LOADS = (80, 90, 100, 110, 120, 130)
TUNE = 1.3

Gpus = tuple[int, ...]
State = tuple[str, int, int, Gpus]
"""(GPU model, free CPU milli, free memory MiB, free milli per GPU sorted high to low)."""
Kind = tuple[int, int, int, int, frozenset[str]]


Totals = tuple[int, int, int]
"""A node type's capacity (CPU milli, memory MiB, GPUs), what BestFit normalises by."""


class Group:
    """The nodes in one state, and what each pod kind would take on them (memo)."""

    __slots__ = ("fit", "nodes", "score", "state", "totals")

    def __init__(self, state: State, totals: Totals) -> None:
        self.state = state
        self.totals = totals
        self.nodes: list[int] = []
        self.fit: dict[int, tuple[int, ...] | None] = {}
        self.score: dict[int, float] = {}
        """A policy's score of each pod kind here (the state never changes: a memo)."""


Option = tuple[Group, tuple[int, ...]]
"""A group where a pod fits and the devices it would take there."""


def workload(pods: Sequence[Pod], capacity: int, rng: random.Random, order: str) -> list[Pod]:
    """The pods in replay order, tuned to `TUNE` x capacity as the FGD artifact does.

    `order="shuffle"` (the artifact's `--shuffle-pod=true`): the trace pods in a
    seeded random order; `"creation"`: in creation-time order. Then, below
    target, pods drawn with replacement from the trace are appended; above it,
    pods picked at random are removed (module doc). The stop test keeps the
    artifact's own quirk: it adds a pod's per-GPU milli, not its total.
    """
    out = list(pods)
    if order == "shuffle":
        rng.shuffle(out)
    total = sum(p.gpu_total for p in out)
    target = TUNE * capacity
    if total < target:
        while True:
            pod = pods[rng.randrange(len(pods))]
            if total + pod.gpu_milli > target:
                break
            out.append(pod)
            total += pod.gpu_total
    while total > target:
        total -= out.pop(rng.randrange(len(out))).gpu_total
    return out


class Cluster:
    """Nodes grouped by state (module doc); a placement moves one node to a new state."""

    def __init__(self, nodes: Sequence[Node], rank: Sequence[int]) -> None:
        self.rank = rank
        """Each node's place in the tie-break order (the artifact's random node names)."""
        self.groups: dict[tuple[State, Totals], Group] = {}
        for i, n in enumerate(nodes):
            self._add(
                i,
                (n.model, n.cpu_milli, n.memory_mib, (FULL,) * n.gpus),
                (n.cpu_milli, n.memory_mib, n.gpus),
            )
        self.capacity = sum(n.gpus for n in nodes) * FULL
        self.allocated = 0

    def _add(self, node: int, st: State, totals: Totals) -> None:
        group = self.groups.get((st, totals))
        if group is None:
            group = self.groups[(st, totals)] = Group(st, totals)
        bisect.insort(group.nodes, node, key=self.rank.__getitem__)

    def options(self, kind: Kind, kid: int) -> list[Option]:
        """Every group where a pod of `kind` (id `kid`) fits, with the devices it takes."""
        out = []
        for group in self.groups.values():
            fit = group.fit
            devices = fit.get(kid, _UNSEEN)
            if devices is _UNSEEN:
                devices = fit[kid] = fits(group.state, kind)
            if devices is not None:
                out.append((group, devices))
        return out

    def take(self, group: Group, kind: Kind, devices: tuple[int, ...]) -> None:
        """Place a pod of `kind` on the first node of `group` in tie-break order."""
        node = group.nodes.pop(0)
        if not group.nodes:
            del self.groups[(group.state, group.totals)]
        model, cpu, mem, gpus = group.state
        need_cpu, need_mem, count, milli, _ = kind
        left = tuple(sorted(after(gpus, devices, milli), reverse=True)) if count else gpus
        self._add(node, (model, cpu - need_cpu, mem - need_mem, left), group.totals)
        self.allocated += count * milli


def fits(st: State, kind: Kind) -> tuple[int, ...] | None:
    """The devices `kind` takes on a node in `st` (allocator rule), None if it cannot."""
    model, cpu, mem, gpus = st
    need_cpu, need_mem, count, milli, spec = kind
    if need_cpu > cpu or need_mem > mem or (spec and model not in spec):
        return None
    return place(gpus, count, milli) if count else ()


def run(
    nodes: Sequence[Node], pods: Sequence[Pod], choose: Chooser, rank: Sequence[int]
) -> dict[str, float]:
    """Place `pods` in order with `choose`; the allocation rate (%) at each arrived load."""
    events: dict[int, list[float]] = {}
    for arrived, rate in placements(nodes, pods, choose, rank):
        events.setdefault(round(arrived), []).append(rate)
    return {str(k): _bucket(events, k) for k in LOADS}


def placements(
    nodes: Sequence[Node], pods: Sequence[Pod], choose: Chooser, rank: Sequence[int]
) -> Iterator[tuple[float, float]]:
    """After each pod (placed or failed): (arrived load %, allocation rate %)."""
    cluster = Cluster(nodes, rank)
    arrived = 0
    kinds: dict[Kind, int] = {}
    for pod in pods:
        kind = pod.kind
        kid = kinds.setdefault(kind, len(kinds))
        arrived += pod.gpu_total
        options = cluster.options(kind, kid)
        if options:
            group, devices = choose(cluster, kind, kid, options)
            cluster.take(group, kind, devices)
        yield 100 * arrived / cluster.capacity, 100 * cluster.allocated / cluster.capacity


def _bucket(events: dict[int, list[float]], load: int) -> float:
    """The artifact's figure at `load`: the mean rate over events at that rounded load."""
    sel = events.get(load) or [r for k in (load - 1, load, load + 1) for r in events.get(k, [])]
    return round(sum(sel) / len(sel), 2) if sel else float("nan")


Chooser = Callable[[Cluster, Kind, int, list[Option]], Option]
"""A policy: the option a pod of a kind (and its id) takes among those where it fits."""


def random_policy(rng: random.Random) -> Chooser:
    """FGD's `Random`: a node drawn uniformly among those where the pod fits."""

    def choose(cluster: Cluster, kind: Kind, kid: int, options: list[Option]) -> Option:
        return rng.choices(options, [len(g.nodes) for g, _ in options])[0]

    return choose


def bestfit_policy(cluster: Cluster, kind: Kind, kid: int, options: list[Option]) -> Option:
    """FGD's `BestFit`: least weighted CPU and GPU left over, in whole points; ties by node."""
    cpu, _, count, milli, _ = kind
    best, found = None, options[0]
    for option in options:
        group = option[0]
        points = group.score.get(kid)
        if points is None:
            _, cpu_free, _, gpus = group.state
            left = 0.5 * (cpu_free - cpu) / 128000 + 0.5 * (sum(gpus) - count * milli) / 8000
            points = group.score[kid] = float(int((1 - left) * 100))
        key = (-points, cluster.rank[group.nodes[0]])
        if best is None or key < best:
            best, found = key, option
    return found


def project_policy(workload: Workload) -> Chooser:
    """The project's scheduler: `celery_ojs_ml.scheduler.score.placement`, highest wins.

    Ties go to the node ranked first, as the live scheduler's go to the first
    worker in fleet order.
    """
    policy = DEFAULT_POLICY

    def choose(cluster: Cluster, kind: Kind, kid: int, options: list[Option]) -> Option:
        cpu, mem, count, milli, _ = kind
        want = (float(count), float(cpu), float(mem), 0.0, 1.0)
        best, found = None, options[0]
        for option in options:
            group = option[0]
            total = group.score.get(kid)
            if total is None:
                model, cpu_free, mem_free, gpus = group.state
                whole = float(sum(1 for g in gpus if g >= FULL))
                free = (whole, float(cpu_free), float(mem_free), INF, INF)
                totals = (float(group.totals[2]), float(group.totals[0]), group.totals[1], 0.0, 0.0)
                total = group.score[kid] = placement(
                    want,
                    free,
                    totals,
                    0.0,
                    workload,
                    "pack",
                    policy,
                    devices=gpus,
                    milli=milli if count else FULL,
                    model=model,
                ).total
            key = (-total, cluster.rank[group.nodes[0]])
            if best is None or key < best:
                best, found = key, option
        return found

    return choose


def workload_of(pods: Sequence[Pod], nodes: Sequence[Node]) -> Workload:
    """The scheduler's workload for the trace: every kind of pod, as the live pass builds it."""
    models: dict[str, int] = {}
    for n in nodes:
        models[n.model] = models.get(n.model, 0) + n.gpus
    return Workload.of_kinds(
        (
            FragKind(
                p.cpu_milli,
                p.num_gpu,
                p.gpu_milli if p.num_gpu else FULL,
                p.gpu_spec,
                p.memory_mib,
            )
            for p in pods
        ),
        largest=8,
        sizes={n.gpus for n in nodes},
        models=models,
    )
