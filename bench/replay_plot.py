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


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or exit saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib, a bench-only extra: pip install -e '.[bench]'"
        ) from None
    return plt


def scheduler_plot(rows: list[dict[str, Any]], path: str) -> None:
    """`bench/scheduler.py --plot`: pass time and time per decision against workers."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    jobs = sorted({r["jobs"] for r in rows})
    for fleet, colour in (("busy", "tab:red"), ("idle", "tab:blue")):
        mine = sorted((r for r in rows if r["fleet"] == fleet), key=lambda r: r["workers"])
        if not mine:
            continue
        xs = [r["workers"] for r in mine]
        left.plot(xs, [r["pass_s"] for r in mine], marker="o", color=colour, label=f"{fleet}, full")
        if all("quick_pass_s" in r for r in mine):
            left.plot(xs, [r["quick_pass_s"] for r in mine], marker="s", linestyle=":",
                      color=colour, label=f"{fleet}, quick (first 100)")  # fmt: skip
        right.plot(xs, [r["median_us"] for r in mine], marker="o", color=colour,
                   label=f"{fleet}, median")  # fmt: skip
        right.plot(xs, [r["p99_us"] for r in mine], marker="^", linestyle=":", color=colour,
                   label=f"{fleet}, p99")  # fmt: skip
    left.set_title(f"a pass, {', '.join(f'{j:,}' for j in jobs)} pending jobs")
    left.axhline(1.0, color="gray", linewidth=0.8, linestyle="--", label="1 s target")
    left.set_ylabel("seconds")
    left.set_ylim(bottom=0)
    right.set_title("one Planner.decide")
    right.set_ylabel("µs (log)")
    right.set_yscale("log")
    right.axhline(1000, color="gray", linewidth=0.8, linestyle="--", label="1 ms target")
    _by_workers(plt, fig, (left, right), path, 8)


def leader_pass_plot(results: list[dict[str, Any]], path: str) -> None:
    """`bench/leader_pass.py --out`: the live leader's quick pass and its phases, and the
    heartbeat and lease reads (all against the change feeds), against workers."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"steady": "-", "unstarted": ":"}
    for found in results:
        sizes = sorted(found["sizes"], key=lambda r: r["workers"])
        xs, style = [r["workers"] for r in sizes], styles.get(found["scenario"], "--")
        for phase, colour in (("pass", "black"), ("first_reads", "tab:blue"),
                              ("fleet", "tab:green"), ("core", "tab:red")):  # fmt: skip
            ys = [r["passes"]["quick"][phase]["median"] / 1000 for r in sizes]
            name = "quick pass" if phase == "pass" else phase
            left.plot(xs, ys, marker="o", linestyle=style, color=colour,
                      label=f"{name}, {found['scenario']}")  # fmt: skip
        for key, colour, name in (
            ("old_ms", "tab:gray", "read all"),
            ("feed_ms", "tab:purple", "feeds"),
        ):
            ys = [r["reads"][key]["median"] for r in sizes]
            right.plot(xs, ys, marker="o", linestyle=style, color=colour,
                       label=f"{name}, {found['scenario']}")  # fmt: skip
    jobs = sorted({f["jobs"] for f in results})
    left.set_title(f"live leader, quick pass (median), {', '.join(f'{j:,}' for j in jobs)} jobs")
    left.axhline(1.0, color="gray", linewidth=0.8, linestyle="--", label="1 s target")
    left.set_ylabel("seconds")
    right.set_title("heartbeat and lease reads per pass (median)")
    right.set_ylabel("ms (log)")
    right.set_yscale("log")
    _by_workers(plt, fig, (left, right), path, 7)


def _by_workers(plt: Any, fig: Any, axes: tuple[Any, ...], path: str, font: int) -> None:
    """Panels against workers (log scale), saved to `path` and closed."""
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("workers (log)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=font)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(mode: str, result: dict[str, Any], path: str) -> None:
    """Write the figure of a `--mode` result to `path` (PNG)."""
    plt = _pyplot()
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


def gang_plot(result: dict[str, Any], path: str) -> None:
    """`bench/replay_gang.py --plot`: gang waits, small jobs' waits, busy GPUs over time."""
    plt = _pyplot()
    policies = [p for p in result if p != "meta"]
    meta = result["meta"]
    gangs = list(meta["gangs"])
    fig, (bars, cdf, busy) = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        waits = [result[policy]["gang_wait_s"][g] / 3600 for g in gangs]
        xs = [i + (k - (len(policies) - 1) / 2) * width for i in range(len(gangs))]
        bars.bar(xs, waits, width, label=policy, color=COLOURS.get(policy))
        small = [max(w, 1.0) / 60 for w in result[policy]["small_waits"]]
        share = [(i + 1) / len(small) for i in range(len(small))]
        mean = result[policy]["small_mean_wait_s"] / 60
        cdf.step(small, share, where="post", color=COLOURS.get(policy),
                 label=f"{policy}, mean {mean:.1f} min")  # fmt: skip
        times = [t / 3600 for t, _ in result[policy]["busy"]]
        held = [100 * n / meta["gpus"] for _, n in result[policy]["busy"]]
        util = result[policy]["utilisation_pct"]
        busy.step(times, held, where="post", color=COLOURS.get(policy), alpha=0.7,
                  linewidth=0.8, label=f"{policy}, utilisation {util:.1f} %")  # fmt: skip
        for t in result[policy]["gang_start_s"].values():
            busy.axvline(t / 3600, color=COLOURS.get(policy), linestyle=":", linewidth=0.8)
    bars.set_xticks(range(len(gangs)), [g.split("-", 1)[-1] for g in gangs])
    bars.set_title("wait of each gang (ranks x GPUs), arrival order")
    bars.set_ylabel("hours")
    cdf.set_xscale("log")
    cdf.set_title(f"{meta['small']} 1-GPU jobs: wait (CDF)")
    cdf.set_xlabel("wait, minutes (log; 0 shown at 1 s)")
    cdf.set_ylabel("share of jobs")
    busy.set_title(f"GPUs busy, {meta['gpus']} in all (dotted: a gang starts)")
    busy.set_xlabel("hours")
    busy.set_ylabel("% of GPUs")
    for ax in (bars, cdf, busy):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fair_plot(result: dict[str, Any], path: str) -> None:
    """`bench/replay_fair.py --plot`: each tenant's share per window (top) and of all
    GPU-seconds so far (bottom), one column per weighting; dashed: with a half-life."""
    plt = _pyplot()
    args = result["args"]
    specs = list(args["weights"])
    fig, axes = plt.subplots(2, len(specs), figsize=(6 * len(specs), 7), squeeze=False)
    colours = {"a": "tab:blue", "b": "tab:orange"}
    for col, spec in enumerate(specs):
        runs = {n: r for n, r in result["runs"].items() if n.startswith(f"{spec} ")}
        for name, run in runs.items():
            memory = not name.endswith(" 0s")
            label = f"half-life {args['half_life'] / 3600:g} h" if memory else "no memory"
            ts = [0.0] + [p["t_h"] for p in run["windows"]]
            for tenant, colour in colours.items():
                style = "--" if memory else "-"
                shares = [p[f"{tenant}_pct"] for p in run["windows"]]
                axes[0][col].step(ts, [shares[0], *shares], where="pre", linestyle=style,
                                  color=colour, label=f"{tenant}, {label}")  # fmt: skip
                cum = [p[f"{tenant}_cum_pct"] for p in run["windows"]]
                axes[1][col].plot(ts[1:], cum, linestyle=style, marker=".", color=colour,
                                  label=f"{tenant}, {label}")  # fmt: skip
        target = next(iter(runs.values()))["target_pct"]
        for row, what in enumerate(
            ("share of the fleet, per window", "share of GPU-seconds so far")
        ):
            ax = axes[row][col]
            for tenant, colour in colours.items():
                ax.axhline(target[tenant], color=colour, linestyle=":", linewidth=1)
            ax.axvline(args["b_at"] / 3600, color="gray", linewidth=0.8)
            ax.set_title(f"weights a:b = {spec}: {what} (dotted: weight)", fontsize=10)
            ax.set_xlabel("hours (grey: b starts submitting)")
            ax.set_ylabel("%")
            ax.set_ylim(0, 105)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
