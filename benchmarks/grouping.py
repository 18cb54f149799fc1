"""The copy grouping's cost in a round where groups merge: ``correlated_groups`` on n updates of which k
are one vector plus independent noise (so they correlate about the median and the centre is read again
about the sources' median), float32 on the CPU. Best and median of ``--repeat`` calls after one warm-up.

    python benchmarks/grouping.py --n 100 --copies 20 --d 1e5 1e6
    PYTHONPATH=<another tree>/src python benchmarks/grouping.py ...   # the same on other code
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedtrust.aggregators import sybils


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--d", type=float, nargs="+", default=[1e5, 1e6])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for d in map(int, args.d):
        g = torch.Generator().manual_seed(0)
        x = 0.1 * torch.randn(args.n, d, generator=g)
        x[: args.copies] = torch.randn(d, generator=g) + 0.01 * torch.randn(args.copies, d, generator=g)
        groups = sybils.Groups.singletons(args.n)
        out = sybils.correlated_groups(x, groups)
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            sybils.correlated_groups(x, groups)
            times.append(time.perf_counter() - start)
        merged = [len(m) for m in out.members if len(m) > 1]
        best, median = min(times) * 1e3, statistics.median(times) * 1e3
        print(f"n={args.n} d={d:.0e}: best {best:.1f} ms, median {median:.1f} ms; merged groups {merged}")


if __name__ == "__main__":
    main()
