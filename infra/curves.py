"""The learning curve of a run: held-out success (with its 95% interval) against policy version and wall time.

    plot_learning_curve(points, sft_version=5, path=Path("runs/demo/learning_curve.png"))

points: dicts from `python -m learner.eval --json` (version, mode, success, ci_low, ci_high) plus "seconds",
the wall time since v0 was announced when that version was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def plot_learning_curve(points: Sequence[dict[str, Any]], sft_version: int, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
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
    axes[0].set_ylabel("held-out success")
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
