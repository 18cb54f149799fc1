"""experiments/arfl/grouped_sides.py: which side of a round the copy grouping merged, counted against
who held the round's majority (the ARFL README's account of FOCUS under 50% shuffling)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

PATH = Path(__file__).parent.parent / "experiments" / "arfl" / "grouped_sides.py"
spec = importlib.util.spec_from_file_location("grouped_sides", PATH)
grouped_sides = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grouped_sides)


def round_of(corrupted: list[bool], groups: list[list[int]]) -> dict:
    clients = [f"c{i}" for i in range(len(corrupted))]
    return {
        "clients": clients,
        "corrupted": corrupted,
        "info": {"groups": [{"clients": [clients[i] for i in g], "reason": "r"} for g in groups]},
    }


def test_rounds_are_sorted_by_who_holds_the_majority_and_which_side_was_grouped():
    rounds = [
        round_of([True, True, False, False, False], [[0, 1]]),  # honest majority, the corrupted grouped
        round_of([True, True, True, False, False], [[3, 4]]),  # honest minority, the honest grouped
        round_of([True, True, False, False], []),  # tie, nothing grouped
        {"clients": ["a", "b", "c"], "corrupted": [False, False, True], "info": None},  # no info recorded
    ]
    counts = grouped_sides.tally(rounds)
    assert counts["honest majority", "rounds"] == 2
    assert counts["honest majority", "corrupted grouped"] == 1
    assert counts["honest majority", "honest grouped"] == 0
    assert counts["honest minority", "rounds"] == 1
    assert counts["honest minority", "honest grouped"] == 1
    assert counts["honest minority", "corrupted grouped"] == 0
    assert counts["tie", "rounds"] == 1
    assert counts["tie", "honest grouped"] == counts["tie", "corrupted grouped"] == 0


def test_the_command_reads_the_runs_folders_and_names_a_pattern_that_matches_nothing(tmp_path):
    run = tmp_path / "rule=focus_corruption=label_shuffle_corruption.fraction=0.5_seed=0"
    run.mkdir()
    rounds = [round_of([True, True, True, False, False], [[3, 4]])]
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    args = [sys.executable, str(PATH), str(tmp_path), "--rule", "focus", "--corruption", "label_shuffle"]
    done = subprocess.run([*args, "--fraction", "0.5"], capture_output=True, text=True, check=True)
    assert "honest minority:    1 rounds; honest clients grouped in 1, corrupted in 0" in done.stdout
    missing = subprocess.run([*args, "--fraction", "0.3"], capture_output=True, text=True)
    assert missing.returncode != 0 and "no runs match" in missing.stderr
