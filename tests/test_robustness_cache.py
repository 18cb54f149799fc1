"""experiments/robustness/run.py's run cache: a cached number is reused only where this very code
(fedtrust's source, torch and numpy) computed it, and a rendered report says what computed its runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).parent.parent / "experiments" / "robustness" / "run.py"


@pytest.fixture(scope="module")
def robustness():
    spec = importlib.util.spec_from_file_location("robustness_experiment", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its worker function is pickled by name for the process pool
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


ARGS = ["--rules", "fedavg", "--attacks", "clean", "--seeds", "1", "--rounds", "2", "--jobs", "1"]


def cached_row(robustness, **versions) -> dict:
    """The cache row of the ARGS run under this checkout's source, as if computed under ``versions``."""
    from fedtrust.sweeps.runner import source_hash

    code = source_hash()
    cfg = robustness.config("digits", "softmax", "fedavg", "clean", 0.2, 0, 2)
    return {"key": robustness.key(cfg, code), "rule": "fedavg", "attack": "clean", "fraction": 0.2,
            "seed": 0, "data": "digits", "code": code, "accuracy": 0.123456, "backdoor_asr": None,
            "refused": 0, "failure": None, "seconds": 1.0, **versions}  # fmt: skip


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "versions", [{"torch": "1.0.0", "numpy": "1.0.0"}, {}], ids=["another torch and numpy", "not recorded"]
)
def test_a_run_cached_under_other_libraries_is_computed_again(robustness, tmp_path, capsys, versions):
    (tmp_path / "runs.jsonl").write_text(json.dumps(cached_row(robustness, **versions)) + "\n")
    robustness.main([*ARGS, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "1 runs to compute, 0 cached" in printed
    assert "1 of them cached from this source under another torch or numpy" in printed
    fresh = rows(tmp_path)[-1]
    assert fresh["key"] == rows(tmp_path)[0]["key"]
    assert (fresh["torch"], fresh["numpy"]) == tuple(robustness.libraries().values())
    assert fresh["accuracy"] != 0.123456  # the stale number is not the report's
    assert "0.123" not in (tmp_path / "digits.md").read_text()
    # now it is this code's: reused, not computed again
    robustness.main([*ARGS, "--out", str(tmp_path)])
    assert "0 runs to compute, 1 cached" in capsys.readouterr().out
    assert len(rows(tmp_path)) == 2


def test_a_cached_only_report_names_the_versions_its_runs_were_computed_under(robustness, tmp_path, capsys):
    (tmp_path / "runs.jsonl").write_text(json.dumps(cached_row(robustness)) + "\n")
    robustness.main([*ARGS, "--out", str(tmp_path), "--cached-only"])
    text = (tmp_path / "digits.md").read_text()
    assert "versions not recorded: 1 runs" in text and "0.123" in text
    (tmp_path / "runs.jsonl").write_text(json.dumps(cached_row(robustness, torch="9.9", numpy="8.8")) + "\n")
    robustness.main([*ARGS, "--out", str(tmp_path), "--cached-only"])
    assert "torch 9.9, numpy 8.8: 1 runs" in (tmp_path / "digits.md").read_text()


@pytest.mark.parametrize(
    ("option", "named"),
    [
        (["--rules", "krumm"], "unknown rule 'krumm'. Did you mean 'krum'?"),
        (["--rules", "ivar_mle(weighting=screen"], "options go in parentheses"),
        (["--rounds", "0"], "train.rounds: Input should be greater than or equal to 1 (got 0)"),
        (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    ],
    ids=["unknown rule", "malformed options", "no rounds", "no workers"],
)
def test_a_wrong_option_is_refused_before_anything_runs_or_is_cached(
    robustness, tmp_path, capsys, option, named
):
    with pytest.raises(SystemExit) as exc:
        robustness.main([*ARGS, *option, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "runs.jsonl").exists() or not rows(tmp_path)  # no failure cached as a result


def test_compare_matches_two_sources_runs_and_names_those_that_moved():
    """experiments/robustness/compare.py, which the README's "identical digit for digit" claims come from:
    runs are matched by rule, attack, share and seed within one data set, and a run moved when its
    accuracy, ASR or failure differs."""
    spec = importlib.util.spec_from_file_location("robustness_compare", PATH.parent / "compare.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(PATH.parent))  # it imports run.py's REPORTS
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(PATH.parent))

    def row(code, seed, accuracy, data="digits", asr=None):
        return {"rule": "median", "attack": "ipm", "fraction": 0.4, "seed": seed, "data": data, "code": code,
                "accuracy": accuracy, "backdoor_asr": asr, "failure": None}  # fmt: skip

    rows = [row("a", 0, 0.5), row("b", 0, 0.5), row("a", 1, 0.5), row("b", 1, 0.6), row("a", 2, 0.7),
            row("b", 0, 0.1, data="fashion_mnist"), row("a", 3, 0.2, asr=0.1), row("b", 3, 0.2, asr=0.3)]  # fmt: skip
    shared, moved = module.compare(rows, "a", "b", "digits")
    assert (
        shared == 3
    )  # seeds 0, 1 and 3; seed 2 only "a" computed, the Fashion-MNIST row is another data set
    assert [(m[3], m[4], m[5]) for m in moved] == [(1, (0.5, None, None), (0.6, None, None)),
                                                   (3, (0.2, 0.1, None), (0.2, 0.3, None))]  # fmt: skip


def test_the_round_by_round_script_replays_the_tables_cell(robustness, capsys):
    """experiments/robustness/rounds.py, which the README's round-by-round readings come from, runs the
    table's own config: its last accuracy is the cell's, and mimic's copies (every attacker sends client
    0's update) show as one group holding the 20 attackers and the client they copy."""
    spec = importlib.util.spec_from_file_location("robustness_rounds", PATH.parent / "rounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = module.main(["--rule", "ivar_mle", "--attack", "mimic", "--fraction", "0.4", "--rounds", "2"])
    assert capsys.readouterr().out.splitlines() == lines
    assert [line.split(" | ")[0] for line in lines] == ["round   1", "round   2"]
    assert all("groups (members, attackers) (21, 20)" in line for line in lines)
    cell = robustness.run_one(robustness.config("digits", "softmax", "ivar_mle", "mimic", 0.4, 0, 2))
    assert lines[-1].split(" | ")[3] == f"accuracy {cell['accuracy']:.4f}"
