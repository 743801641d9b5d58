"""What the chaos campaign found, from outside: jobs, attempts, overlaps, recovery times.

Every figure comes from records the faults cannot touch: the ledger's attempt events
(`bench.chaos_app.note`) and the result backend (both on the ledger server), the
store's dead letters, and the injector's fault log.

* An attempt spans from its `start` to its last event (`progress` after a committed
  checkpoint, or `end`): what it did that counts. Two attempts of one job overlap when
  their spans intersect.
* A job completed more than once when more than one attempt reached `end`.
* Recovery after a fault: seconds from the fault to the next job completion anywhere,
  and, for a fault on a worker, to the next start of each job that was running there
  (the lease takeover and re-placement).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from bench.chaos_faults import KINDS, Fault

CHECKPOINTED = ("train",)


def attempts(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per job, its attempts (start, last, ended, worker, pid, counters), by start time."""
    found: dict[str, dict[str, Any]] = {}
    for ev in sorted(events, key=lambda e: e["t"]):
        a = found.setdefault(
            ev["attempt"],
            {"job": ev["job"], "attempt": ev["attempt"], "start": ev["t"], "ended": False,
             "worker": ev.get("worker"), "pid": ev.get("pid"), "crashes": ev.get("crashes"),
             "preemptions": ev.get("preemptions"), "grant": ev.get("grant")},
        )  # fmt: skip
        a["last"] = ev["t"]
        a["ended"] = a["ended"] or ev["ev"] == "end"
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in found.values():
        by_job[a["job"]].append(a)
    return {job: sorted(runs, key=lambda a: a["start"]) for job, runs in by_job.items()}


def overlapping(runs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of attempts of one job whose spans intersect."""
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1 :]:
            if (b["start"] < a["last"] and a["start"] < b["last"]) or b["start"] == a["start"]:
                pairs.append((a, b))
    return pairs


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def recovery(
    faults: list[Fault], events: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Per fault kind: seconds to the next completion, and to each interrupted job's next
    start (kills, stalls, partitions) or the next leader (leader kills)."""
    ends = sorted(e["t"] for e in events if e["ev"] == "end")
    out: dict[str, Any] = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind and f.t is not None]
        completion = [n - f.t for f in mine if f.t and (n := _next(ends, f.t)) is not None]
        takeover: list[float] = []
        for f in mine:
            takeover += _takeovers(f, runs)
        entry = {"count": len(mine), "next_completion_s": _stats(completion)}
        if kind in ("kill", "stall", "partition"):
            entry["interrupted_job_restart_s"] = _stats(takeover)
        if kind == "leader":
            entry["new_leader_s"] = _stats([f.end - f.t for f in mine if f.end and f.t])
        if kind in ("store", "broker"):
            entry["down_s"] = _stats([f.detail.get("down_s", 0.0) for f in mine])
        out[kind] = entry
    return out


def _next(times: list[float], after: float | None) -> float | None:
    return next((t for t in times if after is not None and t > after), None)


def _takeovers(fault: Fault, runs: dict[str, list[dict[str, Any]]]) -> list[float]:
    """Seconds from a fault on a worker to the next start of each job running there."""
    t, host = fault.t or 0.0, f"{fault.worker}@chaos"
    found = []
    for job_runs in runs.values():
        before = [a for a in job_runs if a["start"] <= t]
        if not before or before[-1]["worker"] != host:
            continue
        if before[-1]["ended"] and before[-1]["last"] <= t:
            continue
        later = [a["start"] for a in job_runs if a["start"] > t]
        if later:
            found.append(min(later) - t)
    return found


def summarise(
    jobs: dict[str, dict[str, Any]],
    events: list[dict[str, Any]],
    states: dict[str, dict[str, Any]],
    dead: dict[str, str],
) -> dict[str, Any]:
    """Published, completed, failed (with reasons), lost, overlaps, double completions."""
    runs = attempts(events)
    by_kind: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    failed, lost, overlaps, doubles = [], [], [], []
    for job, meta in jobs.items():
        kind = meta["kind"]
        counts = by_kind[kind]
        counts["published"] += 1
        state = states.get(job, {}).get("status")
        job_runs = runs.get(job, [])
        counts["reruns"] += max(0, len(job_runs) - 1)
        if state == "SUCCESS":
            counts["completed"] += 1
        elif state is not None or job in dead:
            counts["failed"] += 1
            reason = dead.get(job) or str(states[job].get("result"))[:300]
            failed.append({"job": job, "kind": kind, "state": state, "reason": reason})
        else:
            counts["lost"] += 1
            lost.append({"job": job, "kind": kind, "band": meta.get("band"), "attempts": job_runs})
        for a, b in overlapping(job_runs):
            overlaps.append({"job": job, "kind": kind, "attempts": [a, b]})
        ended = sum(a["ended"] for a in job_runs)
        if ended > 1:
            counts["double_completions"] += 1
            doubles.append({"job": job, "kind": kind, "attempts": job_runs})
    unknown = sorted(set(runs) - set(jobs))
    return {
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "published": len(jobs),
        "completed": sum(v["completed"] for v in by_kind.values()),
        "failed": failed,
        "lost": lost,
        "overlaps": overlaps,
        "double_completions": doubles,
        "ran_but_not_published": unknown,
        "granted_attempts": sum(bool(a["grant"]) for r in runs.values() for a in r),
        "preempted_attempts": sum(bool(a["preemptions"]) for r in runs.values() for a in r),
    }


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """The targets: nothing lost, no overlapping attempts, checkpointed jobs complete once."""
    ckpt_doubles = [d for d in summary["double_completions"] if d["kind"] in CHECKPOINTED]
    checks = {
        "lost": len(summary["lost"]),
        "overlapping_attempts": len(summary["overlaps"]),
        "checkpointed_double_completions": len(ckpt_doubles),
        "ran_but_not_published": len(summary["ran_but_not_published"]),
        "failed": len(summary["failed"]),
    }
    return {**checks, "pass": not any(checks.values())}


def table(report: dict[str, Any]) -> str:
    """The report as text tables."""
    s = report["summary"]
    lines = [
        f"chaos campaign: {report['minutes']} min, seed {report['seed']}, "
        f"{report['workers']} workers, topology {report['topology']}, "
        f"wall {report['wall_s']:.0f} s",
        "",
        f"{'kind':<8}{'published':>10}{'completed':>10}{'failed':>8}{'lost':>6}"
        f"{'re-runs':>9}{'completed twice':>17}",
    ]
    for kind, c in s["by_kind"].items():
        lines.append(
            f"{kind:<8}{c.get('published', 0):>10}{c.get('completed', 0):>10}"
            f"{c.get('failed', 0):>8}{c.get('lost', 0):>6}{c.get('reruns', 0):>9}"
            f"{c.get('double_completions', 0):>17}"
        )
    lines += ["", f"{'fault':<10}{'count':>6}  {'next completion s':<20}other"]
    for kind, r in report["recovery"].items():
        lines.append(f"{kind:<10}{r['count']:>6}  {_pair(r['next_completion_s']):<20}" + ", ".join(
            f"{k} {_pair(v)}" for k, v in r.items() if k not in ("count", "next_completion_s")
        ))  # fmt: skip
    exits = report.get("worker_exits", [])
    lines += ["", f"workers that exited on their own (started again): {len(exits)}"]
    lines += [f"  {e['worker']}: {e['why'][:140]}" for e in exits[:10]]
    v = report["verdict"]
    lines += [
        "",
        f"lost {v['lost']}, overlapping attempts {v['overlapping_attempts']}, checkpointed jobs "
        f"completed twice {v['checkpointed_double_completions']}, failed {len(s['failed'])}: "
        + ("PASS" if v["pass"] else "FAIL"),
    ]
    for f in s["failed"][:10]:
        lines.append(f"  failed {f['job']} ({f['kind']}): {f['reason']}")
    return "\n".join(lines)


def _pair(stats: dict[str, Any]) -> str:
    """`median/max` of a `_stats` entry, or `-`."""
    return f"{stats['median']}/{stats['max']}" if stats.get("n") else "-"
