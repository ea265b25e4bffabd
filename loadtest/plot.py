"""PNG of a comparison (or one run): hit rate, TTFT p50/p99 and prefill per policy, and the
same over time, so a policy that only wins once warm is visible as such."""

from __future__ import annotations

from pathlib import Path


def _names(runs: list[dict]) -> list[str]:
    return [r.get("policy") or f"run {i}" for i, r in enumerate(runs)]


def _num(v: float | None) -> float:
    return float("nan") if v is None else float(v)


def plot_runs(runs: list[dict], path: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _names(runs)
    x = list(range(len(runs)))
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))

    ax = axes[0][0]
    w = 0.4
    ax.bar([i - w / 2 for i in x], [_num(r.get("hit_rate")) * 100 for r in runs], w, label="all turns")
    ax.bar([i + w / 2 for i in x], [_num(r.get("later_turn_hit_rate")) * 100 for r in runs], w, label="turns >= 2")
    ax.set_title("prefix-cache hit rate (cached / prompt tokens)")
    ax.set_ylabel("%")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ax.bar([i - w / 2 for i in x], [_num(r.get("ttft_p50_s")) for r in runs], w, label="p50")
    ax.bar([i + w / 2 for i in x], [_num(r.get("ttft_p99_s")) for r in runs], w, label="p99")
    ax.set_title("time to first token")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)

    ax = axes[0][2]
    ax.bar(x, [r.get("prefill_tokens") or 0 for r in runs], 0.6, color="tab:red")
    ax.set_title("prefill tokens computed (prompt - cached)")

    for ax in axes[0]:
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)

    for ax, key, label in (
        (axes[1][0], "hit_rate", "hit rate over time"),
        (axes[1][1], "ttft_p50_s", "TTFT p50 over time (s)"),
        (axes[1][2], "ttft_p99_s", "TTFT p99 over time (s)"),
    ):
        for name, r in zip(names, runs, strict=True):
            tl = r.get("timeline") or []
            scale = 100 if key == "hit_rate" else 1
            ax.plot([b["t_s"] for b in tl], [_num(b.get(key)) * scale for b in tl], marker=".", label=name)
        ax.set_title(label + (" %" if key == "hit_rate" else ""))
        ax.set_xlabel("seconds since the run started (by send time)")
    axes[1][0].legend(fontsize=7)

    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
