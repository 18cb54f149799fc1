"""The README's main job: every rule on digits where 30% of 20 clients flip their labels, beside the
same rule on the same federation with no one corrupted.

Twenty clients hold IID shares of scikit-learn's digits; six of them set every label to one random
class (ARFL's label flipping). The server keeps 5% of the data as a trusted benchmark (FOCUS and
FLTrust read it). Each registered rule trains a softmax regression for 30 rounds, over three seeds, once
on the clean federation (the reference: what the rule reaches when no one lies) and once with the
flippers. The table shows both final test accuracies, what the flippers cost (paired by seed), how much
weight the rule gave them and how well its trust separates them (AUROC); the full report (curves,
trust heatmaps) is written too.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

from fedtrust.report import load_runs, write_report
from fedtrust.report.results import Cell, Run, mean_sd, table
from fedtrust.rules import RULES
from fedtrust.sim.settings import resolve_device
from fedtrust.sim.store import RunStore
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import run_experiment

#: Byzantine budgets for the rules that take one: the corrupted share, as far as each rule allows.
RULE_OPTIONS = {
    "trimmed_mean": {"f": 0.3},
    "krum": {"f": 0.3},
    "multi_krum": {"f": 0.3},
    "bulyan": {"f": 0.2},
    "dnc": {"f": 0.3},
}


def config(
    rounds: int = 30, seeds: int = 3, clients: int = 20, fraction: float = 0.3, device: str = "auto"
) -> dict:
    return {
        "name": "demo",
        "data": {"name": "digits", "clients": clients, "partition": {"name": "iid"}, "benchmark": 0.05},
        "model": {"name": "softmax"},
        "train": {
            "rounds": rounds,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.5,
            "eval_every": 1,
            "device": device,
        },  # fmt: skip
        "sweep": {
            "rule": [{"name": name, **RULE_OPTIONS.get(name, {})} for name in RULES],
            "corruption": [{"name": "none"}, {"name": "label_flip", "fraction": fraction}],
            "seed": list(range(seeds)),
        },
    }


def main(
    out: str | Path = "results",
    rounds: int = 30,
    seeds: int = 3,
    progress: bool = True,
    device: str = "auto",
    jobs: int = 1,
) -> list[Run]:
    from rich.console import Console
    from rich.table import Table

    cfg = validate(config(rounds=rounds, seeds=seeds, device=device))
    resolve_device(cfg.train.device)  # a device this machine lacks: refused before the first run
    root = Path(out) / cfg.name
    # One demo at a time on an --out: the demo always computes afresh, so it deletes its folder first, and a
    # second demo started meanwhile deleted the first one's runs, their locks included, while they were
    # written. The lock lives beside the folder it guards (RunLocked names its holder).
    with RunStore(Path(out) / f"{cfg.name}.lock").lock():
        shutil.rmtree(root, ignore_errors=True)
        began = time.perf_counter()
        run_experiment(cfg, out, progress=progress, jobs=jobs)
        elapsed = time.perf_counter() - began
        runs = load_runs(root)
        report = write_report(root)
    clean, attacked = "corruption=none", "corruption=label_flip"
    rules, _, accuracy = table(runs, Run.final)
    _, _, weight = table(runs, Run.corrupted_weight)
    _, _, auroc = table(runs, Run.mean_auroc)
    lost = _paired_loss(runs, clean, attacked)
    t = Table(
        title=f"digits, 20 clients, 6 flip their labels; softmax regression, {rounds} rounds, {seeds} seeds",
        caption=f"{len(runs)} runs in {elapsed:.0f} s. Clean: the same rule and federation with no one "
        "corrupted. Lost: clean less flipped accuracy, per seed. Weight on corrupted: the flippers' share "
        "of the aggregate (30% if not told apart). AUROC: how well trust separates them (0.5 = chance).",
    )
    for col in (
        "rule",
        "clean accuracy",
        "with 6 flippers",
        "lost",
        "weight on corrupted",
        "detection AUROC",
    ):
        t.add_column(col, justify="left" if col == "rule" else "right")

    def fmt(cell):
        if cell is None:
            return "-"
        failed = f" ({cell.failed} failed)" if cell.failed else ""
        return "failed" if not cell.count else f"{cell.mean:.3f} ± {cell.sd:.3f}{failed}"

    for rule in rules:
        row = [accuracy.get((rule, clean)), accuracy.get((rule, attacked)), lost.get(rule)]
        row += [weight.get((rule, attacked)), auroc.get((rule, attacked))]
        t.add_row(rule, *(fmt(c) for c in row))
    console = Console(width=120)
    console.print(t)
    console.print(f"Report: {report}")
    return runs


def _paired_loss(runs: list[Run], clean: str, attacked: str) -> dict[str, Cell]:
    """Per rule, the clean run's final metric less the attacked run's of the same seed, over seeds (a
    failed run leaves its pair out and is counted)."""
    finals: dict[tuple[str, str, int], float | None] = {}
    failed: dict[str, int] = {}
    for r in runs:
        if r.status == "finished":
            finals[(r.rule, r.setting, r.seed)] = r.final()
        else:
            failed[r.rule] = failed.get(r.rule, 0) + 1
    cells = {}
    for rule in dict.fromkeys(r.rule for r in runs):
        seeds = sorted({r.seed for r in runs if r.rule == rule})
        pairs = [(finals.get((rule, clean, s)), finals.get((rule, attacked, s))) for s in seeds]
        diffs = [a - b for a, b in pairs if a is not None and b is not None]
        mean, sd = mean_sd(diffs)
        cells[rule] = Cell(
            mean, sd, len(diffs), sum(not math.isfinite(d) for d in diffs), failed.get(rule, 0)
        )
    return cells
