"""One cell of the robustness table, round by round: the attackers' share of each round's weight, the
groups that shared a vote (how many members, how many of them attackers) and the model's accuracy and
backdoor attack success rate after the round. Runs the config in-process as run.py builds the table's
cell (``config``, ``simulation``), caches nothing.

    python experiments/robustness/rounds.py --data fashion_mnist --rule focus --attack backdoor \\
        --fraction 0.4 --seed 0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the table's own config)


def describe(record: dict) -> str:
    """One round's line: the attackers' weight, the groups as (members, attackers), the metrics."""
    bad = dict(zip(record["clients"], record["corrupted"], strict=True))
    weights = record["weights"]
    share = sum(w for w, c in zip(weights, record["corrupted"], strict=True) if c) if weights else None
    groups = [
        (len(g["clients"]), sum(bad[c] for c in g["clients"]))
        for g in (record.get("info") or {}).get("groups") or []
    ]
    metrics = record["metrics"] or {}
    parts = [f"round {record['round']:>3}", "attackers' weight " + ("-" if share is None else f"{share:.3f}")]
    parts.append("groups (members, attackers) " + (", ".join(f"({m}, {a})" for m, a in groups) or "none"))
    for name in ("accuracy", "backdoor_asr"):
        if metrics.get(name) is not None:
            parts.append(f"{name} {metrics[name]:.4f}")
    if record.get("error"):
        parts.append(f"error: {record['error']}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="digits", choices=["digits", "fashion_mnist"])
    parser.add_argument("--model", default="softmax", choices=["softmax", "mlp"])
    parser.add_argument(
        "--rule", required=True, help='a rule as the table names it, e.g. "focus(sybils=copies)"'
    )
    parser.add_argument("--attack", required=True, choices=list(run.ATTACKS))
    parser.add_argument("--fraction", type=float, default=0.4, choices=run.FRACTIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    cfg = run.config(args.data, args.model, args.rule, args.attack, args.fraction, args.seed, args.rounds)
    lines = [describe(r) for r in run.simulation(cfg).run()]  # built as the table's cell is
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
