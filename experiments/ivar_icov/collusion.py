"""Can a colluding group buy trust? IVAR and ICOV against an oracle that knows the true covariance.

Truth inference on synthetic tasks: I tasks, each with a true value y_i ~ N(0, 10^2); J sources report
x_ij = y_i + e_ij. Honest sources have independent noise of their own sd (spread over [0.5, 2]); a
colluding minority of g sources also shares one common error per task, c_i ~ N(0, s^2) (copies of one
bad model, annotators who consult each other), on top of a small own noise (sd 0.5). A fraction of the
entries is missing at random (every task keeps at least two sources). The oracle weights each task's
observed sources by the true covariance (eq 3 with the true Phi): the best linear unbiased estimate.

For every (group size, strength, missing rate, seed) each estimator's RMSE against the truth is
recorded, with the weight it gave the colluders (the mean over tasks of the colluders' summed
coefficients). The report is the mean over seeds of RMSE / oracle RMSE per estimator and setting,
and how often each estimator converged within its default budget.

    python experiments/ivar_icov/collusion.py                   # the full grid, 5 seeds (make collusion)
    python experiments/ivar_icov/collusion.py --seeds 3 --quick --out /tmp/quick  # a look (its own --out:
                                                                # the default is the full grid's report)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from fedtrust.inference import METHODS
from fedtrust.inference.icov import consensus_coefficients
from fedtrust.progress import Progress

HERE = Path(__file__).parent


def make_data(tasks: int, honest: int, group: int, strength: float, missing: float, seed: int):
    """(estimates with NaN for missing, truth, true covariance, colluder mask)."""
    g = torch.Generator().manual_seed(seed)
    sources = honest + group
    sd = torch.empty(sources, dtype=torch.float64)
    sd[:honest] = torch.linspace(0.5, 2.0, honest, dtype=torch.float64)[torch.randperm(honest, generator=g)]
    sd[honest:] = 0.5
    truth = 10.0 * torch.randn(tasks, generator=g, dtype=torch.float64)
    x = truth[:, None] + sd * torch.randn(tasks, sources, generator=g, dtype=torch.float64)
    x[:, honest:] += strength * torch.randn(tasks, 1, generator=g, dtype=torch.float64)
    bad = torch.zeros(sources, dtype=torch.bool)
    bad[honest:] = True
    phi = torch.diag(sd**2)
    phi[honest:, honest:] += strength**2
    present = torch.rand(tasks, sources, generator=g, dtype=torch.float64) >= missing
    for i in range(tasks):  # at least two sources per task
        while int(present[i].sum()) < 2:
            present[i, int(torch.randint(sources, (1,), generator=g))] = True
    order = torch.randperm(sources, generator=g)  # colluders are not the last columns
    x = torch.where(present, x, torch.nan)[:, order]
    return x, truth, phi[order][:, order], bad[order]


def oracle(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    present = ~torch.isnan(x)
    a = consensus_coefficients(phi, present)
    return (a * torch.nan_to_num(x)).sum(1)


def one(setting: dict, seed: int, methods: list[str]) -> dict:
    x, truth, phi, bad = make_data(seed=seed, **setting)
    present = ~torch.isnan(x)
    rows = {}
    best = oracle(x, phi)
    rows["oracle"] = {"rmse": float((best - truth).square().mean().sqrt()), "converged": True}
    plain = torch.nan_to_num(x).sum(1) / present.sum(1)
    rows["mean"] = {"rmse": float((plain - truth).square().mean().sqrt()), "converged": True}
    for name in methods:
        start = time.perf_counter()
        res = METHODS[name](x)
        seconds = time.perf_counter() - start
        consensus = res.consensus[:, 0]
        rows[name] = {
            "rmse": float((consensus - truth).square().mean().sqrt()),
            "colluder_weight": float(res.weights[:, bad].sum(1).mean()),
            "converged": bool(res.converged),
            "iterations": res.iterations,
            "seconds": seconds,
        }
    return rows


def grid(quick: bool) -> list[dict]:
    groups = (2, 4) if quick else (2, 3, 4, 5)
    strengths = (2.0,) if quick else (1.0, 2.0, 4.0)
    missing = (0.0, 0.3) if quick else (0.0, 0.3, 0.5)
    return [
        {"tasks": 200, "honest": 12 - g, "group": g, "strength": s, "missing": m}
        for g, s, m in itertools.product(groups, strengths, missing)
    ]


def report(results: list[dict], methods: list[str]) -> str:
    names = ["mean", *methods]
    lines = [
        "| group | strength | missing | oracle RMSE | " + " | ".join(names) + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(names),
    ]
    keyed: dict[tuple, list[dict]] = {}
    for r in results:
        s = r["setting"]
        keyed.setdefault((s["group"], s["strength"], s["missing"]), []).append(r["rows"])
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for key, runs in sorted(keyed.items()):
        base = statistics.mean(run["oracle"]["rmse"] for run in runs)
        cells = []
        for n in names:
            rel = [run[n]["rmse"] / run["oracle"]["rmse"] for run in runs]
            ratios[n].extend(rel)
            cells.append(f"{statistics.mean(rel):.2f}")
        lines.append(f"| {key[0]} | {key[1]:g} | {key[2]:.0%} | {base:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| estimator | RMSE / oracle (mean, worst) | colluders' weight (mean) | converged | "
              "iterations (median) | seconds (median) |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in names:
        runs = [r["rows"][n] for r in results]
        weight = [r["colluder_weight"] for r in runs if "colluder_weight" in r]
        its = [r["iterations"] for r in runs if "iterations" in r]
        secs = [r["seconds"] for r in runs if "seconds" in r]
        lines.append(
            f"| {n} | {statistics.mean(ratios[n]):.3f}, {max(ratios[n]):.2f} | "
            + (f"{statistics.mean(weight):.3f}" if weight else "-")
            + f" | {sum(r['converged'] for r in runs)}/{len(runs)} | "
            + (f"{statistics.median(its):g} | {statistics.median(secs):.3f}" if its else "- | -")
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)  # as make collusion and the committed report
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--out", type=Path, default=HERE / "reports" / "collusion")
    args = p.parse_args()
    torch.set_num_threads(1)  # tiny matrices: threads only contend
    results = []
    settings = grid(args.quick)
    with Progress(len(settings) * args.seeds, unit="tables") as bar:
        for setting in settings:
            for seed in range(args.seeds):
                results.append({"setting": setting, "seed": seed, "rows": one(setting, seed, args.methods)})
                bar.advance(1, f"group {setting['group']}, strength {setting['strength']:g}, seed {seed}")
    table = report(results, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "report.md").write_text(
        "# Colluding groups: RMSE relative to the oracle (true-covariance weighting)\n\n"
        "`python experiments/ivar_icov/collusion.py"
        + (f" --seeds {args.seeds}" if args.seeds != 10 else "")
        + (" --quick" if args.quick else "")
        + "`\n\n"
        + table
        + "\n"
    )
    print(table)


if __name__ == "__main__":
    main()
