"""What a rule asks of a GPU at a small round, counted on the CPU: kernel launches, syncs, transfers.

    python benchmarks/launches.py                    # every rule, n in {10, 100}, d = 1000
    python benchmarks/launches.py --n 10 --rules geometric_median krum --kernels

At a small round (n = 10, d = 1e6 is 40 MB, one read in 27 us on an H200) a GPU rule's time is not its
reads of memory but what the host does around them: each operation on the device is a kernel launched
(its Python and dispatch overhead on the host), each scalar read back (``float(t)``, ``.item()``) a
sync that waits for every queued kernel, each tensor moved to the host a transfer. This script runs
every rule on ``gpu.py``'s attacked round (``aggregation.py``'s: n/5 clients send 10x larger vectors)
placed on the test suite's emulated device (``tests/elsewhere.py``: CPU data presented as another
device, every torch operation checked as CUDA would check it), and counts

- **launches**: operations on the device that compute (not views, allocations or transfers);
- **syncs**: scalars read from the device; **transfers**: tensors copied to the host;
- **uploads**: CPU tensors copied to the device (weights a pass hands back, a CPU index): on CUDA a copy
  from pageable memory waits for the kernels queued before it, as a sync does (though right after a
  transfer, with nothing queued, it costs little more than the copy);
- **host ops**: torch operations on CPU tensors (a rule's arithmetic on n numbers after a transfer).

The counts are the same on every machine (no timing). They hold for one column block, the device's
block at these sizes (``aggregators/chunks.py``: 128 MiB ``"cached"``, 512 MiB ``"stream"``); larger
rounds add a few launches per block. The median and the trimmed mean take Triton's kernels on CUDA, a
torch sort here (counted as such). Results: ``benchmarks/results/launches.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from aggregation import attacked_round, options_for  # noqa: E402
from elsewhere import elsewhere, to_elsewhere  # noqa: E402

from fedtrust import Round, rule  # noqa: E402
from fedtrust.rules import RULES  # noqa: E402


def count(name: str, options: dict, r: Round) -> dict:
    """One call of a fresh ``name`` on ``r`` placed on the emulated device: what it asked of the device."""
    with elsewhere() as host:
        there = Round(  # the reported numbers on the host, as a server receives them (gpu.py's round)
            updates=to_elsewhere(r.updates),
            client_ids=r.client_ids,
            num_samples=r.num_samples,
            metrics=dict(r.metrics),
            reference=r.reference,
        )
        made = Counter(host.kernels), host.host_ops, host.uploads  # placing the round (none, as it is)
        rule(name, **options)(there)
    kernels = host.kernels - made[0]
    return {
        "launches": sum(kernels.values()),
        "syncs": host.syncs,
        "transfers": host.transfers,
        "uploads": host.uploads - made[2],
        "host_ops": host.host_ops - made[1],
        "kernels": dict(kernels.most_common()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--d", type=float, default=1e3)
    parser.add_argument("--rules", nargs="+", default=[name for name in RULES if "+" not in name])
    parser.add_argument("--kernels", action="store_true", help="print each rule's launches by operation")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write .md and .json (default: benchmarks/results/launches for a "
        "run of the default rules and sizes; a partial run writes only where told)",
    )
    args = parser.parse_args()
    if args.out is None and (args.n, args.d, args.rules) == tuple(
        parser.get_default(k) for k in ("n", "d", "rules")
    ):
        args.out = HERE / "results" / "launches"
    rows = []
    for n in args.n:
        r, f = attacked_round(n, int(args.d))
        for name in args.rules:
            row = {"rule": name, "n": n, **count(name, options_for(name, n, f), r)}
            rows.append(row)
            print(f"n={n:4d} {name:20s} launches {row['launches']:5d} syncs {row['syncs']:3d} transfers "
                  f"{row['transfers']:3d} uploads {row['uploads']:3d} host ops {row['host_ops']:6d}",
                  flush=True)  # fmt: skip
            if args.kernels:
                print("      ", ", ".join(f"{k} {v}" for k, v in row["kernels"].items()))
    if args.out is None:
        print("(a partial run: not written; --out PATH writes it)")
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    head = commit.stdout.strip() or "unknown"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"commit": head, "d": int(args.d), "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# What each rule asks of a GPU at a small round",
        "",
        f"Counted on the CPU by `python benchmarks/launches.py` at commit {head} (d = {int(args.d)}, one "
        "column block; `launches.py`'s docstring says what is counted). Options as in `gpu.py`'s "
        "*ms* column (`aggregation.py`'s f = n/5).",
        "",
        "| rule | "
        + " | ".join(f"n = {n}: launches / syncs / transfers / uploads / host ops" for n in args.n)
        + " |",
        "|---|" + "---:|" * len(args.n),
    ]
    for name in args.rules:
        cells = [next(r for r in rows if r["rule"] == name and r["n"] == n) for n in args.n]
        counts = [
            f"{c['launches']} / {c['syncs']} / {c['transfers']} / {c['uploads']} / {c['host_ops']}"
            for c in cells
        ]
        lines.append(f"| {name} | " + " | ".join(counts) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
