"""The learning curve of a run: held-out success (with its 95% interval) against policy version and wall time.

    plot_learning_curve(points, sft_version=5, path=Path("runs/demo/learning_curve.png"))

points: dicts from `python -m learner.eval --json` (version, mode, success, ci_low, ci_high) plus "seconds",
the wall time since v0 was announced when that version was. Where the greedy points drew from several task
sources (their "by_source": source -> [successes, episodes]), a third panel shows each source's greedy success
vs version: which one holds the total back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def plot_learning_curve(points: Sequence[dict[str, Any]], sft_version: int, path: Path) -> Path:
    greedy = sorted((p for p in points if p["mode"] == "greedy"), key=lambda p: p["version"])
    sources = sorted({s for p in greedy for s in p.get("by_source") or {}})
    panels = 3 if len(sources) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), sharey=True)
    for ax, x_key, label in ((axes[0], "version", "policy version"), (axes[1], "seconds", "wall time (s)")):
        for mode, marker in (("greedy", "o"), ("sampled", "s")):
            rows = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["version"])
            if not rows:
                continue
            xs = [p[x_key] for p in rows]
            ys = [p["success"] for p in rows]
            err = [[p["success"] - p["ci_low"] for p in rows], [p["ci_high"] - p["success"] for p in rows]]
            ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=f"{mode} (95% Wilson CI)")
        boundary = [p[x_key] for p in points if p["version"] == sft_version]
        if boundary:
            ax.axvspan(min(p[x_key] for p in points), boundary[0], color="tab:orange", alpha=0.12, label="SFT phase")
            ax.axvline(boundary[0], color="tab:orange", linestyle="--")
        ax.set(xlabel=label, title=f"held-out success vs {label}", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    if panels == 3:
        ax = axes[2]
        for source in sources:
            rows = [p for p in greedy if source in (p.get("by_source") or {})]
            ax.plot([p["version"] for p in rows], [wins / max(n, 1) for wins, n in (p["by_source"][source] for p in rows)],
                    marker=".", label=source.removeprefix("builtin:"))
        boundary = [p["version"] for p in greedy if p["version"] == sft_version]
        if boundary:
            ax.axvspan(greedy[0]["version"], boundary[0], color="tab:orange", alpha=0.12)
            ax.axvline(boundary[0], color="tab:orange", linestyle="--")
        ax.set(xlabel="policy version", title="greedy held-out success per task source", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize="small")
    axes[0].set_ylabel("held-out success")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
