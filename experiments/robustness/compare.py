"""Two sources' cached runs side by side: which runs both computed, how many agree digit for digit
(accuracy, backdoor ASR, failure), and the ones that moved. Reads ``reports/runs.jsonl`` (``--cache``: one or
more run caches, e.g. a report folder's own beside the main one); computes nothing.

    python experiments/robustness/compare.py 6e8ec2235896fb26 13ccdf38f776e476 --data digits
"""

from __future__ import annotations

import argparse
from pathlib import Path

from run import REPORTS, load_cache

#: What a run's result is: a re-run agrees when all of these are equal
RESULT = ("accuracy", "backdoor_asr", "failure")


def compare(rows: list[dict], old: str, new: str, data: str) -> tuple[int, list[tuple]]:
    """(how many runs both sources computed, the (rule, attack, share, seed, old result, new result) of
    those whose results differ)."""
    runs: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("data") == data and row.get("code") in (old, new):
            runs.setdefault((row["rule"], row["attack"], row["fraction"], row["seed"]), {})[row["code"]] = row
    shared = {k: v for k, v in runs.items() if old in v and new in v}
    moved = []
    for k, v in sorted(shared.items(), key=str):
        before, after = (tuple(v[code].get(f) for f in RESULT) for code in (old, new))
        if before != after:
            moved.append((*k, before, after))
    return len(shared), moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--data", default="digits", choices=["digits", "fashion_mnist"])
    parser.add_argument("--cache", type=Path, nargs="+", default=[REPORTS / "runs.jsonl"])
    args = parser.parse_args()
    rows = [row for path in args.cache for row in load_cache(path).values()]
    shared, moved = compare(rows, args.old, args.new, args.data)
    if not shared:
        where = ", ".join(map(str, args.cache))
        raise SystemExit(f"no run of {args.data} was computed by both {args.old} and {args.new} in {where}")
    print(f"{args.data}: {shared} runs computed by both; {shared - len(moved)} identical, {len(moved)} moved")
    for rule, attack, share, seed, before, after in moved:
        print(f"  {rule}, {attack} {share:.0%}, seed {seed}: {before} -> {after}")


if __name__ == "__main__":
    main()
