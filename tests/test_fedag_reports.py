"""experiments/fedag/run.py's reports say what computed them: the robust report committed before
2026-11-27 did not, and its toy rows turned out stale (experiments/fedag/README.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

PATH = Path(__file__).parent.parent / "experiments" / "fedag" / "run.py"


def load():
    spec = importlib.util.spec_from_file_location("fedag_experiment", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_reports_json_and_table_name_the_code_that_computed_them(tmp_path):
    from fedtrust.sim.store import source_hash

    fedag = load()
    made = fedag.write_json(
        tmp_path / "robust.json", "python experiments/fedag/run.py robust --folds 2", {"x": 1}
    )
    stored = json.loads((tmp_path / "robust.json").read_text())
    assert stored["results"] == {"x": 1} and stored["computed_by"] == made
    assert made["fedtrust_source"] == source_hash() and {"date", "command", "torch", "numpy"} <= set(made)
    run = {"nll": 1.0, "rmse": 2.0, "coverage90": 0.9, "sharpness": 3.0}
    fedag.write_robust({"clean": {"FedAG": [run, run]}}, tmp_path, 2, made)
    table = (tmp_path / "robust.md").read_text()
    assert (
        f"source {source_hash()}" in table and "`python experiments/fedag/run.py robust --folds 2`" in table
    )
    assert "| FedAG | 1.00 ± 0.00 | 2.00 ± 0.00 | 0.90 ± 0.00 | 3.00 ± 0.00 |" in table


def test_make_fedag_runs_each_experiment_with_the_folds_of_its_committed_report():
    fedag = load()
    assert fedag.FOLDS == {"boston": 20, "robust": 5}
    for name in ("boston", "robust"):
        report = (PATH.parent / "reports" / f"{name}.md").read_text()
        assert f"run.py {name} --folds {fedag.FOLDS[name]}`" in report
