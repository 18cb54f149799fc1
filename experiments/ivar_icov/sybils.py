"""Issue 17, "trust that colluders cannot buy": final accuracy of the trust rules (IVAR/ICOV, ARFL,
FOCUS) and two baselines when 30% of the clients send identical updates.

digits, 20 clients, Dirichlet(0.5) shares, softmax regression, 30 rounds (lr 0.5, one local epoch, the
server keeps 5% of the data as FOCUS's benchmark), every client in every round; 30% of the clients
corrupted with

- ``clean``: no attack;
- ``mimic``: every corrupted client sends a copy of one benign client's update (Karimireddy et al. 2022),
  the first benign one (``target=0``; the attack's default, the client furthest along the benign
  updates' top variance direction chosen afresh each round, moves between clients and hurts less here);
- ``ipm3``: every corrupted client sends -3 x the benign mean (inner-product manipulation, epsilon = 3);
- ``absent``: the corrupted clients' updates left out of every round (the same runs otherwise): what the
  rule reaches on the 70% honest clients alone, the most a defence can hope for.

Rules that take ``sybils`` run twice: ``sybils="off"`` (each client its own source, the behaviour
before issue 17) and the default ``sybils="share"`` (a group of near-duplicate updates shares one vote).
A run that raises is counted as a crash and left out of the mean; rounds the rule refused (the simulator
records the error and goes on) are counted beside the accuracy.

    python experiments/ivar_icov/sybils.py --out experiments/ivar_icov/reports/sybils.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from fedtrust.aggregators import leaving_out
from fedtrust.progress import Progress
from fedtrust.rules import rule_options
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

TRUST = ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb", "arfl", "focus"]
BASELINES = ["fedavg", "centered_clipping"]
ATTACKS = {
    "clean": {"name": "none"},
    "mimic": {"name": "mimic", "target": 0},
    "ipm3": {"name": "ipm", "epsilon": 3.0},
    "absent": {"name": "mimic", "target": 0},  # run with the corrupted clients left out
}


def config(rule: dict, attack: str, seed: int, rounds: int, fraction: float = 0.3) -> dict:
    corruption = dict(ATTACKS[attack])
    if corruption["name"] != "none":
        corruption["fraction"] = fraction
    return {
        "name": "sybils",
        "seed": seed,
        "data": {
            "name": "digits",
            "clients": 20,
            "partition": {"name": "dirichlet", "alpha": 0.5},
            "benchmark": 0.05,
        },
        "model": {"name": "softmax"},
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.5},
        "corruption": corruption,
        "rule": rule,
    }


def variants(names: list[str]) -> list[tuple[str, dict]]:
    out = []
    for name in names:
        if "sybils" in rule_options(name):
            out += [(f"{name} (sybils=off)", {"name": name, "sybils": "off"}), (name, {"name": name})]
        else:
            out.append((name, {"name": name}))
    return out


def without_corrupted(sim):
    """Leave the corrupted clients' updates out of every round of ``sim``."""
    sim.rule = leaving_out(
        sim.rule, [i for i, b in zip(sim.fed.ids, sim.fed.corrupted.tolist(), strict=True) if b]
    )
    return sim


def final_accuracy(cfg: dict, absent: bool = False) -> tuple[float, int] | str:
    """(final accuracy, rounds the rule refused), or the exception's name."""
    try:
        sim = build_simulation(validate(cfg))
        records = (without_corrupted(sim) if absent else sim).run()
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        return f"{type(exc).__name__}"
    return records[-1]["metrics"]["accuracy"], sum(r["error"] is not None for r in records)


def cell(results: list) -> str:
    ok = [r[0] for r in results if isinstance(r, tuple)]
    refused = sum(r[1] for r in results if isinstance(r, tuple))
    crashed = len(results) - len(ok)
    text = "-" if not ok else f"{statistics.mean(ok):.3f}"
    if len(ok) > 1:
        text += f" ± {statistics.stdev(ok):.3f}"
    if refused:
        text += f" ({refused} rounds refused)"
    if crashed:
        text += f" ({crashed} crashed: {', '.join(sorted({r for r in results if isinstance(r, str)}))})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rules", nargs="*", default=TRUST + BASELINES)
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--out", type=Path, help="write the markdown table here (also printed)")
    args = parser.parse_args()

    start = time.perf_counter()
    rows = []
    rules = variants(args.rules)
    with Progress(len(rules) * len(args.attacks) * args.seeds, unit="runs") as bar:
        for label, rule in rules:
            cells = []
            for attack in args.attacks:
                if attack == "absent" and rule.get("sybils") == "off":
                    cells.append("(as share: no copies)")
                    bar.advance(args.seeds, f"{label}, {attack}")
                    continue
                results = []
                for s in range(args.seeds):
                    results.append(
                        final_accuracy(config(rule, attack, s, args.rounds), absent=attack == "absent")
                    )
                    bar.advance(1, f"{label}, {attack}, seed {s}")
                cells.append(cell(results))
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
    header = [
        f"Final test accuracy, mean ± sd over {args.seeds} seeds: digits, 20 clients, Dirichlet(0.5), "
        f"softmax, {args.rounds} rounds, 30% of the clients corrupted "
        f"({time.perf_counter() - start:.0f} s).",
        "",
        "| rule | " + " | ".join(args.attacks) + " |",
        "|---|" + "---|" * len(args.attacks),
    ]
    table = "\n".join(header + rows) + "\n"
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)


if __name__ == "__main__":
    main()
