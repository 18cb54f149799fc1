"""The layers of DESIGN.md hold: each package imports only from the layers below it (the import-linter
contract in pyproject.toml), so the rules know nothing of the registry, the simulator or Flower."""

import subprocess
import sys
from pathlib import Path

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
