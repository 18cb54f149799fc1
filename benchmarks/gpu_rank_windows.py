"""Rank windows on a CUDA GPU: each Triton kernel (sort, count, select) against the torch path, by n.

For n clients x d float32 ``randn`` coordinates (and two float64 shapes), the median window (and at the
largest n a trimmed one, lo = n // 10 .. n - n // 10, where the select kernel finds two edges at once)
through ``triton_windows.rank_window`` with each kernel and tile setting, against
``rank_windows.rank_window_by_sort`` plus ``passes.row_norms`` (what the torch path costs for the same
outputs), and one ``x.mean(0)`` (a read of the matrix). Every kernel's values, weights and norms are
checked against the torch path's before it is timed. Writes ``results/gpu_rank_windows.json``; the
table in ``src/fedtrust/aggregators/triton_windows.py`` is read from it. Needs a CUDA device and Triton.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from fedtrust.aggregators import triton_windows
from fedtrust.aggregators.passes import row_norms
from fedtrust.aggregators.rank_windows import rank_window_by_sort

sys.path.insert(0, str(Path(__file__).parent))
from gpu import timed as timed_seconds  # noqa: E402


def timed(call) -> float:
    """Milliseconds: gpu.py's median of 5 synchronised calls after a warm-up."""
    return timed_seconds(call, 5, torch.device("cuda")) * 1e3


#: (label, kernel, values per tile, warps) timed at every n; MORE_TILES also at the largest n
VARIANTS = [("sort", "sort", 8192, 4), ("count2k", "count", 2048, 4), ("count4k", "count", 4096, 4),
            ("select2k", "select", 2048, 4), ("select4k", "select", 4096, 4)]  # fmt: skip
MORE_TILES = [("count2k8w", "count", 2048, 8), ("select2k2w", "select", 2048, 2),
              ("select4k8w", "select", 4096, 8)]  # fmt: skip
#: also timed up to SORT_CLIENTS: the sort kernel's 8192-value tile takes 255 registers a thread on sm_90
#: (kernel_model.py), these 80 and 80
SORT_TILES = [("sort4k8w", "sort", 4096, 8), ("sort2k", "sort", 2048, 4)]


def measure(n: int, d: int, dtype: torch.dtype, variants: list[tuple], window: str = "median") -> dict:
    x = torch.randn(n, d, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(n))
    if window == "median":
        lo, hi = (n // 2, n // 2 + 1) if n % 2 else (n // 2 - 1, n // 2 + 1)
    else:
        lo, hi = n // 10, n - n // 10
    want = (*rank_window_by_sort(x, lo, hi), row_norms(x))
    row = {"n": n, "d": d, "dtype": str(dtype).removeprefix("torch."), "window": window,
           "floor": timed(lambda: x.mean(0)),
           "torch": timed(lambda: (rank_window_by_sort(x, lo, hi), row_norms(x)))}  # fmt: skip
    saved = dict(triton_windows.TILES), dict(triton_windows.WARPS)
    try:
        for label, method, tile, warps in variants:
            triton_windows.TILES[method], triton_windows.WARPS[method] = tile, warps
            triton_windows.FAILURES.clear()
            got = triton_windows.rank_window(x, lo, hi, method)
            if method in triton_windows.FAILURES:
                row[label] = f"failed: {triton_windows.FAILURES[method]}"
                continue
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)
            row[label] = timed(lambda m=method: triton_windows.rank_window(x, lo, hi, m))
    finally:
        triton_windows.TILES.update(saved[0])
        triton_windows.WARPS.update(saved[1])
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 16, 32, 64, 100])
    parser.add_argument("--d", type=float, nargs="+", default=[1e6, 1e7])
    default = Path(__file__).parent / "results" / "gpu_rank_windows.json"
    parser.add_argument("--out", type=Path, default=default)
    args = parser.parse_args()
    if not torch.cuda.is_available() or triton_windows._kernels() is None:
        print("benchmarks/gpu_rank_windows.py needs a CUDA device and Triton", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    for d in args.d:
        for n in args.n:
            variants = VARIANTS + (MORE_TILES if n == max(args.n) else [])
            variants += SORT_TILES if n <= triton_windows.SORT_CLIENTS else []
            rows.append(measure(n, int(d), torch.float32, variants))
    top = max(args.n)
    rows.append(measure(top, int(max(args.d)), torch.float32, VARIANTS[1:], window="trimmed"))
    for n in (min(args.n), top):
        rows.append(
            measure(
                n, int(max(args.d)), torch.float64, [v for v in VARIANTS if v[2] == 2048 or v[0] == "sort"]
            )
        )
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    payload = {"gpu": torch.cuda.get_device_name(), "versions": versions, "rows": rows}
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
