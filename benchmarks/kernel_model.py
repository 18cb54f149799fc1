"""What each Triton rank-window kernel issues on an NVIDIA GPU, read from its machine code: no GPU needed.

    python benchmarks/kernel_model.py              # sm_90 (H100/H200): n in {10, 16, 32, 64, 100}, d = 1e7,
                                                   # float32 and float64
    python benchmarks/kernel_model.py --check      # every kernel builds for sm_90 without spills

Triton compiles each kernel of ``fedtrust.aggregators.triton_kernels`` for the target on the CPU
(``ptxas`` and ``cuobjdump`` ship with Triton's NVIDIA backend), with the tile the launch would use
(``triton_windows._grid``, ``WARPS``). From the SASS the script reads the registers, spills, each loop's
instructions and those outside loops, and models the launch's issue: every warp issues its
instructions one a cycle on one of an SM's 4 schedulers, so it issues (outside + sum of loop length x
trips) x warps x programs warp-instructions, at ``--sms`` x 4 x ``--ghz``. That is a floor from
instruction issue alone (memory, latency and occupancy ignored; both branches' straight-line code
counted, a subroutine called in a loop counted once), not a time: the ``measured`` column, where
``results/gpu_rank_windows.json`` has a time for the same kernel and tile, says how far off it is.

The median window of an (n, d) matrix (lo = n // 2 - 1 .. n // 2 for even n), a trimmed window
(lo = n // 10 .. n - n // 10) for the select kernel, whose descent counts two ranks at once there, and
Bulyan's second phase with ``aggregation.py``'s f. The select kernel's descent stops once each column's
bits fixed leave one key in range, so its trips depend on the data: they are counted on the CPU for
``randn`` columns, the data ``gpu_rank_windows.py`` times (:func:`descent_trips`). Needs Triton
(torch's CUDA builds ship it); exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

KERNELS = ["sort", "count", "select", "closest"]


def launches(method: str, n: int, dtype: torch.dtype) -> list[tuple[str, int, list[float]]]:
    """(window, rows the kernel ranks, trips of each loop in the order the SASS holds them) of each
    launch modelled for n clients: the count kernel's tally reads the n rows; select's descent takes a
    bit a trip until its ranges are single keys (:func:`descent_trips`), one rank (a median's one or two
    ranks) or two at once (a trimmed window); the sort kernel's network is unrolled; Bulyan's kernel
    (f = n // 5 as ``aggregation.py`` sets it, within n >= 4f + 3) tallies and runs over its theta
    selected rows, then over its theta - beta + 1 windows."""
    if method == "closest":
        f = min(n // 5, (n - 3) // 4)
        theta = n - 2 * f
        beta = theta - 2 * f
        return [(f"bulyan f={f}", theta, [theta, theta, theta - beta + 1])]
    median_lo = n // 2 if n % 2 else n // 2 - 1
    if method != "select":
        return [("median", n, {"sort": [], "count": [n]}[method])]
    return [("median", n, [descent_trips(n, dtype, [median_lo]), 0]),
            ("trimmed", n, [0, descent_trips(n, dtype, [n // 10, n - n // 10 - 1])])]  # fmt: skip


def descent_trips(n: int, dtype: torch.dtype, ranks: list[int], columns: int = 1 << 16) -> float:
    """The select kernel's descent trips a program takes on ``columns`` columns of n ``randn`` values
    (gpu_rank_windows.py's data), averaged over its programs: a column's ranges are single keys once the
    bits fixed part each rank's key from its neighbours in order (one bit past their longest common prefix
    of bits; every bit where a neighbour is a copy), and the program stops with its slowest column."""
    from fedtrust.aggregators import triton_windows

    width = torch.finfo(dtype).bits
    n_pad, block, _ = triton_windows._grid("select", n, columns)
    x = torch.randn(n, columns, dtype=dtype, generator=torch.Generator().manual_seed(n))
    x[x == 0] = 0.0  # -0.0 is +0.0's key
    bits = x.view(torch.int32 if width == 32 else torch.int64).to(torch.int64)
    top = (1 << (width - 1)) - 1
    keys = torch.where(bits >= 0, bits, bits ^ top)  # ordered as the values, as signed integers
    padding = torch.full((n_pad - n, columns), top, dtype=torch.int64)  # the largest key
    keys = torch.cat([keys, padding]).sort(0).values
    need = torch.ones(columns, dtype=torch.int64)
    for r in ranks:
        for neighbour in (r - 1, r + 1):
            if 0 <= neighbour < n_pad:
                need = torch.maximum(need, 1 + common_bits(keys[r] ^ keys[neighbour], width))
    need = need.clamp_max(width)
    return float(need[: columns // block * block].view(-1, block).max(1).values.double().mean())


def common_bits(xor: torch.Tensor, width: int) -> torch.Tensor:
    """The leading bits two ``width``-bit keys share, from their xor (an int64 of the same sign trick)."""
    length = torch.zeros_like(xor)
    rest = xor.clamp_min(0)
    for shift in (32, 16, 8, 4, 2, 1):
        high = rest >= (1 << shift)
        length += high * shift
        rest = torch.where(high, rest >> shift, rest)
    length += rest > 0
    return torch.where(xor < 0, 0, width - length)


RESULTS = Path(__file__).parent / "results"


def compiled(method: str, dtype: torch.dtype, n: int, d: int, arch: int):
    """Triton's build of kernel ``method`` for ``n`` x ``d`` of ``dtype`` on ``sm_<arch>``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from fedtrust.aggregators import triton_windows

    n_pad, block, programs = triton_windows._grid("count" if method == "closest" else method, n, d)
    ptr = "*fp64" if dtype == torch.float64 else "*fp32"
    if method == "closest":
        signature = {"x_ptr": ptr, "sel_ptr": "*i64", "out_ptr": ptr, "parts_ptr": "*fp64"}
        scalars = ["n", "d", "stride_row", "stride_col", "beta", "mlo", "mhi"]
        shape = {"N_PAD": n_pad, "M_PAD": triton_windows._padded(n + 1), "BLOCK": block}
    else:
        signature = {"x_ptr": ptr, "out_ptr": ptr, "parts_ptr": ptr, "sq_ptr": ptr}
        scalars = ["n", "d", "stride_row", "stride_col", "lo", "hi"]
        shape = {"N_PAD": n_pad, "BLOCK": block}
    signature |= {name: "i32" for name in scalars} | {name: "constexpr" for name in shape}
    fn = triton_windows._kernels()[method]
    # as a launch specialises (a contiguous row's stride of 1, 16-byte aligned pointers, a row stride of d
    # divisible by 16) unless the kernel says not to
    fixed = {} if "stride_col" in fn.do_not_specialize else {"stride_col": 1}
    signature |= {name: "constexpr" for name in fixed}
    aligned = [name for name, kind in signature.items() if kind.startswith("*")]
    aligned += [name for name in ["stride_row"] if d % 16 == 0 and name not in fn.do_not_specialize]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs={**fixed, **shape}, attrs=attrs)
    warps = triton_windows.WARPS["count" if method == "closest" else method]
    kernel = compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    return kernel, warps, programs


def read_sass(kernel, workdir: Path) -> dict:
    """Registers, spill stores and instructions (outside loops, and each loop's, in SASS order) of a
    compiled kernel, by Triton's cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = workdir / f"{kernel.metadata.name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    lines = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, flags=re.M)
    addresses = [int(a, 16) for a, _ in lines]
    loops = []
    for address, text in zip(addresses, (t for _, t in lines), strict=True):
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)  # (BRA 0x.., BRA P0, 0x.., BRA !P0, ...)
        if target and int(target.group(1), 16) < address:  # a backward branch closes a loop
            start = int(target.group(1), 16)
            loops.append(sum(start <= a <= address for a in addresses))
    registers = int(re.search(r"REG:(\d+)", usage.stdout).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage.stdout).group(1))
    return {"registers": registers, "local_bytes": local, "instructions": len(lines) - sum(loops),
            "loops": loops}  # fmt: skip


def measured(method: str, n: int, d: int, dtype: str) -> float | None:
    """The time ``results/gpu_rank_windows.json`` has for this kernel at its current tile (ms), if any."""
    path = RESULTS / "gpu_rank_windows.json"
    if not path.exists():
        return None
    from fedtrust.aggregators import triton_windows

    label = "sort" if method == "sort" else f"{method}{triton_windows.TILES[method] // 1024}k"
    for row in json.loads(path.read_text())["rows"]:
        same = (row["n"], row["d"], row["dtype"], row.get("window", "median")) == (n, d, dtype, "median")
        if same and isinstance(row.get(label), float):
            return row[label]
    return None


def model(args, workdir: Path) -> list[dict]:
    rows = []
    rate = args.sms * 4 * args.ghz * 1e9  # warp-instructions a second
    for dtype, n, method in [(t, n, m) for t in args.dtype for n in args.n for m in KERNELS]:
        name = str(dtype).removeprefix("torch.")
        for window, ranked, trips in launches(method, n, dtype):
            kernel, warps, programs = compiled(method, dtype, ranked, args.d, args.arch)
            sass = read_sass(kernel, workdir)
            if len(trips) != len(sass["loops"]):
                raise SystemExit(f"{method}: {len(sass['loops'])} loops in its SASS, the model has {trips}")
            issued = sass["instructions"] + sum(
                t * size for t, size in zip(trips, sass["loops"], strict=True)
            )
            timed = measured(method, n, args.d, name) if window == "median" else None
            row = {"n": n, "d": args.d, "dtype": name, "kernel": method, "window": window, "rows": ranked,
                   **sass, "warps": warps, "programs": programs,
                   "model_ms": issued * warps * programs / rate * 1e3, "measured_ms": timed}  # fmt: skip
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return rows


def check(args, workdir: Path) -> None:
    """Every kernel builds for the target, float32 and float64, at the tiles of 2, 17 and the most
    clients the kernels serve, and spills nothing to local memory."""
    from fedtrust.aggregators import triton_windows

    for method in KERNELS:
        for dtype in (torch.float32, torch.float64):
            for n in (2, 17, triton_windows.MAX_CLIENTS):
                kernel, _, _ = compiled(method, dtype, n, args.d, args.arch)
                sass = read_sass(kernel, workdir)
                print(method, str(dtype).removeprefix("torch."), n, sass)
                if sass["local_bytes"]:
                    raise SystemExit(
                        f"{method} at n = {n} spills {sass['local_bytes']} bytes to local memory"
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 16, 32, 64, 100])
    parser.add_argument("--d", type=float, default=1e7)
    parser.add_argument("--dtype", choices=["float32", "float64"], nargs="+", default=["float32", "float64"])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--ghz", type=float, default=1.98)
    parser.add_argument("--check", action="store_true", help="only check that every kernel builds")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_model.json")
    args = parser.parse_args()
    args.d, args.dtype = int(args.d), [getattr(torch, name) for name in args.dtype]
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter builds no machine code")
    try:
        import triton
    except ImportError:
        print("benchmarks/kernel_model.py needs Triton (torch's CUDA builds ship it)", file=sys.stderr)
        raise SystemExit(2) from None
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "fedtrust-kernel-model"
    workdir.mkdir(exist_ok=True)
    if args.check:
        check(args, workdir)
        return
    rows = model(args, workdir)
    what = ("warp-instructions issued / (SMs x 4 schedulers x clock), from the SASS, no GPU: an issue floor, "
            "not a time (measured_ms: results/gpu_rank_windows.json)")  # fmt: skip
    payload = {"target": f"sm_{args.arch}, {args.sms} SMs at {args.ghz} GHz", "triton": triton.__version__,
               "command": " ".join(["python benchmarks/kernel_model.py", *sys.argv[1:]]), "model": what,
               "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
