"""Plots from runs: accuracy (or RMSE) vs round per rule, and trust over rounds as a heatmap."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from fedtrust.report.results import Run, is_replicate  # noqa: E402


def _save(fig, axes, used: int, path: Path) -> Path:
    """Blank the panels past the first ``used``, put the first panel's legend on the right, write PNG."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grid(count: int) -> tuple[int, int]:
    cols = min(count, 3)
    return math.ceil(count / cols), cols


def metric_curves(runs: list[Run], path: Path) -> Path:
    """One panel per setting; per rule the mean over seeds and a min-max band."""
    settings = list(dict.fromkeys(r.setting for r in runs))
    rules = list(dict.fromkeys(r.rule for r in runs))
    metric = runs[0].metric
    rows, cols = _grid(len(settings))
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols + 2.2, 3.6 * rows), squeeze=False, layout="constrained"
    )
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(rules), 2)))
    for ax, setting in zip(axes.flat, settings, strict=False):
        for color, rule in zip(colors, rules, strict=False):
            curves = [r.curve() for r in runs if r.setting == setting and r.rule == rule and r.rounds]
            curves = [c for c in curves if c[0]]
            if not curves:
                continue
            length = min(len(c[0]) for c in curves)
            xs = curves[0][0][:length]
            ys = np.array([c[1][:length] for c in curves])
            ax.plot(xs, ys.mean(0), color=color, label=rule, lw=1.5)
            if len(curves) > 1:
                ax.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.15)
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    return _save(fig, axes, len(settings), path)


def calibration(runs: list[Run], path: Path) -> Path:
    """Reliability diagram: observed coverage of central predictive intervals against their nominal
    level, one line per rule (mean over seeds), one panel per setting. On the diagonal = calibrated."""
    from scipy.stats import norm

    levels = np.linspace(0.05, 0.95, 19)
    settings = list(dict.fromkeys(r.setting for r in runs))
    rules = list(dict.fromkeys(r.rule for r in runs))
    rows, cols = _grid(len(settings))
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.2 * cols + 2.2, 3.8 * rows), squeeze=False, layout="constrained"
    )
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(rules), 2)))
    for ax, setting in zip(axes.flat, settings, strict=False):
        ax.plot([0, 1], [0, 1], color="gray", ls="--", lw=1)
        for color, rule in zip(colors, rules, strict=False):
            curves = []
            for r in runs:
                pred = r.predictions() if r.setting == setting and r.rule == rule else None
                if pred is not None:
                    y, mu, sigma = pred
                    z = np.abs(y - mu) / np.maximum(sigma, 1e-12)
                    curves.append([np.mean(z <= norm.ppf(0.5 + lv / 2)) for lv in levels])
            if curves:
                ax.plot(levels, np.mean(curves, 0), color=color, marker="o", ms=2, label=rule)
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("nominal coverage of the central interval")
        ax.set_ylabel("observed coverage")
        ax.grid(alpha=0.3)
    return _save(fig, axes, len(settings), path)


def trust_heatmaps(runs: list[Run], path: Path, title: str = "") -> Path:
    """One panel per rule (first seed of each): clients x rounds, colour = weight (blank = not sampled);
    corrupted clients are listed first, under a red bar."""
    by_rule: dict[str, Run] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        by_rule.setdefault(r.rule, r)
    rows, cols = _grid(len(by_rule))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (rule, run) in zip(axes.flat, by_rule.items(), strict=False):
        ids: dict[str, bool] = {}
        for rec in run.rounds:
            for cid, bad in zip(rec["clients"], rec["corrupted"], strict=True):
                ids[cid] = ids.get(cid, False) or bad
        order = sorted(ids, key=lambda c: (not ids[c], c))
        index = {c: i for i, c in enumerate(order)}
        grid = np.full((len(order), len(run.rounds)), np.nan)
        for j, rec in enumerate(run.rounds):
            for cid, w in zip(rec["clients"], rec["weights"], strict=True):
                grid[index[cid], j] = w
        rounds = [rec["round"] for rec in run.rounds]
        extent = (rounds[0] - 0.5, rounds[-1] + 0.5, len(order) - 0.5, -0.5) if rounds else None
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, extent=extent)
        bad = sum(ids.values())
        if bad:
            ax.axhspan(-0.5, bad - 0.5, xmin=0, xmax=0.012, color="red")
            ax.axhline(bad - 0.5, color="red", lw=0.8)
        ax.set_title(f"{rule} ({bad} corrupted on top)", fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("client")
        if len(order) <= 30:  # few enough to name each client (a Flower node's name, a simulated client-07)
            ax.set_yticks(range(len(order)), [str(c) for c in order], fontsize=7)
        else:
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        fig.colorbar(image, ax=ax, fraction=0.04, label="trust (weight)")
    for ax in list(axes.flat)[len(by_rule) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_curves(runs: list[Run], path_key: str, path: Path) -> Path:
    """Final metric, and the weight the rule gave corrupted clients, against a numeric swept value: one
    line per rule (mean over seeds, min-max band), one column per combination of the other swept values.
    A swept rule option (``rule.lam``) is the x axis of one line per rule and its other options."""
    metric = runs[0].metric
    option = path_key.split(".", 1)[1] if path_key.startswith("rule.") else None

    def line(run):
        return run.rule_without(option)

    def others(run):
        parts = [
            f"{p}={v}" for p, v in run.manifest["swept"].items()
            if p != path_key and not is_replicate(p) and p.split(".")[0] != "rule"
        ]  # fmt: skip
        return ", ".join(parts) or run.manifest.get("experiment", "")

    panels = list(dict.fromkeys(others(r) for r in runs))
    rules = list(dict.fromkeys(line(r) for r in runs))
    quantities = [(f"final {metric}", Run.final)]
    if any(r.corrupted_weight() is not None for r in runs):
        quantities.append(("weight on corrupted", Run.corrupted_weight))
    cols = len(panels)
    fig, axes = plt.subplots(len(quantities), cols, figsize=(5.2 * cols + 2.2, 3.4 * len(quantities)),
                             squeeze=False, layout="constrained")  # fmt: skip
    colors = plt.get_cmap("tab20")(np.linspace(0, 1, max(len(rules), 2)))
    for row, (label, value) in enumerate(quantities):
        for ax, panel in zip(axes[row], panels, strict=True):
            for color, rule in zip(colors, rules, strict=False):
                points: dict[float, list[float]] = {}
                for r in runs:
                    v = value(r)
                    if line(r) == rule and others(r) == panel and v is not None:
                        points.setdefault(float(r.manifest["swept"][path_key]), []).append(v)
                if not points:
                    continue
                xs = sorted(points)
                ax.plot(xs, [np.mean(points[x]) for x in xs], marker="o", ms=3, color=color, label=rule)
                if any(len(points[x]) > 1 for x in xs):
                    ax.fill_between(
                        xs,
                        [min(points[x]) for x in xs],
                        [max(points[x]) for x in xs],
                        color=color,
                        alpha=0.15,
                    )
            if row == 0:
                ax.set_title(panel, fontsize=9)
            ax.set_xlabel(path_key)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if len({float(r.manifest["swept"][path_key]) for r in runs}) > 2:
                values = sorted({float(r.manifest["swept"][path_key]) for r in runs})
                if values[0] > 0 and values[-1] / values[0] >= 100:
                    ax.set_xscale("log")
    return _save(fig, axes, axes.size, path)
