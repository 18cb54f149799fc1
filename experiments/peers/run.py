"""fedtrust's rules against the peers' own implementations, on the same federation under the same attacks.

    make peers                                                    # installs ByzFL, then the line below
    python experiments/peers/run.py --data digits --seeds 3 --jobs 2

The federation, the attacks and the shares are the robustness table's (``experiments/robustness/run.py``:
50 clients, Dirichlet(0.5) shares, softmax regression, 30 rounds, 14 attacks at 20% and 40% plus the clean
federation). Each rule of ``PEERS`` is a peer library's own code (``rules.py``: ByzFL's aggregators and
pre-aggregators, Flower's robust strategies), each of ``FEDTRUST`` fedtrust's; every cell is computed by
this command under this checkout, so both sides train from the same clients' updates with the same seeds.
Cells: final test accuracy, mean +- sd over the seeds; in the backdoor columns the attack success rate
beside it, and the score is the accuracy less it.

Every run is cached in ``reports/runs.jsonl`` under the hash of its config, fedtrust's source, the
wrappers' source and the peers' versions, with the torch and numpy versions that computed it: a re-run
reuses only what this very code computed. ``--cached-only`` renders the cache (``--source``: the runs
of another fedtrust source, under these wrappers and peers' versions).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rules import register_peers  # noqa: E402


def _robustness():
    """``experiments/robustness/run.py``, whose federation, attacks, cache and cells these runs share."""
    spec = importlib.util.spec_from_file_location("robustness_run", HERE.parent / "robustness" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its worker function is pickled by its module's name)
    spec.loader.exec_module(module)
    return module


robustness = _robustness()

#: The peers' implementations, named as reports name rules; each gets f = the column's share.
PEERS = [
    "flower(strategy=fedavg)", "flower(strategy=fedmedian)", "flower(strategy=fedtrimmedavg)",
    "flower(strategy=krum)", "flower(strategy=multikrum)",
    "byzfl(chain=median)", "byzfl(chain=trmean)", "byzfl(chain=geomed)", "byzfl(chain=krum)",
    "byzfl(chain=multikrum)", "byzfl(chain=cc)", "byzfl(chain=meamed)",
    "byzfl(chain=nnm+trmean)", "byzfl(chain=nnm+median)", "byzfl(chain=arc+trmean)",
    "byzfl(chain=bucketing+geomed)",
]  # fmt: skip
#: fedtrust's side: every rule of the robustness table but the papers' precision-weighted IVAR and ICOV,
#: which are never a column's best there (their screened forms are in).
FEDTRUST = [r for r in robustness.RULES if r not in ("ivar_mle", "ivar_vb", "icov_mle", "icov_vb")]
#: A peer's twin in fedtrust (the same rule), and how their definitions differ where they do.
TWINS = {
    "flower(strategy=fedavg)": ("fedavg", ""),
    "flower(strategy=fedmedian)": ("median", ""),
    "flower(strategy=fedtrimmedavg)": ("trimmed_mean", ""),
    "flower(strategy=krum)": ("krum", ""),
    "flower(strategy=multikrum)": ("multi_krum", "Flower averages the selected updates by sample count"),
    "flower(strategy=bulyan)": ("bulyan", "Flower selects by one Multi-Krum pass, the paper by recursive Krum"),
    "byzfl(chain=median)": ("median", ""),
    "byzfl(chain=trmean)": ("trimmed_mean", ""),
    "byzfl(chain=geomed)": ("geometric_median", "ByzFL: 3 steps from 0 with nu = 0.1; fedtrust to convergence"),
    "byzfl(chain=krum)": ("krum", "ByzFL scores n - f - 1 neighbours, the paper n - f - 2"),
    "byzfl(chain=multikrum)": ("multi_krum", "ByzFL scores n - f - 1 neighbours"),
    "byzfl(chain=cc)": ("centered_clipping", ""),
    "byzfl(chain=nnm+trmean)": ("nnm+trimmed_mean", ""),
    "byzfl(chain=nnm+median)": ("nnm+median", ""),
    "byzfl(chain=bucketing+geomed)": ("bucketing+geometric_median", "the geometric medians differ as above"),
}  # fmt: skip
#: Peers left out, and why.
LEFT_OUT = (
    "ByzFL's MDA and SMEA search every subset of n - f clients (C(50, 10) = 1e10 at 20%); MoNNA needs the "
    "index of a client known to be honest, which this federation does not have. ByzFL's CAF "
    "(`byzfl(chain=caf)`) took 110-290 s a run under IPM at 40% and 6-74 s under min-max at 40% (0.6-1.5 s "
    "elsewhere; those runs ended at 0.10-0.36 accuracy), and the optimal ALIE attack calls the rule 25 "
    "times a round, so its 40% cells would take hours each. Flower's Bulyan "
    "(`--peers 'flower(strategy=bulyan)'` runs it) takes 3.6 s a round of 50 x 650 on a 2-core AMD EPYC "
    "(fedtrust's 2.7 ms): 87 runs of 30 rounds, and the optimal ALIE attack's 25 calls a round, would take "
    "about 7 hours."
)


def is_peer(rule: str) -> bool:
    """Whether ``rule`` names a peer's implementation (``byzfl(...)`` or ``flower(...)``, ``rules.py``)."""
    return rule.startswith(("byzfl(", "flower("))


def config(data: str, model: str, rule: str, attack: str, fraction: float, seed: int, rounds: int) -> dict:
    """The robustness table's config of the cell; a peer's rule block gets ``f``, the column's share."""
    cfg = robustness.config(data, model, rule, attack, fraction, seed, rounds)
    if is_peer(rule):
        cfg["rule"]["f"] = min(fraction, 0.22) if "bulyan" in rule else fraction
    return cfg


def code() -> str:
    """What a cached row must have been computed by: fedtrust's source, the wrappers' (this folder's
    ``rules.py`` and the ``benchmarks/peers.py`` it imports) and the peers' versions."""
    from fedtrust.sweeps.runner import source_hash

    files = [HERE / "rules.py", HERE.parents[1] / "benchmarks" / "peers.py"]
    wrappers = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    return f"{source_hash()} {wrappers} byzfl {_version('byzfl')} flwr {_version('flwr')}"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:  # (runs of the other peer need none of it)
        return "not-installed"


def cached_code(cache: dict[str, dict], fedtrust_source: str | None) -> str | None:
    """For rendering the cache: the code of its most recent rows (of ``fedtrust_source``, when given),
    read from the rows themselves (so no peer need be installed to render them)."""
    rows = [r for r in cache.values() if not fedtrust_source or r["source"].split()[0] == fedtrust_source]
    return rows[-1]["source"] if rows else None


def _worker() -> None:
    register_peers()  # (a forked worker has them already; a spawned one needs them)


def rows_of(results: dict, rule: str, attack: str, fraction: float) -> list[dict]:
    return results.get((rule, attack, fraction), [])


def score(rows: list[dict]) -> float | None:
    """The cell's score: mean accuracy, less the mean attack success rate under a backdoor."""
    _, mean = robustness.cell(rows)
    return None if mean is None else mean - (robustness.asr_of(rows) or 0.0)


def report(args, results: dict, seconds: float, source: str) -> str:
    columns = [("clean", robustness.FRACTIONS[0])] + [
        (a, f) for f in robustness.FRACTIONS for a in args.attacks if a != "clean"
    ]
    names = ["clean" if a == "clean" else f"{a} {int(f * 100)}%" for a, f in columns]
    attacked = [(a, f, n) for (a, f), n in zip(columns, names, strict=True) if a not in ("clean", "absent")]
    rules = args.peers + args.fedtrust
    scores = {
        (r, n): score(rows_of(results, r, a, f))
        for r in rules
        for (a, f), n in zip(columns, names, strict=True)
    }
    runs = [row for rows in results.values() for row in rows]

    def worst(rule):
        values = [scores[rule, n] for _, _, n in attacked]
        return None if not values or None in values else min(values)

    def mean_attacked(rule):
        values = [scores[rule, n] for _, _, n in attacked]
        return None if not values or None in values else statistics.mean(values)

    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [
        f"# fedtrust against the peers' implementations: {args.data}, {robustness.CLIENTS} clients, "
        f"Dirichlet(0.5), {args.model}, {args.rounds} rounds",
        "",
        (
            "Rendered from the cache, every cell computed by one code"
            if args.cached_only
            else "Every cell computed by this checkout"
        )
        + f" (fedtrust source {source.split()[0]}, peers' wrappers "
        f"{source.split()[1]}, {' '.join(source.split()[2:])}; {robustness.computed_under(runs)}; "
        f"{sum(r.get('seconds') or 0 for r in runs):.0f} s of run time, {seconds:.0f} s of wall time computed "
        "by this command, the rest read from `runs.jsonl`), mean over "
        f"{args.seeds} seed(s). Command: `python experiments/peers/run.py {' '.join(args.argv)}`",
        "",
        "Score: final test accuracy, in the backdoor columns less the attack success rate. *worst*: the "
        "lowest score over the attacked columns (every column but clean and absent); *mean*: their mean.",
        "",
        "## Every rule by its worst attacked column",
        "",
        "| rule | side | clean | worst attacked | mean attacked |",
        "|---|---|---:|---:|---:|",
    ]
    order = sorted(rules, key=lambda r: -(worst(r) if worst(r) is not None else -1))
    for r in order:
        side = "peer" if r in args.peers else "fedtrust"
        lines.append(
            f"| {r} | {side} | {fmt(scores[r, 'clean'])} | {fmt(worst(r))} | {fmt(mean_attacked(r))} |"
        )
    lines += [
        "",
        "## The best of each side, column by column",
        "",
        f"The best of {len(args.peers)} peer rules against the best of {len(args.fedtrust)} fedtrust rules, "
        "picked per column at the seeds' mean: the pick favours the side with more rules a little (a rule "
        "that is best in one column by its seeds' noise). A failed seed leaves its cell's mean; the full "
        "table marks it.",
        "",
        "| column | best peer | score | best fedtrust rule | score | fedtrust - peer |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name in names:
        best = {}
        for side, members in (("peer", args.peers), ("fedtrust", args.fedtrust)):
            scored = [(scores[r, name], r) for r in members if scores[r, name] is not None]
            best[side] = max(scored) if scored else (None, "-")
        gap = (
            fmt(best["fedtrust"][0] - best["peer"][0])
            if None not in (best["fedtrust"][0], best["peer"][0])
            else "-"
        )
        lines.append(f"| {name} | {best['peer'][1]} | {fmt(best['peer'][0])} | {best['fedtrust'][1]} | "
                     f"{fmt(best['fedtrust'][0])} | {gap} |")  # fmt: skip
    lines += [
        "",
        "## The same rule in two implementations",
        "",
        "Over the clean column and every attacked column (absent aside): the largest and the mean absolute "
        "difference of the scores, and the columns where they differ by more than 0.02.",
        "",
        "| peer | fedtrust | definitions | largest difference | mean | columns apart by > 0.02 |",
        "|---|---|---|---:|---:|---|",
    ]
    for peer in args.peers:
        if peer not in TWINS or TWINS[peer][0] not in args.fedtrust:
            continue
        ours, note = TWINS[peer]
        pairs = [(n, scores[peer, n], scores[ours, n]) for n in ["clean"] + [n for *_, n in attacked]]
        diffs = [(abs(a - b), n) for n, a, b in pairs if a is not None and b is not None]
        if not diffs:
            continue
        apart = ", ".join(f"{n} ({scores[ours, n] - scores[peer, n]:+.3f})" for d, n in diffs if d > 0.02)
        lines.append(f"| {peer} | {ours} | {note or 'the same'} | {max(diffs)[0]:.3f} | "
                     f"{statistics.mean(d for d, _ in diffs):.3f} | {apart or '-'} |")  # fmt: skip
    lines += ["", f"Left out: {LEFT_OUT}", "", "## Every cell", "",
              "| rule | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for r in rules:
        lines.append(
            f"| {r} | " + " | ".join(robustness.cell(rows_of(results, r, a, f))[0] for a, f in columns) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    robustness.federation_arguments(parser)
    parser.add_argument("--peers", nargs="*", default=PEERS)
    parser.add_argument("--fedtrust", nargs="*", default=FEDTRUST)
    parser.add_argument(
        "--out", default=str(HERE / "reports"), help="run cache and reports (default: %(default)s)"
    )
    parser.add_argument("--cached-only", action="store_true", help="compute nothing: render the cache")
    parser.add_argument(
        "--source", help="with --cached-only: the runs of this fedtrust source hash (not this checkout's)"
    )
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    unknown = [p for p in args.peers if not is_peer(p)]
    if unknown:
        parser.error(f"{unknown[0]!r} is not a peer: name one as byzfl(chain=...) or flower(strategy=...)")
    register_peers()
    from fedtrust.sweeps.config import validate

    if args.source and not args.cached_only:
        parser.error("--source names the code that computed cached runs: use it with --cached-only")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_path = out_dir / "runs.jsonl"
    cache = robustness.load_cache(cache_path)
    source = cached_code(cache, args.source) if args.cached_only else code()
    if source is None:
        parser.error(f"no cached runs of fedtrust source {args.source or '(any)'} in {cache_path}")
    here = robustness.libraries()
    todo, results = [], {}
    for rule in args.peers + args.fedtrust:
        for attack in args.attacks:
            for fraction in robustness.FRACTIONS[:1] if attack == "clean" else robustness.FRACTIONS:
                for seed in range(args.seeds):
                    cfg = config(args.data, args.model, rule, attack, fraction, seed, args.rounds)
                    if seed == 0 and not args.cached_only:
                        try:
                            validate(cfg)
                        except ValueError as exc:
                            parser.error(f"rule {rule!r}, attack {attack!r}: {exc} (nothing was run)")
                    k = robustness.key(cfg, source)
                    row = cache.get(k)
                    if row is not None and (
                        args.cached_only or all(row.get(n) == v for n, v in here.items())
                    ):
                        results.setdefault((rule, attack, fraction), []).append(row)
                    elif not args.cached_only:
                        todo.append((rule, attack, fraction, cfg, k))
    print(f"{len(todo)} runs to compute, {sum(map(len, results.values()))} cached", flush=True)
    from fedtrust.progress import Progress

    began = time.perf_counter()
    with (
        ProcessPoolExecutor(args.jobs, initializer=_worker) as pool,
        cache_path.open("a") as out,
        Progress(len(todo), unit="runs") as bar,
    ):
        futures = {pool.submit(robustness.run_one, job[3]): job for job in todo}
        for future in as_completed(futures):
            rule, attack, fraction, cfg, k = futures[future]
            row = {"key": k, "rule": rule, "attack": attack, "fraction": fraction, "seed": cfg["seed"],
                   "data": args.data, "source": source, **here, **future.result()}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
            results.setdefault((rule, attack, fraction), []).append(row)
            bar.advance(1, f"{rule}, {attack} {int(fraction * 100)}%, seed {cfg['seed']}")
    seconds = time.perf_counter() - began
    path = out_dir / f"{args.data}.md"
    path.write_text(report(args, results, seconds, source))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
