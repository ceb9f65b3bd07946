"""A benchmark run against an issue's speed targets, as one chart (used by dev/bench_triton.py and
dev/bench_cuda_sm90.py).

Each script turns its results into rows ``dict(panel, name, value, target, met)`` (``met``: True, False or None where a
config has no target) and names its panels; :func:`plot_target_rows` draws one panel per name, a bar per row, green
where the target is met, red where it is missed, grey where there is none, each bar's target as a dashed line
across it.
"""

from __future__ import annotations

COLORS = {True: "tab:green", False: "tab:red", None: "tab:grey"}


def plot_target_rows(rows: list[dict], panels: dict[str, str], path: str, title: str = "") -> None:
    """Draw ``rows`` into ``path`` (PNG), one panel per key of ``panels`` (its value is the panel's y label), panels
    as wide as their bar counts. A panel without rows stays empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_panel = {p: [r for r in rows if r["panel"] == p] for p in panels}
    widths = [max(1.0, 0.45 * len(per_panel[p])) for p in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(12.0, 1.1 * sum(widths) + 2), 4.6),
                             gridspec_kw=dict(width_ratios=widths))
    for ax, (panel, ylabel) in zip(axes, panels.items()):
        mine = per_panel[panel]
        ax.bar(range(len(mine)), [r["value"] for r in mine], color=[COLORS[r["met"]] for r in mine])
        for i, r in enumerate(mine):  # each bar's own target, so panels mixing targets stay readable
            if r["target"] is not None:
                ax.hlines(r["target"], i - 0.45, i + 0.45, color="k", ls="--", lw=1.2)
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels([r["name"] for r in mine], rotation=40, ha="right", fontsize=6)
        ax.set_ylabel(ylabel, fontsize=8)
        for i, r in enumerate(mine):
            ax.text(i, r["value"], f"{r['value']:.3g}", ha="center", va="bottom", fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
