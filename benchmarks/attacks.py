"""Every update attack's cost per round against the one-read floor, and against ByzFL's attacks on the
same inputs.

    python benchmarks/attacks.py                       # n in {10, 100} x d in {1e5, 1e6}
    python benchmarks/attacks.py --n 100 --d 1e7       # one shape

A round: n honest N(0.1, 1) float32 updates, f = n/5 of them corrupted. Each attack is timed on a
fresh context (set-up untimed, median of repeated calls, as in ``aggregation.py``): the searching ones
(min-max's and min-sum's gamma, Fang et al.'s lambda and intervals) run on the round's matrix in torch;
the optimal ALIE / IPM query the server's rule, here the mean (``rule("mean")`` on a fresh ``Round``,
screening included), 18 times a round. ByzFL 0.0.11's attacks (``byzfl.attacks``, numpy or torch
input, the faster counts) return one vector for the corrupted clients to copy; its optimal variants are
given the same rule (its ``Average``, no pre-aggregator) and 18 evaluations. Writes
benchmarks/results/attacks.md and .json.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from fedtrust import Round, rule
from fedtrust.attacks import ATTACKS, AttackContext, attack

sys.path.insert(0, str(Path(__file__).parent))
from aggregation import machine, timed  # noqa: E402
from peers import byzfl_aggregators  # noqa: E402

#: Options for attacks that need them on a synthetic round.
OPTIONS = {"mimic": {"target": 0}}


def context(n: int, d: int, f: int, oracle: bool) -> AttackContext:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g) + 0.1
    bad = torch.zeros(n, dtype=torch.bool)
    bad[:f] = True
    mean = rule("mean")
    aggregate = (lambda u: mean(Round(updates=u)).vector) if oracle else None
    return AttackContext(x, bad, torch.zeros(d), "params", torch.Generator().manual_seed(1), 1, aggregate)


def byzfl_attacks(f: int):
    """(fedtrust attack name, ByzFL callable on the honest vectors) pairs, or [] without ByzFL."""
    if byzfl_aggregators() is None:
        return []
    module = importlib.import_module("byzfl.attacks.attacks")
    from byzfl.aggregators import Average

    return [
        ("alie", module.ALittleIsEnough(tau=1.5)),
        ("ipm", module.InnerProductManipulation(tau=0.1)),
        ("mimic", module.Mimic(epsilon=0)),
        ("optimal_alie", module.Optimal_ALittleIsEnough(agg=Average(), pre_agg_list=[], f=f, evals=18)),
        (
            "optimal_ipm",
            module.Optimal_InnerProductManipulation(agg=Average(), pre_agg_list=[], f=f, evals=18),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--d", type=float, nargs="+", default=[1e5, 1e6])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = []
    for n in args.n:
        for d in map(int, args.d):
            f = max(1, n // 5)
            ctx = context(n, d, f, oracle=True)
            floor, _ = timed(lambda x: x.mean(0), lambda ctx=ctx: ctx.updates, args.repeat)
            peers = dict(byzfl_attacks(f))
            for name in ATTACKS:
                a = attack(name, **OPTIONS.get(name, {}))
                # a fresh context a call, as each round has: what an attack caches on it (the finite
                # rows, a partial attacker's stand-ins, the rule-querying buffers) is paid every round
                seconds, _ = timed(a, lambda ctx=ctx: replace(ctx), args.repeat)
                row = {"attack": name, "n": n, "d": d, "seconds": seconds, "floors": seconds / floor}
                if name in peers:
                    honest = ctx.benign
                    peer = peers[name]
                    as_numpy = honest.numpy()
                    best = min(timed(peer, lambda a=a: a, args.repeat)[0] for a in (honest, as_numpy))
                    row.update(byzfl_seconds=best, speedup=best / seconds)
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine(), "command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "attacks.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    shapes = sorted({(r["n"], r["d"]) for r in rows})
    lines = [
        "# Attacks: time per round",
        "",
        f"{info['when']}, {info['machine']['cpu']}, {info['machine']['threads']} threads, "
        f"fedtrust {info['machine']['fedtrust']}, torch {info['machine']['torch']}, "
        f"byzfl {info['machine']['byzfl']}. Command: `{info['command']}`",
        "",
        "Milliseconds per round (floors: one `x.mean(0)` read of the n x d matrix); ByzFL's time and the "
        "speed-up over it where ByzFL has the attack.",
        "",
        "| attack | " + " | ".join(f"{n} x {d:.0e}" for n, d in shapes) + " |",
        "|---|" + "---:|" * len(shapes),
    ]
    for name in ATTACKS:
        cells = []
        for n, d in shapes:
            r = next(r for r in rows if (r["attack"], r["n"], r["d"]) == (name, n, d))
            text = f"{r['seconds'] * 1e3:.2f} ms ({r['floors']:.1f}F)"
            if "byzfl_seconds" in r:
                text += f"; ByzFL {r['byzfl_seconds'] * 1e3:.2f} ms, {r['speedup']:.1f}x"
            cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (args.out / "attacks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
