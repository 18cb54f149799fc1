"""Read run folders back and summarise them: final metric and detection AUROC, mean +- sd over seeds."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fedtrust.checkpoint import CorruptFileError
from fedtrust.sim.store import RunStore


@dataclass
class Run:
    """One run read back from disk. ``problem`` says why its files cannot be trusted (then its status is
    "unreadable" and its numbers are left out of every table and plot)."""

    directory: Path
    manifest: dict[str, Any]
    rounds: list[dict[str, Any]] = field(repr=False)
    problem: str | None = None

    @property
    def status(self) -> str:
        """finished, failed (``manifest["error"]`` says why), running (interrupted), or unreadable."""
        return "unreadable" if self.problem else self.manifest.get("status", "unknown")

    @property
    def reason(self) -> str:
        """Why a run is not counted: its error, its file problem, or how far it got."""
        return self.problem or self.manifest.get("error") or f"{len(self.rounds)} rounds so far"

    @property
    def seed(self) -> int:
        return int(self.manifest.get("seed", 0))

    @property
    def rule(self) -> str:
        """The rule with its options, e.g. ``multi_krum(f=0.3)``."""
        return self.rule_without()

    def rule_without(self, option: str | None = None) -> str:
        """The rule with its options except ``option`` (the one a sweep varies)."""
        cfg = self.manifest.get("config", {}).get("rule", {"name": "?"})
        opts = ",".join(f"{k}={v}" for k, v in cfg.items() if k not in ("name", option))
        return cfg["name"] + (f"({opts})" if opts else "")

    @property
    def setting(self) -> str:
        """What distinguishes this run apart from the rule and the seed (the swept corruption, ...)."""
        swept = self.manifest.get("swept", {})
        parts = []
        for path, value in swept.items():
            if is_replicate(path) or path.split(".")[0] == "rule":
                continue
            if isinstance(value, dict):
                value = value.get("name", value)
            parts.append(f"{path.removesuffix('.name')}={value}")
        return ", ".join(parts) or self.manifest.get("experiment", "run")

    @property
    def metric(self) -> str:
        """accuracy for classification, rmse for regression."""
        for r in self.rounds:
            if r.get("metrics"):
                return "accuracy" if "accuracy" in r["metrics"] else "rmse"
        return "accuracy"

    def final_metrics(self) -> dict[str, float]:
        for r in reversed(self.rounds):
            if r.get("metrics"):
                return r["metrics"]
        return {}

    def predictions(self):
        """The final predictive distribution on the test set (y, mu, sigma) if the run saved one."""
        import numpy as np

        path = self.directory / "predictions.npz"
        if not path.exists():
            return None
        saved = np.load(path)
        return saved["y"], saved["mu"], saved["sigma"]

    def curve(self) -> tuple[list[int], list[float]]:
        pts = [(r["round"], r["metrics"][self.metric]) for r in self.rounds if r.get("metrics")]
        return [p[0] for p in pts], [p[1] for p in pts]

    def final(self) -> float | None:
        _, ys = self.curve()
        return ys[-1] if ys else None

    def mean_auroc(self) -> float | None:
        values = [r["auroc"] for r in self.rounds if r.get("auroc") is not None]
        return statistics.fmean(values) if values else None

    def corrupted_weight(self) -> float | None:
        """Mean over rounds of the total weight the rule gave corrupted clients."""
        values = [
            sum(w for w, bad in zip(r["weights"], r["corrupted"], strict=True) if bad)
            for r in self.rounds
            if not r.get("error") and any(r["corrupted"])
        ]
        return statistics.fmean(values) if values else None

    def errors(self) -> int:
        return sum(1 for r in self.rounds if r.get("error"))

    def unconverged(self) -> tuple[int, int]:
        """(rounds whose iterative fit stopped at max_iter without converging, rounds with such a fit):
        read from each round's ``info["converged"]`` (IVAR/ICOV rules and robust FedAG over them, whose
        ``info["warning"]`` says how far the fit still moved; the geometric median's Weiszfeld steps)."""
        fits = [r["info"]["converged"] for r in self.rounds if "converged" in (r.get("info") or {})]
        return sum(c is False for c in fits), len(fits)

    def shared_votes(self) -> tuple[int, int]:
        """(rounds in which groups of identical or near-identical updates shared one vote, the largest
        such group's size): read from each round's ``info["groups"]`` (IVAR/ICOV and FOCUS with
        ``sybils="share"``, robust FedAG over them)."""
        sizes = [
            max(len(g["clients"]) for g in r["info"]["groups"])
            for r in self.rounds
            if (r.get("info") or {}).get("groups")
        ]
        return len(sizes), max(sizes, default=0)

    def degenerate(self) -> list[str]:
        """The reasons recorded by rounds a rule found degenerate (``info["degenerate"]``: all updates
        identical, or IVAR-MLE's fit reaching its variance floor), one per round."""
        return [r["info"]["degenerate"] for r in self.rounds if (r.get("info") or {}).get("degenerate")]


def is_replicate(path: str) -> bool:
    """Swept seeds (the run's, a dataset's) make replicates of one setting, not settings."""
    return path == "seed" or path.endswith(".seed")


def load_runs(directory: str | Path) -> list[Run]:
    """Every run folder (one with a manifest.json) under ``directory``. A run whose manifest or round
    records cannot be read back, or that says finished without every round, comes back with its
    ``problem`` set instead of raising: one damaged run does not hide the others."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist")
    runs = []
    for path in sorted(directory.rglob("manifest.json")):
        store = RunStore(path.parent)
        try:
            manifest = store.manifest() or {}
        except CorruptFileError as exc:
            runs.append(Run(path.parent, {}, [], str(exc)))
            continue
        rounds, problem = store.read_rounds()
        train = (manifest.get("config") or {}).get("train", {})
        expected = 1 if train.get("mode") == "one_round" else train.get("rounds")
        if problem is None and manifest.get("status") == "finished" and len(rounds) != expected:
            problem = f"{store.rounds_path} has {len(rounds)} rounds but the run says it finished {expected}"
        runs.append(Run(path.parent, manifest, rounds, problem))
    runs.sort(key=lambda r: (r.manifest.get("experiment", ""), r.manifest.get("index", 0)))  # sweep order
    return runs


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sd of the finite values (a diverged run's inf or NaN is counted apart, see ``table``)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


class Cell(NamedTuple):
    """A table cell: mean and sd over the finished runs' finite values, how many values, how many of them
    were not finite (a model whose metric is inf or NaN), and how many runs of the cell failed."""

    mean: float
    sd: float
    count: int
    nonfinite: int
    failed: int


def table(runs: list[Run], value) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    """Rows = rules, columns = settings, cells = :class:`Cell` of ``value(run)`` over the finished runs
    (seeds) of that rule and setting; failed runs are counted, never averaged in."""
    rules = list(dict.fromkeys(r.rule for r in runs if r.manifest))
    settings = list(dict.fromkeys(r.setting for r in runs if r.manifest))
    cells = {}
    for rule in rules:
        for setting in settings:
            mine = [r for r in runs if r.manifest and r.rule == rule and r.setting == setting]
            vals = [v for v in (value(r) for r in mine if r.status == "finished") if v is not None]
            failed = sum(r.status == "failed" for r in mine)
            if vals or failed:
                m, s = mean_sd(vals)
                cells[(rule, setting)] = Cell(
                    m, s, len(vals), sum(not math.isfinite(v) for v in vals), failed
                )
    return rules, settings, cells
