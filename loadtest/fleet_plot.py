"""PNG of a fleet comparison: hit rate and TTFT p50/p99 against replica count, one colour per
policy, live solid and simulated dashed, so the live-vs-sim gap is visible at a glance."""

from __future__ import annotations

from pathlib import Path


def plot_fleet(runs: list[dict], path: str | Path, title: str | None = None) -> Path:
    """`runs`: [{"live": FleetResult dict, "sim": FleetResult dict}, ...] as in fleet.json."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["live"]["policy"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("hit_rate", "hit rate (%)", 100.0), ("ttft_p50_s", "TTFT p50 (model s)", 1.0),
              ("ttft_p99_s", "TTFT p99 (model s)", 1.0))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label, mult) in zip(axes, panels, strict=True):
        for i, policy in enumerate(policies):
            mine = sorted((r for r in runs if r["live"]["policy"] == policy), key=lambda r: r["live"]["replicas"])
            xs = [r["live"]["replicas"] for r in mine]
            c = colours[i % len(colours)]
            for side, style in (("live", "-o"), ("sim", "--x")):
                ys = [(r[side].get(key) if r[side].get(key) is not None else float("nan")) * mult for r in mine]
                ax.plot(xs, ys, style, color=c, label=f"{policy} ({side})")
        if key == "hit_rate":
            pooled = sorted({(r["live"]["replicas"], r["live"]["oracle_pooled"]) for r in runs})
            ax.plot([p[0] for p in pooled], [p[1] * 100 for p in pooled], ":s", color="black", label="pooled-LRU oracle")
        else:  # log: a queue-blind stand-in (the simulator's ray-prefix) runs 10-100x the others' TTFT
            ax.set_yscale("log")
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["live"]["replicas"] for r in runs}))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
