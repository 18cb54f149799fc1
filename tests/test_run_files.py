"""What a run writes can be trusted when read back: checkpoints never execute code, a damaged file is
detected and named, a run resumes from its last good checkpoint, one process writes a run directory,
a run is identified by what it computes, and a failed run says so."""

import functools
import hashlib
import json
import math
import os
import pickle
import re
import shlex
import sys
import textwrap
from collections import deque
from pathlib import Path

import pytest
import runs
import torch
from runs import strip_times

import fedtrust
from fedtrust import Aggregate
from fedtrust.checkpoint import CorruptFileError, atomic_write, load_state, save_state
from fedtrust.sim.store import RecoveryWarning, RunLocked, RunStore
from fedtrust.sweeps.config import ConfigError
from fedtrust.sweeps.runner import ConfigChanged, build_simulation, run_experiment

SRC = Path(fedtrust.__file__).parent


BASE = {
    "name": "t",
    "data": {"name": "digits", "clients": 10},
    "train": {"rounds": 5, "lr": 0.5, "checkpoint_every": 2, "fraction": 0.6},
    "corruption": {"name": "sign_flip", "fraction": 0.2},
    "rule": {"name": "centered_clipping"},
}


def config(**overrides):
    return runs.config(BASE, **overrides)


# ---------------------------------------------------------------- state files


def test_a_state_tree_comes_back_exactly_with_its_types(tmp_path):
    tree = {
        "center": torch.randn(7),
        "history": [{"client-1": 0.5, 3: 1.25, 5: math.nan}, ({"$odd": True}, [None, "x"])],
        "gram": torch.randn(2, 3, 3, dtype=torch.float64),
        "mask": torch.tensor([True, False]),
        "count": torch.tensor(4),
        "empty": torch.zeros(0, 2),
        "floats": [math.inf, -math.inf, 1e-310, 0.1],
        "ids": (7, "seven"),
    }
    save_state(tmp_path / "s.safetensors", tree)
    back = load_state(tmp_path / "s.safetensors")
    assert set(back) == set(tree) and isinstance(back["ids"], tuple) and back["ids"] == (7, "seven")
    assert list(back["history"][0]) == ["client-1", 3, 5] and math.isnan(back["history"][0][5])
    assert back["history"][1] == ({"$odd": True}, [None, "x"])
    assert back["floats"][:2] == [math.inf, -math.inf] and back["floats"][2:] == [1e-310, 0.1]
    for key in ("center", "gram", "mask", "count", "empty"):
        assert back[key].dtype == tree[key].dtype and torch.equal(back[key], tree[key])


@pytest.mark.parametrize(
    "tree, where",
    [
        ({"history": deque([1])}, r"state\['history'\]: .* got deque"),
        ({"x": [1, object()]}, r"state\['x'\]\[1\]: .* got object"),
        ({"x": {1.5: 2}}, r"state\['x'\]: dict keys must be str or int"),
        ({"x": {True: 2}}, r"state\['x'\]: dict keys must be str or int"),
    ],
)
def test_what_a_state_cannot_hold_is_refused_naming_where(tmp_path, tree, where):
    with pytest.raises(TypeError, match=where):
        save_state(tmp_path / "s.safetensors", tree)
    assert not (tmp_path / "s.safetensors").exists()


class Planted:
    """A pickle that runs code when unpickled: it would create the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    planted = tmp_path / "checkpoint.safetensors"
    torch.save({"round": 1, "rule_state": Planted(marker)}, planted)
    with pytest.raises(CorruptFileError, match=f"{planted}: not a readable fedtrust state file"):
        load_state(planted)
    planted.write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(CorruptFileError, match="not a readable fedtrust state file"):
        load_state(planted)
    assert not marker.exists()


def test_no_source_file_reads_a_pickle():
    """Files read back never execute code: no torch.load, pickle.load(s) or weights_only=False in src."""
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for forbidden in ("torch.load(", "pickle.load", "weights_only=False", "allow_pickle=True"):
            assert forbidden not in text, f"{path} uses {forbidden}"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"", "the file is empty"),
        (lambda b: b[: len(b) // 2], "not a readable fedtrust state file"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "the tensor data does not match its checksum"),
        (lambda b: b"not a checkpoint at all" * 10, "not a readable fedtrust state file"),
    ],
)
def test_a_damaged_state_file_is_detected_naming_the_file_and_the_remedy(tmp_path, damage, message):
    path = tmp_path / "state.safetensors"
    save_state(path, {"center": torch.arange(64, dtype=torch.float32)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptFileError, match=f"{path}: {message}.*; delete it"):
        load_state(path, remedy="delete it")


def test_a_crash_while_writing_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    atomic_write(path, "old")

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, "new")
    assert path.read_text() == "old"


# ---------------------------------------------------------------- resuming honestly


def crashed_run(tmp_path, cfg, at):
    """A run interrupted right after round ``at`` (a checkpoint every 2 rounds)."""

    class Crash(Exception):
        pass

    def crash(record):
        if record["round"] == at:
            raise Crash

    store = RunStore(tmp_path / "run")
    with pytest.raises(Crash):
        build_simulation(cfg).run(store, on_round=crash)
    return store


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return strip_times(build_simulation(config()).run(RunStore(tmp_path_factory.mktemp("w") / "whole")))


def test_checkpoints_are_state_files_and_the_one_before_is_kept(tmp_path, whole):
    store = crashed_run(tmp_path, config(), at=4)
    assert load_state(store.checkpoint_path)["round"] == 4
    assert load_state(store.previous_checkpoint_path)["round"] == 2
    assert strip_times(build_simulation(config()).run(store)) == whole
    assert not list(store.dir.glob("*.pt")) and not list(store.dir.glob(".*.tmp"))


@pytest.mark.parametrize("broken", ["newest", "both"])
def test_a_damaged_checkpoint_resumes_from_the_last_good_one_and_says_so(tmp_path, whole, broken):
    store = crashed_run(tmp_path, config(), at=4)
    store.checkpoint_path.write_bytes(b"")
    if broken == "both":
        store.previous_checkpoint_path.write_bytes(store.previous_checkpoint_path.read_bytes()[:100])
    with pytest.warns(RecoveryWarning, match=f"{store.checkpoint_path}: the file is empty"):
        resumed = build_simulation(config()).run(store)
    assert strip_times(resumed) == whole  # deterministic streams: an earlier start gives the same run
    notes = store.manifest()["recovered"]
    assert any("checkpoint.safetensors: the file is empty" in n for n in notes)
    assert (len(notes) == 2) == (broken == "both")


def test_a_planted_checkpoint_is_not_executed_and_the_run_recovers(tmp_path, whole):
    store = crashed_run(tmp_path, config(), at=3)
    marker = tmp_path / "pwned"
    torch.save({"round": 2, "vector": Planted(marker)}, store.checkpoint_path)
    with pytest.warns(RecoveryWarning, match="not a readable fedtrust state file"):
        assert strip_times(build_simulation(config()).run(store)) == whole
    assert not marker.exists()


def test_a_checkpoint_the_rule_refuses_is_skipped(tmp_path, whole):
    store = crashed_run(tmp_path, config(), at=4)
    state = load_state(store.checkpoint_path)
    state["rule_state"] = {"center": torch.full((650,), math.nan)}
    save_state(store.checkpoint_path, state)
    with pytest.warns(RecoveryWarning, match="the rule refuses its state"):
        assert strip_times(build_simulation(config()).run(store)) == whole


def test_a_checkpoint_from_another_runs_folder_is_not_resumed(tmp_path, whole):
    """Another run's checkpoint of the same round and model size, copied into this run's folder, was
    resumed without a word (the run finished from the other run's model). A checkpoint keeps the hash of
    its round's record: this one does not follow this run's round 2, so the run resumes from the start."""
    other = crashed_run(tmp_path / "other", config(seed=7, rule={"name": "mean"}), at=3)
    store = crashed_run(tmp_path, config(), at=3)
    assert load_state(store.checkpoint_path)["after"] == store.record_digest(store.rounds()[1])
    store.checkpoint_path.write_bytes(other.checkpoint_path.read_bytes())  # both after round 2
    with pytest.warns(
        RecoveryWarning, match=r"checkpoint.safetensors does not follow round 2 of .*another run's"
    ):
        assert strip_times(build_simulation(config()).run(store)) == whole


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda lines: lines[:2] + [b"{garbled"] + lines[3:], r"line 3 is not a JSON record \(garbled\)"),
        (lambda lines: lines[:2] + lines[3:], "line 3 holds round 4, expected round 3"),
        (lambda lines: lines[:-1], None),  # a finished run missing its last round (past the checkpoint)
        (  # valid JSON holding a value of the wrong kind: skipped as fresh, then a traceback in the report
            lambda lines: (
                lines[:2] + [lines[2].replace(b'"accuracy": ', b'"accuracy": "high", "was": ')] + lines[3:]
            ),
            'line 3: metrics.accuracy is "high", not a number',
        ),
    ],
)
def test_a_finished_run_with_damaged_round_records_is_redone_not_skipped(tmp_path, whole, damage, problem):
    store = RunStore(tmp_path / "run")
    build_simulation(config()).run(store)
    lines = store.rounds_path.read_bytes().splitlines()
    store.rounds_path.write_bytes(b"\n".join(damage(lines)) + b"\n")
    if problem:
        with pytest.raises(CorruptFileError, match=f"rounds.jsonl, {problem}; run `fedtrust run` again"):
            store.rounds()
    with pytest.warns(RecoveryWarning, match=problem or "is for round 5, past the 4 readable rounds"):
        assert strip_times(build_simulation(config()).run(store)) == whole
    assert len(store.rounds()) == 5 and store.is_finished()


def test_checkpoints_without_a_manifest_are_not_resumed_and_clearing_removes_the_manifest_last(tmp_path):
    """A run killed while --force cleared it left checkpoints and rounds but no manifest (it went first),
    and the next run resumed them blindly: lr 0.5's result printed as lr 0.05's (a freshness review).
    Nothing says what such files computed: the run starts over, and clearing now removes the manifest
    last."""
    from fedtrust.sim.store import RecoveryWarning

    store = crashed_run(tmp_path, config(), at=3)
    order = []
    unlink = Path.unlink
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "unlink", lambda self, *a, **k: order.append(self.name) or unlink(self, *a, **k))
        RunStore(store.dir).clear()
    assert order[-1] == "manifest.json" and "checkpoint.safetensors" in order
    store = crashed_run(tmp_path / "again", config(), at=3)
    store.manifest_path.unlink()  # as a kill between the two would leave it
    with pytest.warns(RecoveryWarning, match="no manifest: nothing says what they computed"):
        records = build_simulation(config(train__lr=0.05)).run(store)
    assert strip_times(records) == strip_times(
        build_simulation(config(train__lr=0.05)).run(RunStore(tmp_path / "b"))
    )


def test_an_interrupted_run_says_when_and_why_it_stopped_until_it_resumes(tmp_path):
    """A run stopped mid-way stays unfinished and resumable; its manifest and the report say after which
    round and why it stopped, and its resumption finishes it without that note."""
    from fedtrust.report import load_runs

    store = crashed_run(tmp_path, config(), at=3)
    manifest = store.manifest()
    assert manifest["status"] == "running" and manifest["interrupted"].endswith("after round 3 of 5: Crash")
    (run,) = load_runs(tmp_path)
    assert run.reason.startswith("3 rounds so far; stopped ") and run.reason.endswith("of 5: Crash")
    build_simulation(config()).run(store)
    assert store.manifest()["status"] == "finished" and "interrupted" not in store.manifest()


def test_a_line_cut_short_by_a_crash_is_redone(tmp_path, whole):
    store = crashed_run(tmp_path, config(), at=3)
    with open(store.rounds_path, "ab") as fh:
        fh.write(b'{"round": 4, "metr')
    records, problem = store.read_rounds()
    assert len(records) == 3 and "line 4 was cut short" in problem
    with pytest.warns(RecoveryWarning, match="line 4 was cut short"):
        assert strip_times(build_simulation(config()).run(store)) == whole


# ---------------------------------------------------------------- one writer


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    folder = tmp_path / "out" / "t" / "run"
    with runs.lock_held_elsewhere(folder) as holder:
        with pytest.raises(
            RunLocked, match=rf"{folder} is being written by another fedtrust process \(pid {holder.pid}"
        ):
            run_experiment(config(train__rounds=1), tmp_path / "out", progress=False)
        assert not (folder / "rounds.jsonl").exists()
    run_experiment(config(train__rounds=1), tmp_path / "out", progress=False)  # free again
    assert RunStore(folder).is_finished()


def test_a_run_another_sweep_wrote_from_another_config_meanwhile_is_left_and_named(tmp_path, monkeypatch):
    """Two sweeps of different configs on one --out: the config was compared once, before anything ran,
    so a run the other sweep wrote meanwhile was resumed (or its number printed as skipped) as this
    config's (a freshness review). It is compared again under the run's lock."""
    import fedtrust.sweeps.runner as runner

    mine, theirs = config(train__rounds=2), config(train__rounds=2, train__lr=0.05)
    preflight = runner._preflight

    def meanwhile(*args, **kwargs):  # the other sweep writes the run between the check and the lock
        decided = preflight(*args, **kwargs)
        monkeypatch.setattr(runner, "_preflight", preflight)
        assert run_experiment(theirs, tmp_path, progress=False)[0].status == "finished"
        return decided

    monkeypatch.setattr(runner, "_preflight", meanwhile)
    (outcome,) = run_experiment(mine, tmp_path, progress=False)
    assert outcome.status == "failed" and outcome.final is None
    assert (
        "another process wrote this run from another config while this sweep ran (train.lr" in outcome.error
    )
    assert RunStore(outcome.directory).manifest()["config"]["train"]["lr"] == 0.05  # theirs, untouched


# ---------------------------------------------------------------- a run is what it computes


def test_a_changed_config_is_refused_naming_the_keys_and_force_starts_it_over(tmp_path):
    out = tmp_path / "out"
    first = run_experiment(config(train__rounds=2), out, progress=False)
    assert [o.status for o in first] == ["finished"]
    manifest = RunStore(first[0].directory).manifest()
    assert len(manifest["config_hash"]) == 64 and manifest["versions"]["fedtrust"] == fedtrust.__version__
    assert [o.status for o in run_experiment(config(train__rounds=2), out, progress=False)] == ["skipped"]
    before = (first[0].directory / "rounds.jsonl").read_bytes()
    with pytest.raises(ConfigChanged, match=r"run: train.rounds: 2 -> 3\n.*--force to start those runs over"):
        run_experiment(config(train__rounds=3), out, progress=False)
    with pytest.raises(ConfigChanged, match=r"rule.name: 'centered_clipping' -> 'median'"):
        run_experiment(config(train__rounds=2, rule={"name": "median"}), out, progress=False)
    assert (first[0].directory / "rounds.jsonl").read_bytes() == before  # nothing was touched
    again = run_experiment(config(train__rounds=3), out, progress=False, force=True)
    assert again[0].status == "finished" and len(RunStore(again[0].directory).rounds()) == 3


def test_a_run_from_another_fedtrust_version_is_refused(tmp_path, monkeypatch):
    run_experiment(config(train__rounds=1), tmp_path, progress=False)
    monkeypatch.setattr(fedtrust, "__version__", "99.0")
    with pytest.raises(ConfigChanged, match=r"fedtrust version: .* -> 99.0"):
        run_experiment(config(train__rounds=1), tmp_path, progress=False)


def test_a_run_computed_by_other_code_of_the_same_version_is_computed_again(tmp_path, monkeypatch):
    """A finished run is skipped and an interrupted one resumed only by the code that computed it: the
    version number alone cannot tell an edited source (a result of the old code would be printed as
    fresh, or a run resumed half by one code and half by another)."""
    import fedtrust.sweeps.runner as runner
    from fedtrust.sweeps.runner import StaleRunsWarning

    cfg = config(train__rounds=2, sweep={"seed": [0, 1]})
    run_experiment(cfg, tmp_path, progress=False)
    interrupted = RunStore(tmp_path / "t" / "seed=1")
    interrupted.update_manifest(status="running")
    assert [o.status for o in run_experiment(cfg, tmp_path, progress=False)] == ["skipped", "finished"]
    import fedtrust.sim.store as store

    monkeypatch.setattr(runner, "source_hash", lambda: "edited")
    monkeypatch.setattr(store, "source_hash", lambda: "edited")  # (what manifests record)
    with pytest.warns(StaleRunsWarning, match=r"2 run\(s\) .* were computed by other code \(fedtrust source"):
        outcomes = run_experiment(cfg, tmp_path, progress=False)
    assert [o.status for o in outcomes] == ["finished", "finished"]
    assert RunStore(outcomes[0].directory).manifest()["versions"]["fedtrust_source"] == "edited"
    assert [o.status for o in run_experiment(cfg, tmp_path, progress=False)] == ["skipped", "skipped"]


def test_a_run_computed_under_another_torch_is_computed_again_and_reported_as_other_code(tmp_path):
    """Another torch or numpy moves float results (another kernel, another summation order), so a run
    they computed is not this code's result: it was skipped as fresh, and a report called it this
    code's, whatever torch had computed it."""
    import json

    from fedtrust.report import write_report
    from fedtrust.sweeps.runner import StaleRunsWarning

    cfg = config(train__rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    manifest = next((tmp_path / "t").rglob("manifest.json"))
    old = json.loads(manifest.read_text())
    old["versions"]["torch"] = "2.0.0"
    manifest.write_text(json.dumps(old))
    assert "torch 2.0.0" in write_report(tmp_path / "t").read_text()
    assert "1 run by other code" in write_report(tmp_path / "t").read_text()
    with pytest.warns(StaleRunsWarning, match=r"1 run\(s\) .* were computed by other code \(fedtrust source"):
        outcomes = run_experiment(cfg, tmp_path, progress=False)
    assert [o.status for o in outcomes] == ["finished"]
    assert json.loads(manifest.read_text())["versions"]["torch"] == torch.__version__


def test_a_run_of_a_registered_rule_whose_code_changed_is_computed_again(tmp_path):
    """A config names a user's rule but not what it does: runs of an edited rule under the same name were
    skipped, printing the old rule's accuracy as the new one's (a freshness review: 0.91 where the edited
    rule gives 0.12). The source of every registered component a run names, and of the user modules it
    imports, is part of its identity: an edited helper module was skipped too (0.873 where it gives 0.107)."""
    import importlib.util

    from fedtrust.rules import RULES, register
    from fedtrust.sweeps.runner import StaleRunsWarning

    def load(scale, extra=1.0):
        (tmp_path / "my_helper.py").write_text(f"SCALE = {scale}\n")
        (tmp_path / "my_rule.py").write_text(textwrap.dedent(f"""
            import dataclasses

            from fedtrust.aggregators.mean import Mean
            from my_helper import SCALE  # a constant: the helper is followed by the import, not the value

            class Scaled(Mean):
                name = "scaled"

                def aggregate(self, round, first):
                    out = super().aggregate(round, first)
                    return dataclasses.replace(out, vector=out.vector * SCALE * {extra})
            """))  # fmt: skip
        for name in ("my_helper", "my_rule"):  # as an import does
            spec = importlib.util.spec_from_file_location(name, tmp_path / f"{name}.py")
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        register("scaled", module.Scaled, replace=True)

    try:
        load(1.0)
        cfg = config(train__rounds=2, rule={"name": "scaled"})
        (first,) = run_experiment(cfg, tmp_path / "out", progress=False)
        assert [o.status for o in run_experiment(cfg, tmp_path / "out", progress=False)] == ["skipped"]
        for scale, extra in [(-3.0, 1.0), (-3.0, 0.5)]:  # the helper edited, then the rule's own file
            load(scale, extra)
            with pytest.warns(StaleRunsWarning, match="a component you registered has changed"):
                (again,) = run_experiment(cfg, tmp_path / "out", progress=False)
            assert again.status == "finished" and again.final != first.final
            first = again
    finally:
        RULES.pop("scaled", None)
        sys.modules.pop("my_rule", None)
        sys.modules.pop("my_helper", None)


def test_a_run_computed_from_other_data_under_the_same_path_is_computed_again(tmp_path):
    """A CSV relabelled in place: same config, same code, other data; the old result must not be
    printed as this data's."""
    import numpy as np

    from fedtrust.sweeps.runner import StaleRunsWarning

    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 3))
    csv = tmp_path / "data.csv"

    def write(labels):
        rows = [",".join([*(f"{v:.4f}" for v in row), str(int(c))]) for row, c in zip(x, labels, strict=True)]
        csv.write_text("a,b,c,y\n" + "\n".join(rows) + "\n")

    write(x[:, 0] > 0)
    cfg = runs.config({"name": "csv", "data": {"name": "csv", "path": str(csv), "target": "y", "clients": 3},
                       "train": {"rounds": 2, "lr": 0.5}})  # fmt: skip
    first = run_experiment(cfg, tmp_path / "out", progress=False)[0]
    assert run_experiment(cfg, tmp_path / "out", progress=False)[0].status == "skipped"
    write(x[:, 1] > 0)
    with pytest.warns(StaleRunsWarning, match="was computed from other data"):
        again = run_experiment(cfg, tmp_path / "out", progress=False)[0]
    assert again.status == "finished" and again.final != first.final
    # data that are gone (or cut to the header) cannot vouch for the stored number: it is not printed as
    # a skipped run's (a freshness review); a file that is gone fails the run saying why, one cut to its
    # header refuses the sweep before any run (every run on it would fail alike), and the result comes
    # back with the data
    csv.write_text("a,b,c,y\n")
    with pytest.raises(ConfigError, match=r"run: data: .*data.csv: a header and no data rows \(nothing was"):
        run_experiment(cfg, tmp_path / "out", progress=False)
    csv.unlink()
    (gone,) = run_experiment(cfg, tmp_path / "out", progress=False)
    assert gone.status == "failed" and gone.final is None and str(csv.name) in gone.error
    manifest = RunStore(gone.directory).manifest()  # the old run's final metrics were kept beside "failed"
    assert manifest["status"] == "failed" and manifest["final"] is None and manifest["finished"] is None
    write(x[:, 1] > 0)
    back = run_experiment(cfg, tmp_path / "out", progress=False)[0]
    assert back.status == "finished" and back.final == again.final


def test_an_unreadable_manifest_fails_that_run_only(tmp_path):
    cfg = config(train__rounds=1, sweep={"seed": [0, 1]})
    run_experiment(cfg, tmp_path, progress=False)
    broken = RunStore(tmp_path / "t" / "seed=0")
    broken.manifest_path.write_text("")
    outcomes = run_experiment(cfg, tmp_path, progress=False)
    assert [o.status for o in outcomes] == ["failed", "skipped"]
    assert f"{broken.manifest_path} is empty" in outcomes[0].error and "--force" in outcomes[0].error
    outcomes = run_experiment(cfg, tmp_path, progress=False, force=True)
    assert [o.status for o in outcomes] == ["finished", "skipped"]


def test_a_finished_run_whose_manifest_holds_a_wrong_kind_is_named_not_skipped(tmp_path):
    """A finished run whose manifest said final.accuracy "high" was skipped, and `fedtrust run`'s summary
    raised ValueError formatting it: now the run fails naming the field and the remedy."""
    cfg = config(train__rounds=1)
    run_experiment(cfg, tmp_path, progress=False)
    store = RunStore(tmp_path / "t" / "run")
    manifest = store.manifest()
    store.write_manifest({**manifest, "final": {**manifest["final"], "accuracy": "high"}})
    (outcome,) = run_experiment(cfg, tmp_path, progress=False)
    assert (
        outcome.status == "failed"
        and f'{store.manifest_path}: final.accuracy is "high", not a JSON number' in outcome.error
    )
    assert "--force" in outcome.error
    assert run_experiment(cfg, tmp_path, progress=False, force=True)[0].status == "finished"


# ---------------------------------------------------------------- a failed run says so


def test_a_run_where_every_round_failed_is_failed_with_the_reason(tmp_path):
    every_client_crashes = {"name": "crash", "fraction": 1.0}  # NaN updates: each round all quarantined
    outcome = run_experiment(config(corruption=every_client_crashes), tmp_path, progress=False)[0]
    manifest = RunStore(outcome.directory).manifest()
    assert outcome.status == manifest["status"] == "failed"
    assert "no round could be aggregated: all 5 failed" in manifest["error"]
    assert "clients were quarantined" in manifest["error"] and "non-finite entries" in manifest["error"]


def test_a_model_that_goes_non_finite_fails_the_run_which_stops_there(tmp_path):
    class Overflow:
        def __call__(self, round_):
            return Aggregate(torch.full((round_.d,), 3e38), torch.full((round_.n,), 1 / round_.n))

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    sim = build_simulation(config(train__eval_every=10))  # (evaluated at round 1, its outputs overflow)
    sim.rule = Overflow()
    store = RunStore(tmp_path / "run")
    records = sim.run(store)
    assert len(records) == 2  # 3e38 + 3e38 = inf in the second round
    assert sim.failure == "the global model went non-finite in round 2 (diverged); the run stopped"
    assert store.manifest()["status"] == "failed" and store.manifest()["error"] == sim.failure
    assert not store.checkpoint_path.exists()  # the round-2 checkpoint would hold the non-finite model


def test_a_model_whose_outputs_overflow_fails_the_run_though_its_weights_are_finite(tmp_path):
    """A scaling attack of 1e30 on an MLP left its weights finite (|w| up to 4e28) and its outputs NaN:
    the run ended 'finished' with an accuracy of argmax over NaN averaged into the report (a freshness
    review). A non-finite test loss is a diverged model."""
    cfg = config(model={"name": "mlp", "hidden": [16]}, corruption={"name": "scaling", "factor": 1e30, "fraction": 0.3},
                 rule={"name": "mean"}, train__fraction=1.0)  # fmt: skip
    sim = build_simulation(cfg)
    store = RunStore(tmp_path / "run")
    records = sim.run(store)
    assert sim.failure == (
        f"the global model gave a non-finite test loss (its outputs overflow) in round {len(records)} "
        "(diverged); the run stopped"
    )
    assert len(records) < 5 and store.manifest()["status"] == "failed"


def strict_json(text: str):
    """JSON as strict readers parse it (JavaScript's JSON.parse): no NaN or Infinity literals."""

    def refuse(literal):
        raise ValueError(f"{literal} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_run_files_are_strict_json_and_give_their_non_finite_numbers_back(tmp_path):
    """A refused round's weights are NaN and a diverged model's loss is NaN or inf: the files write them
    as proto3's JSON mapping does ("NaN", "Infinity"), so every JSON reader parses them (JavaScript's
    JSON.parse refused Python's NaN literals, jq 1.7 read them as null), and fedtrust reads the numbers
    back; a record's hash, which a checkpoint keeps, is the same before and after."""
    store = RunStore(tmp_path)
    record = {"round": 1, "clients": ["NaN", "b"], "corrupted": [False, True], "weights": [math.nan, 0.5],
              "metrics": {"loss": math.inf, "accuracy": 0.1, "curve": [1.0, -math.inf]}, "auroc": math.nan,
              "error": None, "info": {"lambda": math.nan}, "quarantined": {}, "dropped": {}}  # fmt: skip
    store.append_round(record)
    store.write_manifest({"status": "failed", "final": {"loss": math.nan, "round": 1}})
    (line,) = store.rounds_path.read_text().splitlines()
    assert strict_json(line)["weights"] == ["NaN", 0.5] and strict_json(store.manifest_path.read_text())
    (back,) = store.rounds()
    assert back["clients"] == ["NaN", "b"] and math.isnan(back["weights"][0]) and math.isnan(back["auroc"])
    assert back["metrics"]["loss"] == math.inf and back["metrics"]["curve"] == [1.0, -math.inf]
    assert back["info"] == {"lambda": "NaN"}  # free-form: as written
    assert RunStore.record_digest(back) == RunStore.record_digest(record)
    assert math.isnan(store.manifest()["final"]["loss"])
    # every dict of metrics (a Flower round's server_metrics go back into Flower's MetricRecord)
    store.write_rounds([{**record, "server_metrics": {"loss": math.nan}}])
    assert math.isnan(store.rounds()[0]["server_metrics"]["loss"])


def test_a_checkpoint_written_before_the_files_were_strict_json_still_follows_its_records(tmp_path):
    """A record with a NaN written by earlier fedtrust (Python's NaN literal) and the hash its checkpoint
    kept then: a Flower run resumes across fedtrust versions, and was refused as another run's."""
    store = RunStore(tmp_path)
    record = {"round": 1, "clients": ["a"], "corrupted": [False], "weights": [math.nan], "error": "refused",
              "info": {"lambda": math.nan}}  # fmt: skip
    store.rounds_path.write_text(json.dumps(record) + "\n")
    before = hashlib.sha256(json.dumps(record).encode()).hexdigest()[:16]
    assert store.follows({"after": before}, store.rounds())
    assert not store.follows({"after": "0" * 16}, store.rounds())


def test_a_run_whose_rounds_all_failed_writes_strict_json(tmp_path):
    every_client_crashes = {"name": "crash", "fraction": 1.0}
    outcome = run_experiment(config(corruption=every_client_crashes), tmp_path, progress=False)[0]
    store = RunStore(outcome.directory)
    lines = store.rounds_path.read_text().splitlines()
    assert lines and all(strict_json(line)["weights"][0] == "NaN" for line in lines)
    assert all(math.isnan(w) for r in store.rounds() for w in r["weights"])


def test_a_finished_run_counts_the_rounds_its_rule_could_not_aggregate(tmp_path):
    from fedtrust.aggregators import RoundRefused

    class RefusesTheFirst:
        calls = 0

        def __call__(self, round_):
            self.calls += 1
            if self.calls == 1:
                raise RoundRefused("every client was quarantined")
            return Aggregate(round_.updates.mean(0), torch.full((round_.n,), 1 / round_.n))

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    sim = build_simulation(config(train__rounds=3))
    sim.rule = RefusesTheFirst()
    store = RunStore(tmp_path / "run")
    sim.run(store)
    manifest = store.manifest()
    assert manifest["status"] == "finished" and manifest["not_aggregated"] == 1


def test_the_report_marks_failed_runs_instead_of_averaging_them(tmp_path):
    from fedtrust.report import write_report
    from fedtrust.report.results import Run, load_runs, table

    # every client crashing fails the run at run time (an impossible f is refused with the config)
    crash = {"name": "crash", "fraction": 1.0}
    cfg = config(train__rounds=2, corruption=crash, sweep={"rule": [{"name": "mean"}, {"name": "median"}]})
    run_experiment(cfg, tmp_path / "crash", progress=False)
    runs = load_runs(tmp_path / "crash")
    _, _, cells = table(runs, Run.final)
    median = next(c for (rule, _), c in cells.items() if rule.startswith("median"))
    assert median.failed == 1 and median.count == 0 and math.isnan(median.mean)
    text = write_report(tmp_path / "crash" / "t").read_text()
    assert "| median | failed |" in text
    assert "## Failed runs" in text and "no round could be aggregated" in text


def test_the_report_lists_the_clients_left_out_of_rounds_and_sums_up_many(tmp_path):
    """Crashed devices are quarantined round after round: the report names each with its rounds and
    reason, and a run that left out more clients than it lists is summed up in one line."""
    from fedtrust.report import LISTED_CLIENTS, write_report

    for crashed in (2, LISTED_CLIENTS + 2):
        cfg = config(name=f"c{crashed}", data__clients=20, train__rounds=3, train__fraction=1.0,
                     corruption={"name": "crash", "fraction": crashed / 20})  # fmt: skip
        run_experiment(cfg, tmp_path, progress=False)
    few = write_report(tmp_path / "c2").read_text().split("## Clients left out of rounds")[1]
    listed = [line for line in few.splitlines() if line.startswith("  - ")]
    assert len(listed) == 2, few
    assert all(": quarantined in rounds 1-3: update has non-finite entries" in line for line in listed)
    many = write_report(tmp_path / f"c{LISTED_CLIENTS + 2}").read_text()
    assert (f": {LISTED_CLIENTS + 2} clients quarantined in {3 * (LISTED_CLIENTS + 2)} client-rounds (rounds "
            "1-3); the first reason: update has non-finite entries") in many  # fmt: skip


def test_the_report_says_when_runs_of_a_sweep_never_started(tmp_path):
    """A sweep killed between runs left 4 of 6 on disk, and the report printed 4 runs and a cell of one
    seed's number with nothing missing said (a freshness review). Each run records its sweep's planned
    size, and the report and the CLI say how many are not there."""
    import shutil

    from typer.testing import CliRunner

    from fedtrust.cli import app
    from fedtrust.report import write_report

    run_experiment(config(train__rounds=1, sweep={"seed": [0, 1, 2]}), tmp_path, progress=False)
    assert "## Runs missing from their sweep" not in write_report(tmp_path / "t").read_text()
    shutil.rmtree(tmp_path / "t" / "seed=2")
    text = write_report(tmp_path / "t").read_text()
    assert "- t: 2 of the 3 runs its sweep planned are on disk; the other 1 never started" in text
    result = CliRunner().invoke(app, ["report", str(tmp_path / "t")])
    assert result.exit_code == 0 and "note: t: 2 of the 3 runs its sweep planned are on disk" in result.output


def test_a_run_folder_copied_aside_is_not_another_seed(tmp_path):
    """A copy of seed=0's folder (seed=0.bak) was averaged in as a fourth seed, moving the cell (a
    freshness review). Runs of one config hash are one run: the copy is listed, not counted."""
    import shutil

    from fedtrust.report import write_report
    from fedtrust.report.results import Run, load_runs, table

    run_experiment(config(train__rounds=1, sweep={"seed": [0, 1, 2]}), tmp_path, progress=False)
    shutil.copytree(tmp_path / "t" / "seed=0", tmp_path / "t" / "seed=0.bak")
    runs = load_runs(tmp_path / "t")
    (copy,) = [r for r in runs if r.status == "copy"]
    assert copy.directory.name == "seed=0.bak" and copy.reason.startswith(
        f"the same config and seed as {tmp_path}"
    )
    ((_, cell),) = table(runs, Run.final)[2].items()
    assert cell.count == 3
    text = write_report(tmp_path / "t").read_text()
    assert "4 runs (3 finished, 1 copy)" in text and "## Copies of other runs" in text


def test_of_two_folders_of_one_run_the_report_counts_the_finished_one_by_this_code(tmp_path):
    """Runs of one config and seed, wherever they lie, count once; the one counted was the first in path
    order (a freshness review): an interrupted attempt kept in a subfolder read "1/1 unfinished" over
    the finished re-run, and an archived run of older code hid the fresh one. The counted one is now
    finished before unfinished, this code's before other code's, then the newest. The same config saved
    under two experiment names in one column was averaged as two seeds ("0.833 +- 0.000" for one seed): it
    is one run there, and a run in a column of each of two experiments counts in both."""
    import json
    import shutil

    from fedtrust.report.results import Run, load_runs, table

    run_experiment(config(train__rounds=2), tmp_path, progress=False)
    run = tmp_path / "t" / "run"
    for name, status, source in [("attempt", "running", None), ("archive", "finished", "0" * 16)]:
        shutil.copytree(run, tmp_path / "t" / name / "run")
        path = tmp_path / "t" / name / "run" / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest.update(status=status, finished="2099-01-01T00:00:00+0000")  # newer, yet not counted
        if source:
            manifest["versions"]["fedtrust_source"] = source
        path.write_text(json.dumps(manifest))
    runs = load_runs(tmp_path / "t")
    assert {r.directory: r.status for r in runs} == {
        run: "finished",
        tmp_path / "t" / "attempt" / "run": "copy",
        tmp_path / "t" / "archive" / "run": "copy",
    }
    ((_, cell),) = table(runs, Run.final)[2].items()
    assert (cell.count, cell.unfinished, cell.codes) == (1, 0, 1)

    # one config under two names in one column (both sweep train.lr) is one run; the same run in a column
    # of each of two experiments (one sweeps the rule, the other the corruption) counts in both
    for name, sweep in [("v", {"train.lr": [0.5]}), ("w", {"train.lr": [0.5]}),
                        ("a", {"rule.name": ["centered_clipping"]}), ("b", {"corruption.name": ["sign_flip"]})]:  # fmt: skip
        run_experiment(config(name=name, train__rounds=2, sweep=sweep), tmp_path / "two", progress=False)
    runs = load_runs(tmp_path / "two")
    assert sorted(r.status for r in runs) == ["copy", "finished", "finished", "finished"]
    cells = table(runs, Run.final)[2]
    assert sorted(cells) == sorted((runs[0].rule, s) for s in ("a", "corruption=sign_flip", "train.lr=0.5"))
    assert all(cell.count == 1 for cell in cells.values())


def test_the_report_says_which_code_computed_its_runs(tmp_path):
    """A table read from old runs says so: the report's provenance names the runs' fedtrust source
    hashes against this checkout's, and counts the runs of other code (or none recorded); a cell whose
    seeds different code computed says how many codes it mixes."""
    import json

    from fedtrust.report import write_report
    from fedtrust.sim.store import computed_by, describe, versions

    cfg = config(train__rounds=1, sweep={"seed": [0, 1]})
    run_experiment(cfg, tmp_path, progress=False)
    text = write_report(tmp_path / "t").read_text()
    here = describe(computed_by(versions()))  # source <hash>, torch <version>, numpy <version>
    assert f"{here}: 2 runs. This checkout: {here}; every run by this code" in text
    manifest = next((tmp_path / "t").rglob("manifest.json"))
    old = json.loads(manifest.read_text())
    old["versions"]["fedtrust_source"] = "0123456789abcdef"
    manifest.write_text(json.dumps(old))
    text = write_report(tmp_path / "t").read_text()
    assert "source 0123456789abcdef, torch " in text and "1 run by other code" in text
    # the two seeds of the one cell were computed by different code: the cell says so
    accuracy = text.split("## Final test accuracy")[1].split("\n\n")[1].splitlines()[2]
    assert accuracy.endswith(" (2 codes) |")
    assert 'A cell whose seeds were computed by different code says so ("2 codes")' in text


def test_the_report_never_averages_runs_of_different_configs(tmp_path):
    """Swept sections differing only in an option are two columns named by it; a leftover run of another
    config in the same folder is a column of its own; classification and regression runs get a table
    each (one 'accuracy' table held an RMSE before)."""
    from fedtrust.report import write_report

    sections = [{"name": "sign_flip", "fraction": 0.1}, {"name": "sign_flip", "fraction": 0.4}]
    run_experiment(config(train__rounds=1, rule={"name": "mean"}, sweep={"corruption": sections}), tmp_path,
                   progress=False)  # fmt: skip
    text = write_report(tmp_path / "t").read_text()
    assert "| rule | corruption=sign_flip(fraction=0.1) | corruption=sign_flip(fraction=0.4) |" in text
    # two experiments in one folder, their swept settings named alike, their configs not
    both = tmp_path / "both"
    for name, fraction in (("p", 0.5), ("q", 0.0)):
        cfg = config(name=name, train__rounds=1, rule={"name": "mean"}, corruption__fraction=fraction,
                     sweep={"corruption.name": ["label_flip"]})  # fmt: skip
        run_experiment(cfg, both, progress=False)
    header = (
        write_report(both).read_text().split("## Final test accuracy")[1].split("\n\n")[1].splitlines()[0]
    )
    assert header == "| rule | corruption=label_flip [p] | corruption=label_flip [q] |"
    mixed = config(train__rounds=1, model={"name": "linear"},
                   sweep={"data": [{"name": "digits", "clients": 4}, {"name": "boston", "clients": 4}]})  # fmt: skip
    run_experiment(mixed, tmp_path / "mixed", progress=False)
    text = write_report(tmp_path / "mixed" / "t").read_text()
    accuracy = text.split("## Final test accuracy")[1].split("##")[0]
    rmse = text.split("## Final test rmse")[1].split("##")[0]
    assert "data=digits" in accuracy and "boston" not in accuracy and "data=boston" in rmse


def test_the_report_leaves_out_an_unreadable_run_and_names_its_file(tmp_path):
    from fedtrust.report.results import load_runs

    cfg = config(train__rounds=2, sweep={"seed": [0, 1]})
    run_experiment(cfg, tmp_path, progress=False)
    rounds = tmp_path / "t" / "seed=1" / "rounds.jsonl"
    rounds.write_text(rounds.read_text().replace('{"round": 2', "garbage"))
    runs = load_runs(tmp_path / "t")
    assert [r.status for r in runs] == ["finished", "unreadable"]
    assert f"{rounds}, line 2 is not a JSON record" in runs[1].reason
    from fedtrust.report import write_report

    cell = write_report(tmp_path / "t").read_text().split("| centered_clipping | ")[1].split(" |")[0]
    assert cell.endswith("(1/2 unfinished)")  # one seed's number, and the cell says so


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda run: _as_folder(run / "manifest.json"), r"manifest.json cannot be read \(\[Errno 21\]"),
        (lambda run: _as_folder(run / "rounds.jsonl"), r"rounds.jsonl cannot be read \(\[Errno 21\]"),
        (lambda run: _edit_manifest(run, lambda m: m.pop("config")), r"its config gives no train.rounds"),
    ],
)
def test_a_run_file_that_cannot_be_read_leaves_that_run_out_of_the_report_with_the_reason(
    tmp_path, damage, reason
):
    """A manifest or round file that is a folder stopped the whole report ("could not be written: Is a
    directory"); a finished run whose manifest lost its config was said to have "finished None" rounds."""
    from fedtrust.report import write_report
    from fedtrust.report.results import load_runs

    run_experiment(config(train__rounds=1, sweep={"seed": [0, 1]}), tmp_path, progress=False)
    damage(tmp_path / "t" / "seed=1")
    statuses = {r.directory.name: r for r in load_runs(tmp_path / "t")}
    assert statuses["seed=0"].status == "finished" and statuses["seed=1"].status == "unreadable"
    assert re.search(reason, statuses["seed=1"].reason)
    assert "seed=1" in write_report(tmp_path / "t").read_text()


def _as_folder(path):
    path.unlink()
    path.mkdir()


def _edit_manifest(run, edit):
    manifest = json.loads((run / "manifest.json").read_text())
    edit(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("field", "value"),
    [("config", 5), ("swept", []), ("status", 1), ("versions", "x"), ("config.rule", "median"),
     ("config.rule.name", 3), ("config.train", []), ("seed", "one"), ("index", "first"),
     ("final.accuracy", "high"), ("seconds", "long")],
)  # fmt: skip
def test_a_manifest_field_of_the_wrong_shape_is_named_not_met_deep_in_a_report(tmp_path, field, value):
    """A hand-edited or damaged manifest whose config is 5, or whose config.rule is "median", made the
    report raise AttributeError: now the run is unreadable, named with the field, and the others are still
    reported."""
    from fedtrust.report import write_report
    from fedtrust.report.results import load_runs

    run_experiment(config(train__rounds=1, sweep={"seed": [0, 1]}), tmp_path, progress=False)
    path = tmp_path / "t" / "seed=1" / "manifest.json"
    manifest = json.loads(path.read_text())
    *parents, key = field.split(".")
    functools.reduce(dict.__getitem__, parents, manifest)[key] = value
    path.write_text(json.dumps(manifest))
    unreadable, finished = load_runs(tmp_path / "t")  # an unreadable run has no place in the sweep: first
    assert (unreadable.status, finished.status) == ("unreadable", "finished")
    assert f"{path}: {field} is {json.dumps(value)}, not a JSON " in unreadable.reason
    assert "## Unreadable runs" in write_report(tmp_path / "t").read_text()


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("metrics", {"accuracy": "high"}, 'metrics.accuracy is "high", not a number'),
        ("weights", [None, 0.5], "weights is [null, 0.5], not a list of numbers"),
        ("weights", [0.5, 0.5], "weights has 2 entries for 6 clients"),
        ("clients", 5, "clients is 5, not a list of names"),
        ("corrupted", None, "corrupted is null, not a list of true/false"),
        ("info", {"groups": [3]}, "info.groups is [3], not a list of groups with their clients"),
    ],
)
def test_a_report_names_a_run_file_with_a_wrong_type_and_goes_on(tmp_path, field, value, problem):
    """Valid JSON holding a value of the wrong kind (an accuracy of "high", a null weight, clients: 5) made
    the report raise TypeError from deep inside it: now the run is unreadable, named with its file, line,
    field and value, and the others are still reported."""
    from fedtrust.report import write_report
    from fedtrust.report.results import load_runs

    run_experiment(config(train__rounds=2, sweep={"seed": [0, 1]}), tmp_path, progress=False)
    rounds = tmp_path / "t" / "seed=1" / "rounds.jsonl"
    first, second = rounds.read_text().splitlines()
    rounds.write_text(f"{first}\n{json.dumps({**json.loads(second), field: value})}\n")
    runs = load_runs(tmp_path / "t")
    assert [r.status for r in runs] == ["finished", "unreadable"]
    assert runs[1].reason == f"{rounds}, line 2: {problem}"
    text = write_report(tmp_path / "t").read_text()
    assert f"line 2: {problem}" in text and "(1/2 unfinished)" in text


def test_a_metric_reported_as_a_list_is_named_not_averaged(tmp_path):
    """Flower's MetricRecord allows a list of numbers (per-class accuracies) and the run records keep it;
    the report's table of other metrics took its mean and raised TypeError ('must be real number, not
    list'). Such a metric is named beneath the tables; the numbers are tabulated as before."""
    from fedtrust.report import write_report

    run_experiment(config(train__rounds=2, sweep={"seed": [0, 1]}), tmp_path, progress=False)
    rounds = tmp_path / "t" / "seed=1" / "rounds.jsonl"
    first, second = rounds.read_text().splitlines()
    last = json.loads(second)
    last["metrics"]["per_class"] = [0.5, 0.7]
    rounds.write_text(f"{first}\n{json.dumps(last)}\n")
    text = write_report(tmp_path / "t").read_text()
    assert "Metrics reported as lists, not tabulated: per_class." in text
    assert "### Final test loss" in text


def test_manifest_records_identity_and_time(tmp_path):
    outcome = run_experiment(config(train__rounds=1), tmp_path, progress=False)[0]
    manifest = json.loads((outcome.directory / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["seconds"] > 0 and outcome.seconds > 0
    assert manifest["config"]["train"]["rounds"] == 1
    assert manifest["threads"] == torch.get_num_threads()  # BLAS's sums depend on it


def test_a_killed_sessions_time_up_to_its_checkpoint_is_kept(tmp_path):
    """The time a run took counts every session: a session killed after a checkpoint leaves its time in
    the manifest, and the resumed session adds its own."""
    sim = build_simulation(config())
    store = RunStore(tmp_path / "run")

    def killed(record):
        if record["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sim.run(store, on_round=killed)  # checkpoint at round 2, killed in round 3
    spent = store.manifest()["seconds"]
    assert spent > 0 and store.manifest()["status"] == "running"
    build_simulation(config()).run(store)
    assert store.manifest()["status"] == "finished" and store.manifest()["seconds"] > spent


def test_a_round_where_every_client_was_quarantined_records_their_reasons(tmp_path):
    sim = build_simulation(config(train__rounds=1, corruption={"name": "crash", "fraction": 1.0}))
    record = sim.run(RunStore(tmp_path / "run"))[0]
    assert "all 6 clients were quarantined" in record["error"]
    assert len(record["quarantined"]) == 6 and all("non-finite" in r for r in record["quarantined"].values())


def test_a_named_corruption_that_corrupts_no_client_is_flagged(tmp_path):
    with pytest.warns(UserWarning, match=r"corruption backdoor: corruption.fraction is 0 .* in every run"):
        run_experiment(config(train__rounds=1, corruption={"name": "backdoor"}), tmp_path, progress=False)


def test_run_folder_names_need_no_shell_quoting(tmp_path):
    cfg = config(
        train__rounds=1,
        sweep={
            "rule": [{"name": "trimmed_mean", "f": 0.2}],
            "corruption": [{"name": "label_flip", "fraction": 0.3}],
        },
    )
    outcome = run_experiment(cfg, tmp_path, progress=False)[0]
    name = outcome.directory.name
    assert name == "rule=trimmed_mean,f=0.2_corruption=label_flip,fraction=0.3"
    assert shlex.quote(name) == name  # a shell reads it as one word, unquoted


def test_a_run_folder_named_the_old_way_is_taken_over_not_redone(tmp_path):
    """Run folders named the earlier way (``rule=trimmed_mean(f=0.2)``) get the new name, and their finished
    runs are skipped instead of computed again."""
    cfg = config(train__rounds=2, sweep={"rule": [{"name": "trimmed_mean", "f": 0.2}]})
    first = run_experiment(cfg, tmp_path, progress=False)[0]
    old = first.directory.with_name("rule=trimmed_mean(f=0.2)")
    first.directory.rename(old)
    again = run_experiment(cfg, tmp_path, progress=False)[0]
    assert again.status == "skipped" and again.directory == first.directory and not old.exists()
    assert RunStore(again.directory).manifest()["run"] == "rule=trimmed_mean,f=0.2"
