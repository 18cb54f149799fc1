"""Plots from runs: the metric over rounds and against a swept value per rule, calibration, and trust
over rounds as heatmaps. Every figure fits a paper's column or page (:mod:`fedtrust.report.style`), gives
each rule the same colour and line everywhere, shades +-1 sd over seeds, puts panels that are compared
on one scale, and is written as PNG, PDF and SVG."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.colors
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from fedtrust.report.results import Run, is_replicate, spec
from fedtrust.report.style import COLUMN, PAGE, PALE, paper, rule_styles, save, wrap

#: Trust heatmaps colour a weight relative to an equal share of its round; shares above this are drawn
#: at the top colour (the colour bar's arrow).
MAX_SHARE = 3.0
_BAND = "shaded: ±1 sd over seeds"


def _panels(count: int, max_cols: int = 3, height: float = 1.9, **kw):
    """A figure of ``count`` panels: one column wide for a single panel, a page wide otherwise."""
    cols = min(count, max_cols)
    rows = math.ceil(count / cols)
    width = COLUMN if cols == 1 else PAGE
    fig, axes = plt.subplots(rows, cols, figsize=(width, height * rows + 0.3), squeeze=False,
                             layout="constrained", **kw)  # fmt: skip
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    return fig, axes


def _legend(fig, axes, note: str = "") -> None:
    """One legend for the figure, below the panels, in as many columns as its width holds."""
    handles, labels = {}, []
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if not labels:
        return
    width, height = fig.get_size_inches()
    longest = max(len(label) for label in labels)
    ncol = max(1, min(len(labels), int(width / (0.45 + 0.055 * longest))))
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center", ncol=ncol,
               frameon=False, title=note or None, title_fontsize=7)  # fmt: skip
    rows = math.ceil(len(labels) / ncol) + (1 if note else 0)
    fig.set_size_inches(width, height + 0.16 * rows + 0.1)  # the panels keep their size


def _line(ax, xs, ys: np.ndarray, style: dict, label: str) -> None:
    """The mean over seeds (rows of ``ys``) and, with several seeds, a +-1 sd band."""
    mean = ys.mean(0)
    marker = style["marker"] or ("o" if len(xs) <= 3 else None)  # a curve of a point or two shows
    ax.plot(xs, mean, color=style["color"], ls=style["ls"], marker=marker, ms=3,
            markevery=max(1, len(xs) // 8), label=label)  # fmt: skip
    if len(ys) > 1:
        sd = ys.std(0, ddof=1)
        ax.fill_between(xs, mean - sd, mean + sd, color=style["color"], alpha=0.15, lw=0)
        if len(xs) <= 3:  # a band over a point or two is hard to see: bars too
            ax.errorbar(xs, mean, yerr=sd, fmt="none", ecolor=style["color"], capsize=2, lw=0.8)


def metric_curves(runs: list[Run], path: Path) -> Path:
    """One panel per setting, on one y scale; per rule the mean over seeds and a +-1 sd band."""
    settings = list(dict.fromkeys(r.setting for r in runs))
    rules = list(dict.fromkeys(r.rule for r in runs))
    styles = rule_styles(rules)
    metric = runs[0].metric
    with paper():
        fig, axes = _panels(len(settings), sharex=True, sharey=True)
        cols = axes.shape[1]
        for ax, setting in zip(axes.flat, settings, strict=False):
            for rule in rules:
                curves = [r.curve() for r in runs if r.setting == setting and r.rule == rule and r.rounds]
                curves = [c for c in curves if c[0]]
                if not curves:
                    continue
                length = min(len(c[0]) for c in curves)
                ys = np.array([c[1][:length] for c in curves])
                _line(ax, curves[0][0][:length], ys, styles[rule], rule)
            ax.set_title(wrap(setting, int(13 * PAGE / cols)))
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        for ax in axes[-1]:
            ax.set_xlabel("round")
        for ax in axes[:, 0]:
            ax.set_ylabel(f"test {metric}")
        _legend(fig, axes, _BAND if any(_seeds(runs, s, r) > 1 for s in settings for r in rules) else "")
        return save(fig, path)


def _seeds(runs: list[Run], setting: str, rule: str) -> int:
    return sum(1 for r in runs if r.setting == setting and r.rule == rule)


def calibration(runs: list[Run], path: Path) -> Path:
    """Reliability diagram: observed coverage of central predictive intervals against their nominal
    level, one line per rule (mean over seeds), one panel per setting. On the diagonal = calibrated."""
    from scipy.stats import norm

    levels = np.linspace(0.05, 0.95, 19)
    settings = list(dict.fromkeys(r.setting for r in runs))
    rules = list(dict.fromkeys(r.rule for r in runs))
    styles = rule_styles(rules)
    with paper():
        fig, axes = _panels(len(settings), height=2.3, sharex=True, sharey=True)
        cols = axes.shape[1]
        for ax, setting in zip(axes.flat, settings, strict=False):
            ax.plot([0, 1], [0, 1], color=PALE, ls="--", lw=1)
            for rule in rules:
                curves = []
                for r in runs:
                    pred = r.predictions() if r.setting == setting and r.rule == rule else None
                    if pred is not None:
                        y, mu, sigma = pred
                        z = np.abs(y - mu) / np.maximum(sigma, 1e-12)
                        curves.append([np.mean(z <= norm.ppf(0.5 + lv / 2)) for lv in levels])
                if curves:
                    s = styles[rule]
                    marker = s["marker"] or "o"
                    ax.plot(levels, np.mean(curves, 0), color=s["color"], ls=s["ls"], marker=marker, ms=2.5,
                            label=rule)  # fmt: skip
            ax.set_title(wrap(setting, int(13 * PAGE / cols)))
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_aspect("equal")
        for ax in axes[-1]:
            ax.set_xlabel("nominal coverage")
        for ax in axes[:, 0]:
            ax.set_ylabel("observed coverage")
        _legend(fig, axes, "central predictive intervals; on the diagonal = calibrated")
        return save(fig, path)


def trust_heatmaps(runs: list[Run], path: Path, title: str = "") -> Path:
    """One panel per rule (first seed of each): clients x rounds, coloured by the client's weight over an
    equal share of its round (1 = 1/n: what the mean gives; 0 = shut out), on one colour scale for every
    panel; grey = not sampled, or a round the rule refused. Corrupted clients are listed first, under a
    red bar."""
    by_rule: dict[str, Run] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        by_rule.setdefault(r.rule, r)
    corrupted: dict[str, bool] = {}
    for run in by_rule.values():
        for rec in run.rounds:
            for cid, bad in zip(rec["clients"], rec["corrupted"], strict=True):
                corrupted[cid] = corrupted.get(cid, False) or bad
    order = sorted(corrupted, key=lambda c: (not corrupted[c], c))  # one row order in every panel
    index = {c: i for i, c in enumerate(order)}
    bad = sum(corrupted.values())
    cmap = plt.get_cmap("RdBu").with_extremes(bad="#E4E4E4")
    norm = matplotlib.colors.TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=MAX_SHARE)
    with paper():
        height = max(1.5, min(2.6, 0.9 + 0.045 * len(order)))
        fig, axes = _panels(len(by_rule), max_cols=4, height=height, sharex=True, sharey=True)
        cols = axes.shape[1]
        image = None
        for ax, (rule, run) in zip(axes.flat, by_rule.items(), strict=False):
            grid = relative_trust(run, index)
            rounds = [rec["round"] for rec in run.rounds]
            extent = (rounds[0] - 0.5, rounds[-1] + 0.5, len(order) - 0.5, -0.5) if rounds else None
            image = ax.imshow(
                grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm, extent=extent
            )
            if bad:
                ax.axhspan(-0.5, bad - 0.5, xmin=0, xmax=0.025, color="#CC0000", lw=0)
                ax.axhline(bad - 0.5, color="#CC0000", lw=0.6)
            ax.set_title(wrap(rule, int(13 * PAGE / cols)))
            ax.grid(False)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=5, integer=True))
        for ax in axes[-1]:
            ax.set_xlabel("round")
        first = axes[0, 0]
        if len(order) <= 60:  # name the clients (a Flower node's name, a simulated client-07), every
            # one where 5-point names fit the panel's height, else every step-th
            step = math.ceil(len(order) * 5.5 / (72 * 0.8 * (height - 0.45)))
            first.set_yticks(range(0, len(order), step), [str(c) for c in order[::step]])
            for ax in axes[:, 0]:
                ax.tick_params(axis="y", labelsize=5)
        else:
            first.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        for ax in axes[:, 0]:
            ax.set_ylabel("client")
        width, tall = fig.get_size_inches()
        chars = int(13 * width)  # what a line of the figure's width holds
        label = wrap(
            "weight ÷ an equal share of the round (1 = 1/n; grey: not sampled or round refused)", chars
        )
        if image is not None:
            fig.colorbar(image, ax=axes, location="bottom", extend="max", shrink=0.5, aspect=40, label=label)
        head = f"{title}: trust over rounds" if title else "Trust over rounds"
        if bad:
            head += f"; the {bad} corrupted clients on top (red bar)"
        head = wrap(head, min(110, chars))
        fig.set_size_inches(width, tall + 0.2 * (head.count("\n") + label.count("\n")))  # room for the lines
        fig.suptitle(head)
        return save(fig, path)


def relative_trust(run: Run, index: dict[str, int]) -> np.ndarray:
    """Clients (rows, by ``index``) x rounds: each client's weight over an equal share of its round
    (weight x the round's client count: 1 where the mean would put it); NaN where it was not sampled."""
    grid = np.full((len(index), len(run.rounds)), np.nan)
    for j, rec in enumerate(run.rounds):
        share = len(rec["clients"])
        for cid, w in zip(rec["clients"], rec["weights"], strict=True):
            grid[index[cid], j] = w * share
    return grid


def sweep_curves(runs: list[Run], path_key: str, path: Path) -> Path:
    """Final metric, and the weight the rule gave corrupted clients, against a numeric swept value: one
    line per rule (mean over seeds, +-1 sd band), one column per combination of the other swept values,
    one y scale per row. A swept rule option (``rule.lam``) is the x axis of one line per rule and its
    other options."""
    metric = runs[0].metric
    option = path_key.split(".", 1)[1] if path_key.startswith("rule.") else None

    def line(run):
        return run.rule_without(option)

    def others(run):
        parts = [
            f"{p.removesuffix('.name')}={spec(v, run.shown.get(p, ())) if isinstance(v, dict) else v}"
            for p, v in run.manifest["swept"].items()
            if p != path_key and not is_replicate(p) and p.split(".")[0] != "rule"
        ]  # fmt: skip
        label = ", ".join(parts) or run.manifest.get("experiment", "")
        return f"{label} [{run.tag}]" if run.tag else label

    panels = list(dict.fromkeys(others(r) for r in runs))
    rules = list(dict.fromkeys(line(r) for r in runs))
    styles = rule_styles(rules)
    quantities = [(f"final test {metric}", Run.final)]
    if any(r.corrupted_weight() is not None for r in runs):
        quantities.append(("weight on corrupted", Run.corrupted_weight))
    values = sorted({float(r.manifest["swept"][path_key]) for r in runs})
    several = False
    with paper():
        cols = min(len(panels), 3)
        rows = len(quantities) * math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, squeeze=False, sharex=True, sharey="row", layout="constrained",
                                 figsize=(COLUMN if cols == 1 else PAGE, 1.9 * rows + 0.3))  # fmt: skip
        for p, panel in enumerate(panels):
            for q, (label, value) in enumerate(quantities):
                ax = axes[(p // cols) * len(quantities) + q, p % cols]
                for rule in rules:
                    points: dict[float, list[float]] = {}
                    for r in runs:
                        v = value(r)
                        if line(r) == rule and others(r) == panel and v is not None:
                            points.setdefault(float(r.manifest["swept"][path_key]), []).append(v)
                    if not points:
                        continue
                    xs = sorted(points)
                    s = styles[rule]
                    mean = np.array([np.mean(points[x]) for x in xs])
                    ax.plot(
                        xs, mean, color=s["color"], ls=s["ls"], marker=s["marker"] or "o", ms=3, label=rule
                    )
                    if any(len(points[x]) > 1 for x in xs):
                        several = True
                        sd = np.array([np.std(points[x], ddof=1) if len(points[x]) > 1 else 0.0 for x in xs])
                        ax.fill_between(xs, mean - sd, mean + sd, color=s["color"], alpha=0.15, lw=0)
                if q == 0:
                    ax.set_title(wrap(panel, int(13 * PAGE / cols)))
                if q == len(quantities) - 1:  # each panel's bottom axes: its x values, whatever lies below
                    ax.set_xlabel(path_key)
                    ax.tick_params(axis="x", labelbottom=True)
                if len(values) > 2 and values[0] > 0 and values[-1] / values[0] >= 100:
                    ax.set_xscale("log")
        for ax in list(axes.flat):
            if not ax.has_data():
                ax.set_visible(False)
        for row, (label, _) in zip(axes, quantities * (len(axes) // len(quantities)), strict=True):
            shown = [ax for ax in row if ax.get_visible()]
            if shown:  # the row's scale is read off its first drawn panel (a hidden one took the labels)
                shown[0].tick_params(axis="y", labelleft=True)
                shown[0].set_ylabel(label)
        _legend(fig, axes, _BAND if several else "")
        return save(fig, path)
