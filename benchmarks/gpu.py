"""Every rule on a GPU against the one-read floor and ByzFL's torch path on the same device (issue 20).

    python benchmarks/gpu.py                         # n in {10, 100} x d in {1e6, 1e7}, float32, cuda
    python benchmarks/gpu.py --device cuda:1 --n 100 --d 1e7
    python benchmarks/gpu.py --n 24 32 64 --dtype float32 float64 --rules median trimmed_mean bulyan
    python benchmarks/gpu.py --device cpu --n 6 --d 1e3 --repeat 1   # the script itself, on any machine

The round is ``aggregation.py``'s (n/5 clients send 10x larger vectors), built on the CPU from the
same seed and moved to the device. Each call is timed between ``torch.cuda.synchronize()`` calls
(median of ``--repeat``, one warm-up), so a time includes every kernel the rule queued and every sync it
made. *floor*: one ``x.mean(0)``. ByzFL 0.0.11's aggregators take the same CUDA tensor (its torch path);
where its settings differ from fedtrust's defaults fedtrust runs with ByzFL's (as in ``aggregation.py``).
Results: ``benchmarks/results/gpu.md`` and ``.json``, the GPU named. The goals: every rule >= 2x
ByzFL's speed, mean-like rules within 1.5 floors, order statistics within 10.
``--dtype`` takes float32 and/or float64 (each row records its own). Needs a CUDA device, unless
``--device cpu`` (a check of the script on any machine, in the tests; ``aggregation.py`` is the CPU
benchmark); asked for CUDA where there is none it says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

import fedtrust
from fedtrust import Round, rule
from fedtrust.rules import RULES

sys.path.insert(0, str(Path(__file__).parent))
from aggregation import attacked_round, options_for  # noqa: E402
from peers import byzfl_aggregators  # noqa: E402

#: ByzFL's aggregator for a fedtrust rule on n clients with f attackers, and the fedtrust options that
#: give ByzFL's definition (None: fedtrust's defaults already do)
BYZFL = {
    "mean": (lambda m, n, f: m.Average(), None),
    "median": (lambda m, n, f: m.Median(), None),
    "trimmed_mean": (lambda m, n, f: m.TrMean(f=f), None),
    "geometric_median": (lambda m, n, f: m.GeometricMedian(nu=0.1, T=3), {"max_iter": 3, "tol": 0.0}),
    "krum": (lambda m, n, f: m.Krum(f=f), None),
    "multi_krum": (lambda m, n, f: m.MultiKrum(f=f), {"m": None}),
    "centered_clipping": (lambda m, n, f: m.CenteredClipping(tau=10.0, L=1), {"tau": 10.0, "n_iter": 1}),
}
MEAN_LIKE = {"mean", "fedavg", "norm_bounding", "fltrust", "fedag"}
ORDER_STATISTICS = {"median", "trimmed_mean", "bulyan"}


def timed(call, repeat: int, device: torch.device) -> float:
    """The median seconds of ``repeat`` calls after one warm-up, each between two syncs of ``device``
    (none needed on the CPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    call()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        began = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def fresh(name: str, options: dict, r: Round):
    """One call of a fresh rule (stateful rules start from nothing every time)."""
    return rule(name, **options)(r)


def bench(
    n: int, d: int, device: torch.device, names: list[str], repeat: int, dtype: torch.dtype = torch.float32
) -> list[dict]:
    cpu_round, f = attacked_round(n, d)
    x = cpu_round.updates.to(device, dtype)
    # the clients' reported numbers on the host, as a server receives them (the Flower strategy's and the
    # simulator's rounds: Round keeps them there for the screen and the rules' host arithmetic)
    r = Round(updates=x, metrics={k: v.to(dtype) for k, v in cpu_round.metrics.items()},
              reference=cpu_round.reference)  # fmt: skip
    del cpu_round
    timed_ = partial(timed, repeat=repeat, device=device)
    kind = str(dtype).removeprefix("torch.")
    floor = timed_(lambda: x.mean(0))
    module = byzfl_aggregators()
    rows = []
    for name in names:
        options = options_for(name, n, f)
        row = {"rule": name, "n": n, "d": d, "dtype": kind, "floor": floor}
        try:
            row["seconds"] = timed_(partial(fresh, name, options, r))
        except Exception as exc:  # noqa: BLE001 - a rule that fails on the device is a result here
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(f"n={n:4d} d={d:9.0e} {kind} {name:20s} FAILED {row['error']}", flush=True)
            continue
        peer = BYZFL.get(name)
        if peer is not None and module is not None:
            make, theirs = peer
            row["byzfl"] = timed_(partial(make(module, n, f), x))
            if theirs is not None:
                matched = {**options, **{k: (n - f if k == "m" else v) for k, v in theirs.items()}}
                row["matched"] = timed_(partial(fresh, name, matched, r))
        ours = row.get("matched", row["seconds"])
        speed = f", ByzFL {row['byzfl'] * 1e3:.1f} ms ({row['byzfl'] / ours:.1f}x)" if "byzfl" in row else ""
        ms, floors = row["seconds"] * 1e3, row["seconds"] / floor
        print(f"n={n:4d} d={d:9.0e} {kind} {name:20s} {ms:9.2f} ms {floors:7.1f}F{speed}", flush=True)
        rows.append(row)
    return rows


def goal(row: dict) -> str:
    if "error" in row:
        return "fails"
    floors = row["seconds"] / row["floor"]
    checks = []
    if "byzfl" in row:
        checks.append(row["byzfl"] / row.get("matched", row["seconds"]) >= 2)
    if row["rule"] in MEAN_LIKE:
        checks.append(floors <= 1.5)
    if row["rule"] in ORDER_STATISTICS:
        checks.append(floors <= 10)
    return "-" if not checks else ("met" if all(checks) else "missed")


def write(rows: list[dict], gpu: str, out: Path, command: str, notes=(), versions: str | None = None) -> None:
    """Results as markdown and JSON; ``notes``: paragraphs under the header; ``versions``: the software's
    (default: this process's torch and fedtrust)."""
    if versions is None:
        versions = f"torch {torch.__version__}, fedtrust {fedtrust.__version__}"
        with contextlib.suppress(ImportError):  # the rank-window kernel's compiler
            import triton

            versions += f", triton {triton.__version__}"
    lines = [
        "# Every rule on a GPU",
        "",
        f"{gpu}; {versions}. Command: `{command}`.",
        "",
        *[line for note in notes for line in (note, "")],
        "| n | d | dtype | rule | ms | floors | ByzFL ms | speed-up | goal |",
        "|---:|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        shape = f"| {row['n']} | {row['d']:.0e} | {row['dtype']} | {row['rule']} |"
        if "error" in row:
            lines.append(f"{shape} {row['error']} | | | | fails |")
            continue
        ours = row.get("matched", row["seconds"])
        byzfl = f"{row['byzfl'] * 1e3:.2f}" if "byzfl" in row else ""
        speed = f"{row['byzfl'] / ours:.1f}x" if "byzfl" in row else ""
        lines.append(f"{shape} {row['seconds'] * 1e3:.2f} | {row['seconds'] / row['floor']:.1f} | {byzfl} | "
                     f"{speed} | {goal(row)} |")  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    payload = {"gpu": gpu, "versions": versions, "command": command, "notes": list(notes), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--d", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "float64"])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES), metavar="RULE")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; torch sees none here", file=sys.stderr)
        raise SystemExit(2)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (no GPU)"
    rows = []
    for dtype in args.dtype:
        for n in args.n:
            for d in args.d:
                rows += bench(n, int(d), device, args.rules, args.repeat, getattr(torch, dtype))
                # after every shape, so a run stopped early keeps the shapes it finished
                write(rows, gpu, args.out, "python benchmarks/gpu.py " + " ".join(sys.argv[1:]))
    print(f"wrote {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
