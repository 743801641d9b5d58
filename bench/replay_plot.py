"""`bench/replay.py --plot FILE.png`: what the scheduler buys, at a glance.

* fgd mode: the GPU allocation rate against arrived load, one panel per
  workload, one line per policy, with the FGD paper's published figure at 130%.
* time mode: the distribution of waits (CDF, log time) per policy at each load.

matplotlib is a bench-only extra (`pip install -e .[bench]`), never a runtime
dependency of the plugin.
"""

from __future__ import annotations

from typing import Any

PAPER_130 = {  # FGD artifact, analysis_allo_discrete.csv, mean of 10 seeds
    "default": {"bestfit": 93.08, "fgd": 95.39, "random": 87.47},
    "gpuspec33": {"bestfit": 93.09, "fgd": 94.55, "random": 86.46},
    "multigpu50": {"bestfit": 95.74, "fgd": 97.18, "random": 90.27},
}
COLOURS = {
    "random": "tab:gray",
    "bestfit": "tab:blue",
    "ojs": "tab:red",
    "fgd": "tab:green",
    "pull": "tab:gray",
    "strict": "tab:blue",
    "fair": "tab:orange",
}


def plot(mode: str, result: dict[str, Any], path: str) -> None:
    """Write the figure of a `--mode` result to `path` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, a bench-only extra: pip install -e '.[bench]'"
        ) from None
    panels = [k for k in result if k != "meta"]
    extra = 2 if mode == "time" else 0
    fig, axes = plt.subplots(
        1, len(panels) + extra, figsize=(5 * (len(panels) + extra), 4), squeeze=False
    )
    for ax, panel in zip(axes[0], panels, strict=False):
        if mode == "fgd":
            _alloc(ax, panel, result[panel])
        else:
            _waits(ax, panel, result[panel])
    if extra:
        loads = {int(k): v for k, v in result.items() if k != "meta"}
        _by_load(axes[0][-2], loads, "idle_if_packed_pct", "GPU idle while a job could use it")
        _by_load(axes[0][-1], loads, "big_max_h", "worst wait, jobs of >= 4 GPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_load(ax: Any, loads: dict[int, dict[str, Any]], key: str, title: str) -> None:
    """One figure of every policy against the load (`big_max_h`: the big jobs' max wait)."""
    policies = list(next(iter(loads.values())))
    for policy in policies:
        xs = sorted(loads)
        if key == "big_max_h":
            ys = [(loads[x][policy]["wait_s"]["big"]["max"] or 0.0) / 3600 for x in xs]
        else:
            ys = [loads[x][policy][key] for x in xs]
        ax.plot(xs, ys, marker="o", label=policy, color=COLOURS.get(policy))
    ax.set_title(title)
    ax.set_xlabel("load, % of GPU capacity")
    ax.set_ylabel("hours" if key == "big_max_h" else "% of GPU-seconds (if packed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _alloc(ax: Any, workload: str, by_policy: dict[str, dict[str, float]]) -> None:
    for policy, rates in by_policy.items():
        loads = [int(k) for k in rates]
        ax.plot(loads, list(rates.values()), marker="o", label=policy, color=COLOURS.get(policy))
    for policy, rate in PAPER_130.get(workload, {}).items():
        ax.scatter([130], [rate], marker="x", color=COLOURS.get(policy), zorder=3)
        ax.annotate(
            f"paper {policy}", (130, rate), fontsize=7, xytext=(4, 0), textcoords="offset points"
        )
    ax.set_title(f"{workload}: GPU allocation rate")
    ax.set_xlabel("arrived load, % of GPU capacity")
    ax.set_ylabel("allocated, % of GPU capacity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _waits(ax: Any, load: str, by_policy: dict[str, Any]) -> None:
    for policy, metrics in by_policy.items():
        waits = sorted(max(float(w), 1.0) for w in metrics.get("waits", []))
        big = sorted(max(float(w), 1.0) for w in metrics.get("waits_big", []))
        if big:
            share = [(i + 1) / len(big) for i in range(len(big))]
            ax.step(
                big,
                share,
                where="post",
                linestyle=":",
                color=COLOURS.get(policy),
                label=f"{policy}, >= 4 GPUs",
            )
        if not waits:
            continue
        share = [(i + 1) / len(waits) for i in range(len(waits))]
        ax.step(waits, share, where="post", label=policy, color=COLOURS.get(policy))
    ax.set_xscale("log")
    ax.set_title(f"load {load}%: wait before first start (CDF)")
    ax.set_xlabel("wait, s (log)")
    ax.set_ylabel("share of jobs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
