"""The monitor's report: PNG plots (matplotlib, Agg) and a markdown summary of a PipelineStats.

    path = write_report(stats, Path("out"))    # out/summary.md beside out/*.png
"""
from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Callable

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from consumers.monitoring import HEADLINE, PipelineStats  # noqa: E402

PLOTS = ("reward_by_policy_version.png", "success_by_policy_version.png", "throughput.png", "consumer_lag.png",
         "deadletters.png", "learner_loss.png", "latency.png", "services.png")


def _time(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc)


def plot_reward_by_version(s: PipelineStats, ax: Any) -> None:
    for domain in sorted({d for d, _ in s.reward_by_version}):
        points = sorted((v, w) for (d, v), w in s.reward_by_version.items() if d == domain)
        ax.errorbar([v for v, _ in points], [w.mean for _, w in points], yerr=[w.std for _, w in points],
                    marker="o", capsize=3, label=domain)
    ax.set(xlabel="policy version (oldest turn)", ylabel="reward (mean ± std)", title="reward vs policy version")


def plot_success_by_version(s: PipelineStats, ax: Any) -> None:
    for domain in sorted({d for d, _ in s.success_by_version}):
        points = sorted((v, w) for (d, v), w in s.success_by_version.items() if d == domain)
        ax.plot([v for v, _ in points], [w.mean for _, w in points], marker="o", label=domain)
    ax.set(xlabel="policy version (oldest turn)", ylabel="solved (fraction of trajectories)", ylim=(-0.02, 1.02),
           title="success per domain vs policy version")


def plot_throughput(s: PipelineStats, ax: Any) -> None:
    seconds = s.bucket_ms / 1000
    for topic, buckets in sorted(s.throughput.items()):
        times = sorted(buckets)
        ax.plot([_time(b) for b in times], [buckets[b] / seconds for b in times], label=topic.split(".", 1)[-1])
    ax.set(xlabel="record time (UTC)", ylabel="records/s", title="throughput")


def plot_lag(s: PipelineStats, ax: Any) -> None:
    for group, points in sorted(s.lag_over_time.items()):
        ax.plot([_time(t) for t, _ in points], [n for _, n in points], marker=".", label=group)
    ax.set(xlabel="time (UTC)", ylabel="records behind", title="consumer lag")


def plot_deadletters(s: PipelineStats, ax: Any) -> None:
    reasons = sorted(s.deadletter_reasons)
    ax.bar(reasons, [s.deadletter_reasons[r] for r in reasons])
    ax.set(ylabel="records", title="dead letters by reason")
    ax.tick_params(axis="x", labelrotation=30)


def plot_learner(s: PipelineStats, ax: Any) -> None:
    for name, points in sorted(s.learner.items()):
        ax.plot([_time(t) for t, _ in points], [v for _, v in points], label=name)
    ax.set(xlabel="time (UTC)", ylabel="value", title="learner losses")


def plot_latency(s: PipelineStats, ax: Any) -> None:
    """The recent latencies as cumulative distributions: the share of observations under each time."""
    for label, dist in latencies(s):
        values = sorted(dist.recent)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                    label=f"{label} (n={dist.count:,})")
    ax.set(xscale="log", xlabel="seconds", ylabel="share at or under", title="latency")


def latencies(s: PipelineStats) -> list[tuple[str, Any]]:
    return [("episode ended -> in a batch", s.batch_latency), ("checkpoint announced -> generating", s.checkpoint_latency)]


def plot_services(s: PipelineStats, ax: Any) -> None:
    """The services' counters (the HEADLINE totals) over time, each as the services published it."""
    for source, name, how in HEADLINE:
        points = s.headline_series.get(name)
        if how == "total" and points:
            ax.step([_time(t) for t, _ in points], [v for _, v in points], where="post", label=f"{name}")
    ax.set(xlabel="window end (UTC; the streams worker's in event time)", ylabel="count since the start",
           title="service counters", yscale="symlog")


def save_plot(path: Path, draw: Callable[[PipelineStats, Any], None], s: PipelineStats) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        draw(s, ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        if not ax.has_data():
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        if draw in TIME_AXES:
            fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


TIME_AXES = (plot_throughput, plot_lag, plot_learner, plot_services)


def table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def summary_markdown(s: PipelineStats) -> str:
    mean, worst = s.policy_lag()
    written = dt.datetime.now(dt.timezone.utc)
    lines = [f"# Pipeline report: {s.topics.ns}", "", f"Written {written:%Y-%m-%d %H:%M:%S} UTC.", ""]
    if s.partial:
        lines += [f"**Partial: the monitor {s.partial}.**", ""]
    lines += ["## Records per topic", ""] + table(("topic", "records", "undecodable"), [
        (t, n, s.undecodable.get(t, 0)) for t, n in sorted(s.events_total.items())])
    lines += ["## Reward and success per domain", ""] + table(("domain", "trajectories", "mean", "std", "success"), [
        (d, w.n, f"{w.mean:.4f}", f"{w.std:.4f}", f"{s.success[d].mean:.4f}" if d in s.success else "-")
        for d, w in sorted(s.reward.items())])
    lines += ["## Sandbox outcomes", ""] + table(("outcome", "count"), sorted(s.sandbox_outcomes.items()))
    lines += ["## Dead letters", ""] + table(("reason", "count"), sorted(s.deadletter_reasons.items()))
    lines += ["## Consumer lag", ""] + table(("group", "topic", "lag"), [
        (g, t, n) for (g, t), n in sorted(s.consumer_lags.items())])
    lines += ["## Policy", "", f"Newest checkpoint v{s.newest_checkpoint}, newest trajectory version "
              f"v{s.newest_trajectory_version}; policy lag of recent trajectories: mean {mean:.2f}, max {worst}.", ""]
    lines += ["## Learner", ""] + table(("figure", "latest"), [(n, f"{v:.4f}") for n, v in s.latest_learner().items()])
    lines += ["## Services", ""] + table(("figure", "value"), [(n, f"{v:,.4g}") for n, v in s.headline().items()])
    lines += ["## Latency", ""] + table(("from -> to", "n", "p50 s", "p99 s"), [
        (label, d.count, f"{d.quantile(0.5):.2f}", f"{d.quantile(0.99):.2f}") for label, d in latencies(s)])
    lines += ["## Plots", ""] + [f"![{p.removesuffix('.png')}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


def write_report(s: PipelineStats, out: Path) -> Path:
    """Write every plot and summary.md into `out`; returns the summary's path."""
    out.mkdir(parents=True, exist_ok=True)
    draws = (plot_reward_by_version, plot_success_by_version, plot_throughput, plot_lag, plot_deadletters, plot_learner,
             plot_latency, plot_services)
    for name, draw in zip(PLOTS, draws):
        save_plot(out / name, draw, s)
    path = out / "summary.md"
    path.write_text(summary_markdown(s))
    return path
