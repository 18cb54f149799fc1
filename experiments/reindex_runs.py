"""Give the runs that a subset of a config computed the place the full config gives them.

A re-run of some rules only (a copy of the config with a shorter ``sweep``, same ``name``, same ``--out``)
writes each run's manifest with the subset's sweep index and size, so ``fedtrust report`` would list those
rules first. This rewrites ``index`` and ``sweep_size`` in the manifests under RUNS to the full config's,
after checking that every run's recorded config hash is the one the full config gives that run (the same
run, computed by whatever source its manifest names). Used for the ARFL tables' IVAR-VB and FOCUS re-runs
(experiments/arfl/README.md, 2026-11-27).

    python experiments/reindex_runs.py experiments/arfl/table2.yaml results/arfl-table2
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedtrust.sim.store import RunStore
from fedtrust.sweeps.config import expand, load
from fedtrust.sweeps.runner import config_hash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the full experiment config")
    parser.add_argument("runs", type=Path, help="the experiment's run folder, OUT/<config name>")
    args = parser.parse_args()
    runs = expand(load(args.config))
    place = {label: (i, config_hash(cfg)) for i, (label, cfg) in enumerate(runs)}
    moved = 0
    for path in sorted(args.runs.glob("*/manifest.json")):
        store = RunStore(path.parent)  # its checked reader and atomic writer
        manifest = store.manifest()
        if manifest["run"] not in place:
            raise SystemExit(f"{path}: run {manifest['run']!r} is not in {args.config}'s sweep")
        index, expected = place[manifest["run"]]
        if manifest["config_hash"] != expected:
            raise SystemExit(f"{path}: its config differs from {args.config}'s run of that name")
        if (manifest["index"], manifest["sweep_size"]) != (index, len(runs)):
            store.update_manifest(index=index, sweep_size=len(runs))
            moved += 1
    print(f"{moved} manifests given the full config's place ({len(runs)} runs in its sweep)")


if __name__ == "__main__":
    main()
