"""Which side of each round the copy grouping (``sybils="share"``) merged, against who held the round's
majority: read from the runs' ``rounds.jsonl`` (``info.groups``, ``corrupted``), nothing recomputed.

    python experiments/arfl/grouped_sides.py results/arfl-table2 --rule focus --corruption label_shuffle --fraction 0.5

A round is "honest minority" when fewer than half of its clients are honest, "tie" at exactly half.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def tally(rounds: list[dict]) -> Counter:
    """Per kind of round (honest majority, tie, honest minority): how many rounds, and in how many the
    grouping merged honest clients or corrupted ones."""
    counts: Counter = Counter()
    for r in rounds:
        corrupted = dict(zip(r["clients"], r["corrupted"], strict=True))
        honest = len(corrupted) - sum(corrupted.values())
        kind = (
            "tie"
            if 2 * honest == len(corrupted)
            else ("honest majority" if 2 * honest > len(corrupted) else "honest minority")
        )
        grouped = [c for g in (r.get("info") or {}).get("groups") or [] for c in g["clients"]]
        counts[kind, "rounds"] += 1
        counts[kind, "honest grouped"] += any(not corrupted[c] for c in grouped)
        counts[kind, "corrupted grouped"] += any(corrupted[c] for c in grouped)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="an experiment's raw runs, e.g. results/arfl-table2")
    parser.add_argument("--rule", required=True)
    parser.add_argument("--corruption", required=True)
    parser.add_argument("--fraction", required=True)
    args = parser.parse_args()
    pattern = f"rule={args.rule}_corruption={args.corruption}_corruption.fraction={args.fraction}_seed=*"
    runs = sorted(args.results.glob(pattern))
    if not runs:
        raise SystemExit(f"results: no runs match {pattern!r} under {args.results}")
    counts: Counter = Counter()
    for run in runs:
        counts += tally(
            [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line]
        )
    print(f"{len(runs)} runs ({pattern})")
    for kind in ("honest majority", "tie", "honest minority"):
        print(
            f"{kind:>16}: {counts[kind, 'rounds']:4d} rounds; honest clients grouped in {counts[kind, 'honest grouped']}, "
            f"corrupted in {counts[kind, 'corrupted grouped']}"
        )


if __name__ == "__main__":
    main()
