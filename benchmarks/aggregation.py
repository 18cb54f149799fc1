"""Every fedtrust rule against the memory-bandwidth floor and against the same rule in ByzFL and Flower.

    python benchmarks/aggregation.py                       # n in {10, 50, 100} x d in {1e5, 1e6, 1e7}
    python benchmarks/aggregation.py --n 10 --d 1e5 --out /tmp/look   # a quick look, results kept
    python benchmarks/aggregation.py --rules median krum   # some rules

The round is an attacked one, so robust rules take their real paths: n clients, f = n/5 of them send
vectors ten times larger than the honest N(0, 1) ones; float32. Per shape it times one pass of
``x.mean(0)`` (the floor: every rule reads the n x d matrix at least once), then each rule (a fresh
rule object and a fresh Round per call, so window rules see one round and every call screens its
round; the floor is timed after the same set-up) and each peer implementation of it (see
``peers.py``), and checks that the peer's result agrees with fedtrust's under the same definition.
Writes benchmarks/results/aggregation.md and .json with the machine and versions after every rule;
``--resume`` keeps what the JSON already holds and times only the rest.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import fedtrust
from fedtrust import Round, rule
from fedtrust.rules import RULES

sys.path.insert(0, str(Path(__file__).parent))
from peers import peers_for  # noqa: E402

#: Rules whose options take the assumed number of attackers.
TAKES_F = {"trimmed_mean", "krum", "multi_krum", "bulyan", "dnc"}
#: Mean-like rules: one weighted pass, so within 1.5x of the floor.
MEAN_LIKE = {"mean", "fedavg"}
#: A single call slower than this is timed once (the peers' slowest paths take minutes at d = 1e7).
SLOW_SECONDS = 20.0
#: A peer whose time at the previous d, scaled linearly in d, exceeds this is skipped (and says so).
PEER_BUDGET_SECONDS = 60.0
#: (peer name, n) -> (d, seconds) of its last timing.
_PEER_TIMES: dict[tuple[str, int], tuple[int, float]] = {}


def timed(call, prepare, repeat: int) -> tuple[float, object]:
    """Median seconds of ``call(prepare())`` (the set-up untimed), after one warm-up; and the last result.
    At least ``repeat`` calls and, for fast calls, up to 1000 until 0.25 s have been timed. The garbage
    collector is off while timing, as in ``timeit``."""
    out = call(prepare())
    times = []
    gc.collect()
    gc.disable()
    try:
        while len(times) < repeat or (sum(times) < 0.25 and len(times) < 1000):
            arg = prepare()
            start = time.perf_counter()
            out = call(arg)
            times.append(time.perf_counter() - start)
            if times[-1] > SLOW_SECONDS:
                break
    finally:
        gc.enable()
    return statistics.median(times), out


def available_bytes() -> float:
    """MemAvailable from /proc/meminfo (inf where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def attacked_round(n: int, d: int, seed: int = 0) -> tuple[Round, int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    f = max(1, n // 5)
    x[:f] *= 10
    metrics = {"train_loss": torch.rand(n, generator=g) + 1}
    return Round(updates=x, metrics=metrics, reference=Benchmark(torch.randn(d, generator=g))), f


class Benchmark:
    """The server's benchmark: a loss, and its own update (FLTrust's g_0, computed before the round)."""

    def __init__(self, update: torch.Tensor):
        self._update = update

    def __call__(self, v: torch.Tensor) -> torch.Tensor:  # where v is, as the simulator's reference gives it
        return v.square().mean()

    def update(self) -> torch.Tensor:
        return self._update


def options_for(name: str, n: int, f: int) -> dict:
    if name == "bulyan":
        return {"f": min(f, (n - 3) // 4)}
    return {"f": f} if name in TAKES_F else {}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "fedtrust": fedtrust.__version__,
    }
    for package in ("byzfl", "flwr"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = "not installed"
    from fedtrust.aggregators import order_stats

    compiled = "compiled" if order_stats.COMPILED else "numpy (extension not built)"
    return {"cpu": cpu, "threads": torch.get_num_threads(), "order_stats": compiled, **versions}


def skip_reason(peer, n: int, d: int, x: torch.Tensor, budget: float) -> str | None:
    """Why ``peer`` is not timed on this round: it would not fit in memory, or its time at the previous d,
    scaled linearly, exceeds ``budget`` seconds; None to time it."""
    need, free = peer.memory * x.numel() * x.element_size(), available_bytes()
    if need > 0.9 * free:
        return f"skipped: needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB available"
    if (peer.name, n) in _PEER_TIMES:
        d_prev, s_prev = _PEER_TIMES[(peer.name, n)]
        if s_prev * d / d_prev > budget:
            return f"skipped: about {s_prev * d / d_prev:.0f} s a call, scaled from d={d_prev:.0e}"
    return None


def bench_shape(
    n: int,
    d: int,
    names: list[str],
    repeat: int,
    with_peers: bool,
    on_row,
    peer_budget: float = PEER_BUDGET_SECONDS,
) -> None:
    """Time each rule in ``names`` (and its peers) on one attacked n x d round; ``on_row`` gets each
    rule's result as soon as it is measured."""
    if not names:
        return
    round_, f = attacked_round(n, d)
    x = round_.updates

    def setup(name: str, opts: dict):
        """A fresh rule and a fresh Round of the same data: the Round keeps what a call took (its norms),
        and a server meets every round once."""
        return rule(name, **opts), Round(updates=x, metrics=round_.metrics, reference=round_.reference)

    def call(prepared):
        agg, fresh = prepared
        return agg(fresh)

    # timed after the same set-up as the rules, so both start from the same caches
    floor, _ = timed(lambda _: x.mean(0), lambda: setup("mean", {}), repeat)
    counts = np.ones(n, dtype=np.int64)
    for name in names:
        opts = options_for(name, n, f)
        seconds, out = timed(call, lambda name=name, opts=opts: setup(name, opts), repeat)
        row = {
            "rule": name,
            "n": n,
            "d": d,
            "options": opts,
            "seconds": seconds,
            "floor": floor,
            "ratio": seconds / floor,
            "iterations": out.info.get("iterations"),
            "peers": [],
        }
        print(
            f"n={n:4d} d={d:9.0e} {name:18s} {seconds * 1e3:10.1f} ms {seconds / floor:7.1f}x floor",
            flush=True,
        )
        matched: dict[str, tuple[float, object]] = {}
        for peer in peers_for(name, x, f, counts) if with_peers else []:
            skip = skip_reason(peer, n, d, x, peer_budget)
            if skip:
                row["peers"].append({"name": peer.name, "skipped": skip})
                print(f"      {peer.name:36s} {skip}", flush=True)
                continue
            try:
                peer_seconds, peer_out = timed(peer.run, peer.prepare, repeat)
                _PEER_TIMES[(peer.name, n)] = (d, peer_seconds)
            except (
                Exception
            ) as exc:  # a peer path that cannot take this input (e.g. torch.quantile's size cap)
                row["peers"].append({"name": peer.name, "error": f"{type(exc).__name__}: {str(exc)[:80]}"})
                print(f"      {peer.name:36s} failed: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                continue
            # fedtrust under the peer's definition (timed too when that differs from ours)
            key = json.dumps(peer.ours, sort_keys=True)
            if rule(name, **peer.ours).options() == rule(name, **opts).options():
                matched[key] = (seconds, out)
            elif key not in matched:
                matched[key] = timed(call, lambda o=peer.ours, name=name: setup(name, o), repeat)
            ours_seconds, same = matched[key]
            ref = same.vector.numpy().astype(np.float64)
            agree = float(
                np.linalg.norm(np.asarray(peer_out, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30)
            )
            row["peers"].append(
                {
                    "name": peer.name,
                    "seconds": peer_seconds,
                    "agreement": agree,
                    "note": peer.note,
                    "fedtrust_seconds": ours_seconds,
                    "speedup": peer_seconds / ours_seconds,
                }
            )
            print(
                f"      {peer.name:36s} {peer_seconds * 1e3:10.1f} ms  "
                f"fedtrust {peer_seconds / ours_seconds:6.1f}x faster  rel. diff {agree:.1e}",
                flush=True,
            )
            del peer_out, same
            gc.collect()
        on_row(row)
        del out, matched
        gc.collect()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"   floor (x.mean(0)) {floor * 1e3:.1f} ms; peak RSS so far {rss:.1f} GiB", flush=True)


def matched_ms(row: dict, peer: dict) -> str:
    ours = peer.get("fedtrust_seconds", row["seconds"])
    return "" if ours == row["seconds"] else f" ({ours * 1e3:.1f} ms)"


def fastest_peer(row: dict) -> dict | None:
    timed_peers = [p for p in row["peers"] if "seconds" in p]
    return min(timed_peers, key=lambda p: p["seconds"]) if timed_peers else None


def goal(row: dict) -> str:
    """The issue's goal for this rule and shape, and whether it is met."""
    if row["rule"] in MEAN_LIKE:
        return ("met" if row["ratio"] <= 1.5 else "MISSED") + " (<= 1.5x floor)"
    if row["rule"] == "ivar_mle" and row["iterations"] is not None:
        bound = row["iterations"] + 1
        return ("met" if row["ratio"] <= bound else "MISSED") + f" (<= {bound}x floor)"
    peer = fastest_peer(row)
    if peer is None:
        return "-"
    if peer["seconds"] / row["floor"] <= 1.2:
        return ("met" if row["ratio"] <= 1.2 else "MISSED") + " (peer at floor: <= 1.2x)"
    return ("met" if peer["speedup"] >= 2 else "MISSED") + " (>= 2x fastest peer)"


def summary(rows: list[dict]) -> list[str]:
    """One cell per rule and shape: the speed-up over the fastest peer where the goal is about peers,
    else the time in floors (F); a cross marks a missed goal."""
    shapes = sorted({(r["n"], r["d"]) for r in rows}, key=lambda s: (s[1], s[0]))
    by_key = {(r["rule"], r["n"], r["d"]): r for r in rows}
    lines = [
        "| rule | " + " | ".join(f"{n} x {d:.0e}" for n, d in shapes) + " |",
        "|---|" + "---:|" * len(shapes),
    ]
    for name in [name for name in RULES if any(r["rule"] == name for r in rows)]:
        cells = []
        for n, d in shapes:
            r = by_key.get((name, n, d))
            if r is None:
                cells.append("")
                continue
            peer = fastest_peer(r)
            by_peer = peer is not None and name not in MEAN_LIKE and name != "ivar_mle"
            cell = f"{peer['speedup']:.1f}x" if by_peer else f"{r['ratio']:.1f}F"
            cells.append(cell + (" ✗" if goal(r).startswith("MISSED") else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write(rows: list[dict], info: dict, out: Path, command: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(
        json.dumps({"machine": info, "command": command, "results": rows}, indent=1)
    )
    lines = [
        "# Aggregation: fedtrust vs the memory-bandwidth floor, ByzFL and Flower",
        "",
        f"Machine: {info['cpu']}, {info['threads']} threads. Python {info['python']}, torch {info['torch']}, "
        f"numpy {info['numpy']}, fedtrust {info['fedtrust']}, ByzFL {info['byzfl']}, flwr {info['flwr']}. "
        f"Order-statistics kernel (median, trimmed mean): {info.get('order_stats', 'numpy')}.",
        f"Command: `{command}`.",
        "",
        "Round: n clients, f = n/5 of them sending 10x larger vectors; float32. Times are medians. "
        "*floor*: one `x.mean(0)` pass. *peer*: the fastest peer implementation of the same rule "
        "(ByzFL on torch or numpy input, Flower's strategy `aggregate_train`); *speed-up*: peer time / "
        "fedtrust time, fedtrust run with the peer's settings where they differ from the defaults (ms in "
        "brackets); *rel. diff*: ||peer - fedtrust|| / ||fedtrust|| with fedtrust set to the peer's "
        "definition.",
        "",
    ]
    lines += [
        "## Summary",
        "",
        "Speed-up over the fastest peer implementation of the same rule (goal >= 2x, or <= 1.2 floors where "
        "the peer is already there), or for the mean, FedAvg, IVAR-MLE and rules without a peer the time in "
        "floors F (goals: mean-like <= 1.5 F, IVAR-MLE <= (iterations + 1) F). ✗: goal missed.",
        "",
        *summary(rows),
        "",
    ]
    shapes = sorted({(r["n"], r["d"]) for r in rows}, key=lambda s: (s[1], s[0]))
    for n, d in shapes:
        cells = sorted(
            (r for r in rows if (r["n"], r["d"]) == (n, d)), key=lambda r: list(RULES).index(r["rule"])
        )
        lines += [
            f"## n = {n}, d = {d:.0e} (floor {cells[0]['floor'] * 1e3:.2f} ms)",
            "",
            "| rule | fedtrust ms | x floor | fastest peer | peer ms | speed-up | rel. diff | goal |",
            "|---|---:|---:|---|---:|---:|---:|---|",
        ]
        for r in cells:
            p = fastest_peer(r)
            peer = (
                f"{p['name']} | {p['seconds'] * 1e3:.1f} | {p['speedup']:.1f}x{matched_ms(r, p)} | "
                f"{p['agreement']:.0e}"
                if p
                else "- | - | - | -"
            )
            lines.append(
                f"| {r['rule']} | {r['seconds'] * 1e3:.1f} | {r['ratio']:.1f} | {peer} | {goal(r)} |"
            )
        lines.append("")
    notes = sorted({(p["name"], p["note"]) for r in rows for p in r["peers"] if p.get("note")})
    errors = sorted({(p["name"], p["error"]) for r in rows for p in r["peers"] if p.get("error")})
    skipped = sorted(
        {(p["name"], r["n"], r["d"], p["skipped"]) for r in rows for p in r["peers"] if p.get("skipped")}
    )
    if notes or errors or skipped:
        lines += ["## Notes", ""] + [f"- {name}: {note}." for name, note in notes]
        lines += [f"- {name} failed on some shapes: `{error}`." for name, error in errors]
        lines += [f"- {name} at n={n}, d={d:.0e}: {why}." for name, n, d, why in skipped]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--d", type=float, nargs="+", default=[1e5, 1e6, 1e7])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES), metavar="RULE")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="Time fedtrust only.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "aggregation")
    parser.add_argument(
        "--resume", action="store_true", help="Keep the results already in OUT.json and time only the rest."
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="With --resume: drop the kept results of --rules at the --n x --d shapes and time them again.",
    )
    parser.add_argument(
        "--peer-budget",
        type=float,
        default=PEER_BUDGET_SECONDS,
        help="Skip a peer whose call, scaled from the previous d, would take longer (seconds).",
    )
    args = parser.parse_args()
    command = "python benchmarks/aggregation.py " + " ".join(sys.argv[1:])
    previous = args.out.with_suffix(".json")
    rows = []
    info = machine()
    if args.resume and previous.exists():
        kept = json.loads(previous.read_text())
        differ = {k: (kept["machine"].get(k), v) for k, v in info.items() if kept["machine"].get(k) != v}
        if differ:  # the file names one machine: rows from another would carry this one's name
            was = ", ".join(f"{k} {a}" for k, (a, _) in differ.items())
            now = ", ".join(f"{k} {b}" for k, (_, b) in differ.items())
            raise SystemExit(f"{previous} was measured with {was}; this run has {now}: time every shape here "
                             "(without --resume) or write elsewhere (--out)")  # fmt: skip
        rows, command = kept["results"], f"{kept['command']}; resumed: {command}"
        if args.replace:
            again = {(rule, n, int(d)) for rule in args.rules for n in args.n for d in args.d}
            rows = [r for r in rows if (r["rule"], r["n"], r["d"]) not in again]

    def on_row(row: dict) -> None:  # written after every rule: a crash loses nothing measured
        rows.append(row)
        write(rows, info, args.out, command.strip())

    for d in map(int, args.d):
        for n in args.n:
            done = {r["rule"] for r in rows if (r["n"], r["d"]) == (n, d)}
            todo = [r for r in args.rules if r not in done]
            bench_shape(n, d, todo, args.repeat, args.peers, on_row, args.peer_budget)
            gc.collect()
    write(rows, info, args.out, command.strip())


if __name__ == "__main__":
    main()
