"""Issue 19's robustness table: every rule x every attack at 20% and 40% malicious clients.

Data: digits (default) or Fashion-MNIST, 50 clients with Dirichlet(0.5) shares, the server keeping 5% of
the data clean (FOCUS's benchmark, FLTrust's root data), every client in every round, one local epoch
of SGD (batch 32), softmax regression (``--model mlp`` for a hidden layer of 64). Columns (the attack's
options in ``ATTACKS`` below):

- ``clean``; ``label_flip`` (every label of a corrupted client set to one class);
- ``alie``, ``ipm`` (epsilon 0.5), ``min_max``, ``min_sum`` (unit-vector direction), ``fang``
  (Fang et al.'s attack on the trimmed mean / median, full knowledge), ``optimal_alie`` (z searched
  each round against the server's own rule);
- ``mimic``: every corrupted client sends a copy of one benign client's update (a sybil group of copies);
- ``sybil_ipm``: every corrupted client sends the same crafted vector, -3 x the benign mean;
  ``noisy_sybil_ipm`` the same plus each client's own noise of 0.3 x the honest per-coordinate spread;
- ``backdoor``: BadNets (a corner trigger on half of each corrupted client's rows, labelled 0),
  with model replacement's boost n / eta on every corrupted client; the cell is clean accuracy, the
  attack success rate beside it;
- ``backdoor_split``: the same with the boost split among the k corrupted clients (n / (eta k) each:
  together they replace the model exactly, each update k times smaller, so harder to tell apart).

Rules with a Byzantine budget get f = the column's malicious share (Bulyan at most (n - 3) / 4).
Cells: final test accuracy, mean +- sd over the seeds. Every run is cached in
``reports/runs.jsonl`` under the hash of its config and of fedtrust's source, with the torch and numpy
versions that computed it, so a re-run reuses only results this very code computed: the same source under
another torch or numpy (or a row that did not record them) is computed again, as the sweep runner's
``computed_by`` does (``--force`` recomputes everything). ``--cached-only`` renders whatever is cached,
and the report names the versions its runs were computed under.

    python experiments/robustness/run.py --data digits --seeds 3 --jobs 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORTS = HERE / "reports"

RULES = [
    "fedavg", "median", "trimmed_mean", "geometric_median", "krum", "multi_krum", "bulyan",
    "centered_clipping", "cfl", "arfl", "focus", "ivar_mle", "ivar_vb", "icov_mle", "icov_vb",
    "norm_bounding", "dnc", "flame", "foolsgold", "fltrust", "nnm+median", "nnm+trimmed_mean",
    "bucketing+geometric_median", "ivar_mle(weighting=screen)", "icov_vb(weighting=screen)",
]  # fmt: skip
#: rules whose ``f`` option is set to the column's malicious share (and pre-aggregators', in front of them)
BUDGET = {"trimmed_mean", "krum", "multi_krum", "bulyan", "dnc", "nnm", "arc"}
ATTACKS = {
    "clean": {"name": "none"},
    # not an attack: the corrupted share sends NaN, which every rule quarantines, so the federation runs
    # without them; a rule that shuts attackers out perfectly ends here
    "absent": {"name": "crash"},
    "label_flip": {"name": "label_flip"},
    "alie": {"name": "alie"},
    "ipm": {"name": "ipm", "epsilon": 0.5},
    "min_max": {"name": "min_max"},
    "min_sum": {"name": "min_sum"},
    "fang": {"name": "fang_trimmed_mean"},
    "optimal_alie": {"name": "optimal_alie", "grid": 6, "steps": 4},
    "mimic": {"name": "mimic", "target": 0},
    "sybil_ipm": {"name": "ipm", "epsilon": 3.0},
    # the same crafted vector, each attacker adding its own noise of 0.3 x the honest per-coordinate spread:
    # no longer copies to the rounding, correlated below the merge's 0.95 ("Noisy copies" in the README)
    "noisy_sybil_ipm": {"name": "ipm", "epsilon": 3.0, "noise": 0.3},
    "backdoor": {"name": "backdoor", "samples": 0.5, "attack": {"name": "model_replacement"}},
    "backdoor_split": {
        "name": "backdoor",
        "samples": 0.5,
        "attack": {"name": "model_replacement", "split": True},
    },
}
FRACTIONS = (0.2, 0.4)
CLIENTS = 50


def rule_block(name: str, fraction: float) -> dict:
    """A rule's config block: ``f`` (the column's malicious share) for the rule and the pre-aggregators
    that take one (Bulyan at most 0.22: it needs n >= 4f + 3). Options may follow the rule's name in
    parentheses, as in reports: ``ivar_mle(weighting=screen)``."""
    from fedtrust.registry import parse_spec

    name, options = parse_spec(name)
    *pre, final = name.split("+")
    block: dict = {"name": final, **options}
    if final in BUDGET:
        block["f"] = min(fraction, 0.22) if final == "bulyan" else fraction
    if final == "centered_clipping":
        block["tau"] = 1.0
    if pre:
        block["pre"] = [{"name": p, "f": fraction} if p in BUDGET else {"name": p} for p in pre]
    return block


def config(data: str, model: str, rule: str, attack: str, fraction: float, seed: int, rounds: int) -> dict:
    corruption = dict(ATTACKS[attack])
    if attack != "clean":
        corruption["fraction"] = fraction
    return {
        "name": "robustness",
        "seed": seed,
        "data": {
            "name": data,
            "clients": CLIENTS,
            "partition": {"name": "dirichlet", "alpha": 0.5},
            "benchmark": 0.05,
        },  # fmt: skip
        "model": {"name": model} if model == "softmax" else {"name": "mlp", "hidden": 64},
        "train": {
            "rounds": rounds,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.5 if model == "softmax" else 0.1,
        },
        "corruption": corruption,
        "rule": rule_block(rule, fraction),
    }


def key(cfg: dict, code: str) -> str:
    return hashlib.sha256((json.dumps(cfg, sort_keys=True) + code).encode()).hexdigest()[:20]


_DATASETS = None


def simulation(cfg: dict):
    """The run's simulation, built as every cell's is: one thread (a worker process's share of the cores;
    the thread count moves float results), the data sets loaded once per process."""
    global _DATASETS
    import torch

    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import _DatasetCache, build_simulation

    torch.set_num_threads(1)
    _DATASETS = _DATASETS or _DatasetCache()
    return build_simulation(validate(cfg), _DATASETS)


def run_one(cfg: dict) -> dict:
    """One run's final metrics (or its failure)."""
    began = time.perf_counter()
    try:
        sim = simulation(cfg)
        records = sim.run()
    except Exception as exc:  # noqa: BLE001 - a crash is a result here
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - began}
    last = next((r["metrics"] for r in reversed(records) if r["metrics"]), {})
    return {
        "accuracy": last.get("accuracy"),
        "backdoor_asr": last.get("backdoor_asr"),
        "refused": sum(r["error"] is not None for r in records),
        "failure": sim.failure,
        "seconds": time.perf_counter() - began,
    }


#: What a cached row records besides fedtrust's source: the numerical libraries that computed it (another
#: torch or numpy moves float results; :data:`fedtrust.sim.store.COMPUTED_BY`).
LIBRARIES = ("torch", "numpy")


def libraries() -> dict[str, str]:
    """This environment's :data:`LIBRARIES` versions, as a cached row records them."""
    from fedtrust.sim.store import versions

    here = versions()
    return {name: here[name] for name in LIBRARIES}


def computed_under(rows: list[dict]) -> str:
    """The library versions the rows were computed under, with how many runs each ("torch 2.13.0+cpu,
    numpy 2.4.6: 1,875 runs"; rows cached before the versions were recorded: "versions not recorded")."""
    counts: dict[str, int] = {}
    for row in rows:
        name = ", ".join(f"{lib} {row[lib]}" for lib in LIBRARIES if row.get(lib)) or "versions not recorded"
        counts[name] = counts.get(name, 0) + 1
    return "; ".join(f"{name}: {n:,} runs" for name, n in sorted(counts.items())) or "no runs"


def load_cache(path: Path) -> dict[str, dict]:
    cache = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                cache[row["key"]] = row
    return cache


def asr_of(rows: list[dict]) -> float | None:
    """The mean backdoor attack success rate of the finished runs, or None."""
    asr = [r["backdoor_asr"] for r in rows if r.get("backdoor_asr") is not None and not r.get("failure")]
    return statistics.mean(asr) if asr else None


def cell(rows: list[dict]) -> tuple[str, float | None]:
    ok = [r["accuracy"] for r in rows if r.get("accuracy") is not None and not r.get("failure")]
    bad = len(rows) - len(ok)
    if not ok:
        return f"failed ({rows[0].get('error') or rows[0].get('failure')})"[:60] if rows else "-", None
    mean = statistics.mean(ok)
    text = f"{mean:.3f}" + (f" ± {statistics.stdev(ok):.3f}" if len(ok) > 1 else "")
    asr = asr_of(rows)
    if asr is not None:
        text += f" (ASR {asr:.2f})"
    refused = sum(r.get("refused") or 0 for r in rows)
    if refused:
        text += f" [{refused} rounds refused]"
    if bad:
        text += f" [{bad} failed]"
    return text, mean


def report(args, results: dict, seconds: float) -> str:
    columns = [("clean", None)] + [(a, f) for f in FRACTIONS for a in args.attacks if a != "clean"]
    names = [a if f is None else f"{a} {int(f * 100)}%" for a, f in columns]
    means: dict[tuple[str, str], float | None] = {}
    scores: dict[tuple[str, str], float] = {}  # accuracy, less the attack success rate under a backdoor
    lines = []
    for rule in args.rules:
        cells = []
        for (attack, fraction), name in zip(columns, names, strict=True):
            rows = results.get((rule, attack, fraction or FRACTIONS[0]), [])
            text, mean = cell(rows)
            means[rule, name] = mean
            if mean is not None:
                scores[rule, name] = mean - (asr_of(rows) or 0.0)
            cells.append(text)
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    best = []
    for name in names:
        scored = [(scores[r, name], r) for r in args.rules if (r, name) in scores]
        best.append(max(scored)[1] if scored else "-")
    clean = {r: means[r, "clean"] for r in args.rules}
    reference = clean.get("fedavg")  # the mean on the clean federation: what an attack takes away from
    # a rule's lowest score over the attacked columns (accuracy, less the ASR under a backdoor)
    attacked = [n for (a, _), n in zip(columns, names, strict=True) if a not in ("clean", "absent")]
    worst = {r: min((scores[r, n] for n in attacked if (r, n) in scores), default=None) for r in args.rules}
    complete = [r for r in args.rules if clean[r] is not None and all((r, n) in scores for n in names)]
    complete = [r for r in complete if worst[r] is not None]  # (no attacked column asked for: none)
    own = [r for r in complete if worst[r] >= clean[r] - 0.03]
    ref = [r for r in complete if reference is not None and worst[r] >= reference - 0.03]
    accurate = [r for r in complete if all(means[r, n] >= clean[r] - 0.03 for n in attacked)]  # ASR aside
    # against the federation without the attackers (FedAvg's "absent" column at the same share): what
    # the attack costs beyond the clients it takes away
    absent = {f: means.get(("fedavg", f"absent {int(f * 100)}%")) for f in FRACTIONS}
    beyond = {
        r: max(absent[f] - scores[r, n] for (a, f), n in zip(columns, names, strict=True)
               if n in attacked and absent.get(f) is not None)
        for r in complete
    } if all(v is not None for v in absent.values()) else {}  # fmt: skip
    runs = [row for rows in results.values() for row in rows]
    head = [
        f"# Robustness: {args.data}, {CLIENTS} clients, Dirichlet(0.5), {args.model}, {args.rounds} rounds",
        "",
        f"Final test accuracy, mean ± sd over {args.seeds} seed(s) (fedtrust source {args.code}, "
        f"{computed_under(runs)}; {sum(r.get('seconds') or 0 for r in runs):.0f} s of run time, "
        f"{seconds:.0f} s of wall time computed by this command, the rest read from `runs.jsonl`).",
        "Command: `python experiments/robustness/run.py " + " ".join(args.argv) + "`",
        "",
        "| rule | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        *lines,
        "| **best** | " + " | ".join(best) + " |",
        "",
        "Score: the mean accuracy; in the backdoor columns the accuracy less the attack success rate "
        "(ASR: triggered test images of other classes classified as the target). Best: the highest score.",
        "",
        "Worst attacked column per rule (its lowest score; clean accuracy in brackets): "
        + ", ".join(
            f"{r} {w:.3f} ({clean[r]:.3f})"
            for r, w in sorted(worst.items(), key=lambda kv: -(kv[1] or 0))
            if w is not None and clean[r] is not None
        ),
        "",
        "The issue's goal, every column within 3 points of clean accuracy: by accuracy alone (the "
        + f"attack success rate aside): {', '.join(accurate) or 'none'}; by score, of the rule's own clean "
        + f"accuracy: {', '.join(own) or 'none'}"
        + (f"; of FedAvg's ({reference:.3f}): {', '.join(ref) or 'none'}." if reference is not None else "."),
        "",
    ]
    if beyond:
        head += [
            "Without its attackers the federation itself is less accurate (FedAvg's absent columns: "
            + ", ".join(f"{int(f * 100)}% {absent[f]:.3f}" for f in FRACTIONS)
            + "). The most an attack costs each rule beyond that (FedAvg's absent accuracy at the attack's "
            "share less the rule's score, worst column): "
            + ", ".join(f"{r} {b:+.3f}" for r, b in sorted(beyond.items(), key=lambda kv: kv[1])),
            "",
        ]
    return "\n".join(head)


def heatmap(args, results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from fedtrust.report.style import PAGE, paper, save, wrap

    columns = [("clean", FRACTIONS[0])] + [(a, f) for f in FRACTIONS for a in args.attacks if a != "clean"]
    grid = np.full((len(args.rules), len(columns)), np.nan)  # the score: accuracy, less ASR under a backdoor
    labels = {}
    for i, rule in enumerate(args.rules):
        for j, (attack, fraction) in enumerate(columns):
            rows = results.get((rule, attack, fraction), [])
            _, mean = cell(rows)
            if mean is None:
                continue
            asr = asr_of(rows)
            grid[i, j] = mean - (asr or 0.0)
            labels[i, j] = short(mean) + ("" if asr is None else f"\n{short(asr)}")
    with paper():
        width = min(PAGE, 1.6 + 0.27 * len(columns))
        fig, ax = plt.subplots(figsize=(width, 1.3 + 0.19 * len(args.rules)), layout="constrained")
        cmap = plt.get_cmap("viridis").with_extremes(bad="#E4E4E4")
        im = ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto")
        ax.grid(False)
        names = [a if a == "clean" else f"{a} {int(f * 100)}%" for a, f in columns]
        ax.set_xticks(range(len(columns)), names, rotation=60, ha="right", rotation_mode="anchor", fontsize=6)
        ax.set_yticks(range(len(args.rules)), args.rules, fontsize=6)
        for (i, j), text in labels.items():
            ax.text(j, i, text, ha="center", va="center", fontsize=4.5 if "\n" not in text else 3.6,
                    color="white" if grid[i, j] < 0.6 else "black")  # fmt: skip
        fig.colorbar(im, ax=ax, shrink=0.6, label="score: test accuracy\n(less ASR under the backdoor)")
        ax.set_title(wrap(f"{args.data}: final accuracy, mean over {args.seeds} seed(s); backdoor cells: "
                          "accuracy over attack success rate, coloured by their difference", 110))  # fmt: skip
        save(fig, path)


def short(x: float) -> str:
    """Two decimals without the leading zero (.87, 1.00, -.12): a heatmap cell's label."""
    text = f"{x:.2f}"
    return text.replace("0.", ".", 1) if abs(x) < 1 else text


def federation_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which federation, attacks and seeds the table's cells are (this script's and
    ``experiments/peers/run.py``'s), and how many processes compute them."""
    parser.add_argument("--data", default="digits", choices=["digits", "fashion_mnist"])
    parser.add_argument("--model", default="softmax", choices=["softmax", "mlp"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=list(ATTACKS))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    federation_arguments(parser)
    parser.add_argument("--rules", nargs="*", default=RULES)
    parser.add_argument("--force", action="store_true", help="recompute cached runs")
    parser.add_argument(
        "--out",
        default=str(REPORTS),
        help="directory of the run cache and the reports (default: %(default)s)",
    )
    parser.add_argument(
        "--source",
        help="with --cached-only: report the cached runs of this source hash (not this checkout's)",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="compute nothing: write the report from cached runs ('-' where none)",
    )
    args = parser.parse_args(argv)
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import source_hash  # the CLI's own: a cached run is this code's

    args.code = args.source or source_hash()
    if args.source and not args.cached_only:
        parser.error("--source names the code that computed cached runs: use it with --cached-only")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_path = out_dir / "runs.jsonl"
    cache = {} if args.force else load_cache(cache_path)

    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    here = libraries()
    todo, results, stale = [], {}, 0
    for rule in args.rules:
        for attack in args.attacks:
            for fraction in FRACTIONS[:1] if attack == "clean" else FRACTIONS:
                for seed in range(args.seeds):
                    try:  # a typo is refused before anything runs, not cached as a failed run
                        cfg = config(args.data, args.model, rule, attack, fraction, seed, args.rounds)
                        if seed == 0 and not args.cached_only:
                            validate(cfg)
                    except ValueError as exc:  # ConfigError, or parse_spec's on a malformed rule
                        parser.error(f"rule {rule!r}, attack {attack!r}: {exc} (nothing was run)")
                    k = key(cfg, args.code)
                    row = cache.get(k)
                    # computing: only this very code's rows are reused; rendering: whatever is cached
                    ours = row is not None and all(row.get(n) == v for n, v in here.items())
                    if row is not None and (args.cached_only or ours):
                        results.setdefault((rule, attack, fraction), []).append(row)
                    else:
                        stale += row is not None
                        todo.append((rule, attack, fraction, seed, cfg, k))
    print(f"{len(todo)} runs to compute, {sum(map(len, results.values()))} cached", flush=True)
    if stale:
        print(f"{stale} of them cached from this source under another torch or numpy than "
              f"{', '.join(f'{n} {v}' for n, v in here.items())} (or without the versions recorded): "
              "computed again", flush=True)  # fmt: skip
    if args.cached_only:
        todo = []
    from fedtrust.progress import Progress

    began = time.perf_counter()
    with (
        ProcessPoolExecutor(args.jobs) as pool,
        cache_path.open("a") as out,
        Progress(len(todo), unit="runs") as bar,
    ):
        futures = {pool.submit(run_one, job[4]): job for job in todo}
        for future in as_completed(futures):
            rule, attack, fraction, seed, cfg, k = futures[future]
            row = {"key": k, "rule": rule, "attack": attack, "fraction": fraction, "seed": seed,
                   "data": args.data, "code": args.code, **here, **future.result()}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
            results.setdefault((rule, attack, fraction), []).append(row)
            bar.advance(1, f"{rule}, {attack} {int(fraction * 100)}%, seed {seed}")
    seconds = time.perf_counter() - began
    text = report(args, results, seconds)
    (out_dir / f"{args.data}.md").write_text(text)
    heatmap(args, results, out_dir / f"{args.data}.png")
    print(text)


if __name__ == "__main__":
    main()
