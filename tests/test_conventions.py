"""What a user expects of a maintained Python tool: --version and -h, listings that fit a terminal, type
information shipped, API documentation that builds from the docstrings, every import declared, and no
hand-written code where a maintained library does the job (AUROC)."""

import ast
import importlib.metadata
import importlib.resources
import re
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import fedtrust
from fedtrust.attacks import ATTACKS
from fedtrust.cli import app
from fedtrust.data.corruptions import DATA_CORRUPTIONS
from fedtrust.data.partition import PARTITIONERS
from fedtrust.rules import PRE_AGGREGATORS, RULES
from fedtrust.sim.detection import detection_auroc

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_version_and_short_help():
    result = runner.invoke(app, ["--version"])
    assert (
        result.exit_code == 0
        and result.output.strip() == f"fedtrust {importlib.metadata.version('fedtrust')}"
    )
    assert fedtrust.__version__ == importlib.metadata.version("fedtrust")
    for args in (["-h"], ["run", "-h"], ["flower-run", "-h"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.output, args


@pytest.mark.parametrize(
    ("command", "tables"),
    [
        ("rules", (RULES, PRE_AGGREGATORS)),
        ("attacks", (ATTACKS, DATA_CORRUPTIONS)),
        ("partitioners", (PARTITIONERS,)),
    ],
)
@pytest.mark.parametrize("columns", [80, 200])
def test_listings_name_every_entry_with_its_options_and_fit_the_terminal(
    command, tables, columns, monkeypatch
):
    monkeypatch.setenv("COLUMNS", str(columns))
    result = runner.invoke(app, [command])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= min(columns, 100)
    for table in tables:
        for name in table:
            assert re.search(rf"^  {name}\(", result.output, re.M), name
    if command == "attacks":
        assert "alie(" in result.output and "label_flip(" in result.output


def test_type_information_is_shipped():
    assert importlib.resources.files("fedtrust").joinpath("py.typed").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["fedtrust"]


def test_the_api_documentation_builds_from_the_docstrings(tmp_path):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import build
    finally:
        sys.path.remove(str(ROOT / "docs"))
    assert build.build(tmp_path) == []
    for module in build.MODULES:
        page = tmp_path / (module.replace(".", "/") + ".html")
        assert page.is_file(), module
    flower = (tmp_path / "fedtrust" / "flower.html").read_text()
    assert "TrustStrategy" in flower and "weighted_by_key" in flower


def test_every_third_party_import_is_a_declared_dependency():
    """Modules under fedtrust/flower may import what the flower extra brings; the rest only the core, but
    for optional imports that handle ImportError with a message (Ray for --ray)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    core, flower = names(project["dependencies"]), names(project["optional-dependencies"]["flower"])
    owners = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names
    missing = []
    for path in sorted((ROOT / "src" / "fedtrust").rglob("*.py")):
        allowed = core | (flower if "flower" in path.parts else set())
        tree = ast.parse(path.read_text())
        optional = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.Try)
            and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in optional:
                continue
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in stdlib or top == "fedtrust":
                    continue
                dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
                if not dists & allowed:
                    missing.append(f"{path.relative_to(ROOT)}: {top} ({', '.join(sorted(dists))})")
    assert not missing, missing


def test_detection_auroc_is_scikit_learns_with_ties_counting_half():
    assert detection_auroc([0.1, 0.2, 0.3], [True, False, False]) == 1.0
    assert detection_auroc([0.2, 0.2, 0.3], [True, False, False]) == 0.75  # one tie of two pairs
    assert detection_auroc([0.5, 0.2, 0.3], [True, False, False]) == 0.0
    assert detection_auroc([0.1, 0.4, 0.2, 0.3], [True, False, True, False]) == 1.0
    assert detection_auroc([1.0, 1.0], [True, True]) is None  # one kind of client
    assert detection_auroc([float("nan"), 1.0], [True, False]) is None  # a refused round
    with pytest.raises(ValueError, match="2 weights but 3 corrupted flags"):
        detection_auroc([0.1, 0.2], [True, False, False])
