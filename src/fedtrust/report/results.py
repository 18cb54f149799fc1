"""Read run folders back and summarise them: final metric and detection AUROC, mean +- sd over seeds."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from fedtrust.checkpoint import CorruptFileError
from fedtrust.sim.store import RunStore, computed_by, this_code


@dataclass
class Run:
    """One run read back from disk. ``problem`` says why its files cannot be trusted (then its status is
    "unreadable" and its numbers are left out of every table and plot). ``tag`` tells its setting apart
    from another one of the same name (:func:`load_runs` sets it)."""

    directory: Path
    manifest: dict[str, Any]
    rounds: list[dict[str, Any]] = field(repr=False)
    problem: str | None = None
    tag: str = ""
    #: swept section -> the options shown in its label (those that differ between the runs loaded with it)
    shown: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    #: the run of the same config and seed this one copies (a folder copied aside): counted once, there
    copy_of: Path | None = None

    @property
    def status(self) -> str:
        """finished, failed (``manifest["error"]`` says why), running (interrupted), unreadable, or copy
        (of another run: left out, so that no run counts twice)."""
        if self.problem:
            return "unreadable"
        return "copy" if self.copy_of is not None else self.manifest.get("status", "unknown")

    @property
    def reason(self) -> str:
        """Why a run is not counted: its error, its file problem, whom it copies, or how far it got."""
        if self.copy_of is not None:  # (set only on runs that read back)
            return f"the same config and seed as {self.copy_of}, counted there"
        if self.problem or self.manifest.get("error"):
            return self.problem or self.manifest["error"]
        stopped = self.manifest.get("interrupted")
        done = len(self.rounds)
        return f"{done} round{'s' * (done != 1)} so far" + (f"; stopped {stopped}" if stopped else "")

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
            if isinstance(value, dict):  # a whole section: its name and the options that differ
                value = spec(value, self.shown.get(path, ()))
            parts.append(f"{path.removesuffix('.name')}={value}")
        label = ", ".join(parts) or self.manifest.get("experiment", "run")
        if self.own_run:
            label = f"flower: {self.manifest.get('run', self.directory.name)}"
        return f"{label} [{self.tag}]" if self.tag else label

    @property
    def code(self) -> tuple[str | None, ...]:
        """What computed the run: its recorded fedtrust source hash, torch and numpy versions
        (:func:`~fedtrust.sim.store.computed_by`; None where one is not recorded). A Flower run resumed by
        other code keeps the earlier sessions' (``earlier_versions``): each entry then names every value,
        "a and b", which is no single checkout's."""
        earlier = [v for v in self.manifest.get("earlier_versions") or [] if isinstance(v, dict)]
        codes = list(dict.fromkeys([*map(computed_by, earlier), computed_by(self.manifest.get("versions"))]))
        if len(codes) == 1:
            return codes[0]
        return tuple(
            " and ".join(dict.fromkeys("not recorded" if v is None else str(v) for v in values))
            for values in zip(*codes, strict=True)
        )

    @property
    def own_run(self) -> bool:
        """A Flower run directory: a run of its own, never a replicate of another directory's."""
        return self.manifest.get("experiment") == "flower"

    @property
    def identity(self) -> str:
        """The run's config without the rule and the seeds: runs sharing it are replicates of one
        setting, and only they are averaged together (a Flower run directory is one run, never a seed of
        another's)."""
        config = {k: v for k, v in (self.manifest.get("config") or {}).items() if k not in ("rule", "name")}
        if self.own_run:
            config["run"] = str(self.directory)
        return json.dumps(_without_seeds(config), sort_keys=True, default=str)

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
        """(rounds in which groups of copies (identical, near-identical or correlated updates) shared one
        vote, the largest such group's size): read from each round's ``info["groups"]`` (IVAR/ICOV and
        FOCUS with ``sybils="share"``, robust FedAG over them)."""
        sizes = [
            max(len(g["clients"]) for g in r["info"]["groups"])
            for r in self.rounds
            if (r.get("info") or {}).get("groups")
        ]
        return len(sizes), max(sizes, default=0)

    def left_out(self) -> dict[tuple[str, str], tuple[list[int], list[str]]]:
        """(client, ``quarantined`` or ``dropped``) -> (the rounds, their distinct reasons in order): the
        clients a round left out of its aggregate. A rule quarantines a malformed update (``quarantined``
        in each round's record); a Flower strategy also drops a reply it cannot read before the rule sees
        it (``dropped``)."""
        out: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
        for r in self.rounds:
            for action in ("quarantined", "dropped"):
                for client, reason in (r.get(action) or {}).items():
                    rounds, reasons = out.setdefault((str(client), action), ([], []))
                    rounds.append(r["round"])
                    if str(reason) not in reasons:
                        reasons.append(str(reason))
        return out

    def degenerate(self) -> list[str]:
        """The reasons recorded by rounds a rule found degenerate (``info["degenerate"]``: all updates
        identical, or IVAR-MLE's fit reaching its variance floor), one per round."""
        return [r["info"]["degenerate"] for r in self.rounds if (r.get("info") or {}).get("degenerate")]


def spec(section: dict[str, Any], keys: tuple[str, ...] | None = None) -> str:
    """A config section as one line, ``name(key=value, ...)`` (``keys``: only those options):
    ``sign_flip(fraction=0.4)``."""
    options = ", ".join(
        f"{k}={spec(v) if isinstance(v, dict) else v}"
        for k, v in section.items()
        if k != "name" and (keys is None or k in keys)
    )
    name = str(section.get("name", ""))
    return f"{name}({options})" if options and name else name or options


def options_that_differ(runs: list[Run]) -> None:
    """Set each run's ``shown``: per swept section, the options whose values differ between runs whose
    sections share a name (the name alone tells the others apart). A section without a name
    (``corruption.lie: {metric: train_loss, value: 0.0}``) is its options, all of them shown."""
    sections: dict[str, dict[str | None, list[dict]]] = {}
    for r in runs:
        for path, value in r.manifest.get("swept", {}).items():
            if isinstance(value, dict):
                name = value.get("name")
                sections.setdefault(path, {}).setdefault(None if name is None else str(name), []).append(
                    value
                )
    shown = {}
    for path, by_name in sections.items():
        differ = set()
        for name, values in by_name.items():
            for k in set().union(*values) - {"name"}:
                if (
                    name is None
                    or len({json.dumps(v.get(k), sort_keys=True, default=str) for v in values}) > 1
                ):
                    differ.add(k)
        shown[path] = tuple(sorted(differ))
    for r in runs:
        r.shown = shown


def _without_seeds(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_seeds(v) for k, v in value.items() if k != "seed"}
    return value


def tell_apart(runs: list[Run]) -> None:
    """Tag runs whose settings share a name but not a config (two experiments in one folder, a leftover
    run of another config), so no table averages them together: by experiment name where that tells
    them apart, else by a short hash of the config."""
    by_label: dict[str, dict[str, list[Run]]] = {}
    for r in runs:
        if r.manifest:
            by_label.setdefault(r.setting, {}).setdefault(r.identity, []).append(r)
    for configs in by_label.values():
        if len(configs) < 2:
            continue
        names = {i: {m.manifest.get("experiment", "") for m in members} for i, members in configs.items()}
        for identity, members in configs.items():
            own = names[identity]
            shared = any(own & other for i, other in names.items() if i != identity)
            tag = next(iter(own)) if len(own) == 1 and not shared else ""
            tag = tag or "config " + hashlib.sha1(identity.encode()).hexdigest()[:6]
            for m in members:
                m.tag = tag


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
            problem = (
                f"{store.rounds_path} has {len(rounds)} rounds but the run says it finished {expected}"
                if isinstance(expected, int)
                else f"{path} says the run finished but its config gives no train.rounds"
            )
        runs.append(Run(path.parent, manifest, rounds, problem))
    runs.sort(key=lambda r: (r.manifest.get("experiment", ""), r.manifest.get("index", 0)))  # sweep order
    options_that_differ(runs)
    tell_apart(runs)
    _mark_copies(runs)
    return runs


def _mark_copies(runs: list[Run]) -> None:
    """Runs of one config and seed in one table cell (the same rule and setting) are one computation,
    whatever folder or experiment name holds them (a folder copied aside, an attempt kept beside its
    re-run, one config saved under two names): one of them is counted and the others are marked copies of
    it. The one counted is the best: finished before failed before unfinished, computed by this checkout's
    code before other code, then the newest, then the first in sweep order. (The first in path order was
    counted: an interrupted attempt in a subfolder read "1/1 unfinished" over the finished re-run, an
    archived run of older code hid the fresh one, and one config under two names was averaged as two
    seeds.) A run two experiments share, in a column of each, counts in both."""
    same: dict[str, list[tuple[int, Run]]] = {}
    for position, r in enumerate(runs):
        config = r.manifest.get("config")
        if isinstance(config, dict) and not r.own_run and not r.problem:
            computed = json.dumps(
                {k: v for k, v in config.items() if k != "name"}, sort_keys=True, default=str
            )
            key = f"{r.rule}\x00{r.setting}\x00{computed}"
            same.setdefault(key, []).append((position, r))
    here = this_code()

    def preference(entry: tuple[int, Run]) -> tuple:
        position, r = entry
        rank = {"finished": 0, "failed": 1}.get(r.manifest.get("status"), 2)
        when = _time(r.manifest.get("finished") or r.manifest.get("started"))
        return rank, r.code != here, -when, position

    for entries in same.values():
        _, kept = min(entries, key=preference)
        for _, r in entries:
            if r is not kept:
                r.copy_of = kept.directory


def _time(stamp: Any) -> float:
    """A manifest's time stamp (:func:`~fedtrust.sim.store.now`) in seconds since the epoch; 0 where it
    is missing or unreadable."""
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (TypeError, ValueError):
        return 0.0


def missing(runs: list[Run]) -> dict[str, tuple[int, int]]:
    """Experiment -> (runs on disk, runs its sweep planned), for the experiments with fewer on disk than
    planned: runs that never started (a sweep killed early) or were removed, which no cell can show."""
    planned: dict[str, int] = {}
    present: dict[str, int] = {}
    for r in runs:
        name, size = r.manifest.get("experiment"), r.manifest.get("sweep_size")
        if isinstance(name, str) and isinstance(size, int) and not isinstance(size, bool):
            planned[name] = max(planned.get(name, 0), size)
            present[name] = present.get(name, 0) + 1
    return {name: (present[name], size) for name, size in planned.items() if present[name] < size}


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sd of the finite values (a diverged run's inf or NaN is counted apart, see ``table``)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


class Cell(NamedTuple):
    """A table cell: mean and sd over the finished runs' finite values, how many values, how many of them
    were not finite (a model whose metric is inf or NaN), how many runs of the cell failed, how many
    did not finish (interrupted, or unreadable), and how many codes computed its values (distinct
    :attr:`Run.code`: fedtrust source, torch and numpy; a cell averaged over seeds run before and after a
    change mixes two)."""

    mean: float
    sd: float
    count: int
    nonfinite: int
    failed: int
    unfinished: int = 0
    codes: int = 1


def table(runs: list[Run], value) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    """Rows = rules, columns = settings, cells = :class:`Cell` of ``value(run)`` over the finished runs
    (seeds) of that rule and setting; failed runs are counted, never averaged in."""
    rules = list(dict.fromkeys(r.rule for r in runs if r.manifest))
    settings = list(dict.fromkeys(r.setting for r in runs if r.manifest))
    cells = {}
    for rule in rules:
        for setting in settings:
            mine = [r for r in runs if r.manifest and r.rule == rule and r.setting == setting]
            counted = [(r, v) for r in mine if r.status == "finished" and (v := value(r)) is not None]
            vals = [v for _, v in counted]
            failed = sum(r.status == "failed" for r in mine)
            unfinished = sum(r.status in ("running", "unreadable") for r in mine)
            if vals or failed or unfinished:
                m, s = mean_sd(vals)
                nonfinite = sum(not math.isfinite(v) for v in vals)
                codes = len({r.code for r, _ in counted}) or 1
                cells[(rule, setting)] = Cell(m, s, len(vals), nonfinite, failed, unfinished, codes)
    return rules, settings, cells
