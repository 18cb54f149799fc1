"""The layers of DESIGN.md hold: each package imports only from the layers below it (the import-linter
contract in pyproject.toml), so the rules know nothing of the registry, the simulator or Flower."""

import subprocess
import sys
from pathlib import Path

import pytest

import fedtrust

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(source: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=source,
        env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_package_imports_only_from_the_layers_below_it():
    result = lint_imports(Path(fedtrust.__file__).parents[1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract can fail: a rule module that reaches up into the registry is reported."""
    import shutil

    shutil.copytree(Path(fedtrust.__file__).parent, tmp_path / "fedtrust")
    mean = tmp_path / "fedtrust" / "aggregators" / "mean.py"
    mean.write_text(mean.read_text() + "\nimport fedtrust.rules  # an upward import\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert "fedtrust.aggregators.mean -> fedtrust.rules" in result.stdout


def test_starting_fedtrust_loads_no_plotting_or_scikit_learn():
    """Every CLI call and every Flower ClientApp (a process per message) starts by importing fedtrust:
    scikit-learn (FLAME's HDBSCAN, the detection AUROC) and matplotlib (reports) load where they are
    used, not at the start. scikit-learn alone took 1.6 s of a 4.6 s ClientApp start on 2 cores."""
    import importlib.util
    import json

    modules = ["fedtrust", "fedtrust.cli", "fedtrust.sim.loop"]
    if importlib.util.find_spec("flwr") is not None:
        modules.append("fedtrust.flower")
    code = f"import json, sys; import {', '.join(modules)}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert not loaded & {"sklearn", "matplotlib"}, sorted(loaded)


def loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after ``statement``."""
    import json

    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout))


def test_a_flower_node_loads_only_the_client_side():
    """Under Flower's default isolation a SuperNode starts a process for every message, so a ClientApp's
    imports are paid every round on every node. `from fedtrust.flower import trust_client_app` loads the
    client's side only: not the strategy, its run files and their scoring rules (scipy.stats). On 2
    cores the example's ClientApp took 7.0 s to import with them, 4.8 s without (torch alone 2.9 s)."""
    pytest.importorskip("flwr")
    loaded = loaded_by("from fedtrust.flower import LocalData, trust_client_app")
    assert "fedtrust.flower.client" in loaded
    assert not loaded & {"fedtrust.flower.strategy", "fedtrust.sim.loop", "scipy.stats"}, sorted(
        name for name in loaded if name.startswith(("fedtrust", "scipy"))
    )


def test_a_run_scores_its_predictions_without_scipy_stats():
    """The scoring rules read the standard normal's cdf and quantile from scipy.special (scipy.stats took
    1.3 s of every run's start) and give scipy.stats.norm's numbers."""
    assert "scipy.stats" not in loaded_by("import fedtrust.sim.loop, fedtrust.cli")
    import numpy as np
    from scipy.stats import norm

    from fedtrust.probabilistic import scoring_rules

    y, mu, sigma = np.linspace(-40, 40, 10001), 0.5, 2.0
    assert np.array_equal(scoring_rules.pit(y, mu, sigma), norm.cdf((y - mu) / sigma))
    for level in (0.5, 0.9, 0.99):
        inside = np.abs(y - mu) <= norm.ppf(0.5 + level / 2) * sigma
        assert scoring_rules.coverage(y, mu, sigma, level) == inside.mean()
