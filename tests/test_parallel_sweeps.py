"""Sweeps in parallel: ``--jobs N`` processes, or Ray tasks on a cluster, give the runs one process gives,
each run in its own directory, with skip and resume as in one process."""

import pytest
import runs

from fedtrust.report import load_runs
from fedtrust.sweeps.runner import run_experiment

BASE = {
    "name": "sweep",
    "data": {"name": "digits", "clients": 6},
    "train": {"rounds": 3, "lr": 0.5, "checkpoint_every": 1},
    "corruption": {"name": "label_flip", "fraction": 0.3},
    "rule": {"name": "median"},
    "sweep": {"rule.name": ["mean", "median", "ivar_vb"], "seed": [0, 1]},
}


def records(folder):
    return {r.directory.name: runs.strip_times(r.rounds) for r in load_runs(folder)}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    outcomes = run_experiment(runs.config(BASE), out, progress=False)
    assert [o.status for o in outcomes] == ["finished"] * 6
    return out, outcomes


def test_two_processes_give_the_runs_one_process_gives_and_skip_them_after(serial, tmp_path):
    out, outcomes = serial
    parallel = run_experiment(runs.config(BASE), tmp_path, progress=False, jobs=2)
    assert [o.label for o in parallel] == [o.label for o in outcomes]  # the sweep's order
    assert [o.status for o in parallel] == ["finished"] * 6
    assert records(tmp_path) == records(out)
    again = run_experiment(runs.config(BASE), tmp_path, progress=False, jobs=2)
    assert [o.status for o in again] == ["skipped"] * 6


def test_an_interrupted_parallel_sweep_resumes(serial, tmp_path):
    out, _ = serial
    first = runs.config({**BASE, "sweep": {"rule.name": ["mean", "median"], "seed": [0, 1]}})
    run_experiment(first, tmp_path, progress=False, jobs=2)
    done = run_experiment(runs.config(BASE), tmp_path, progress=False, jobs=2)
    assert sorted(o.status for o in done) == ["finished"] * 2 + ["skipped"] * 4
    assert records(tmp_path) == records(out)


@pytest.mark.usefixtures("alone_with_its_processes")
def test_a_sweep_on_a_local_ray_instance(serial, tmp_path):
    ray = pytest.importorskip("ray")
    out, _ = serial
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        done = run_experiment(runs.config(BASE), tmp_path, progress=False, ray="auto")
        assert [o.status for o in done] == ["finished"] * 6
        assert records(tmp_path) == records(out)
        assert [
            o.status for o in run_experiment(runs.config(BASE), tmp_path, progress=False, ray="auto")
        ] == ["skipped"] * 6
    finally:
        ray.shutdown()


def test_jobs_must_be_a_whole_number(tmp_path):
    with pytest.raises(ValueError, match="jobs must be a whole number >= 1, got 0"):
        run_experiment(runs.config(BASE), tmp_path, jobs=0)


def test_each_process_takes_its_share_of_the_cores_it_may_use_not_of_the_machine(tmp_path, monkeypatch):
    """A container or ``taskset`` gives the sweep fewer cores than the machine has: two processes on the
    cores it may use take one thread each (the machine's 8 would have given them 4 each, oversubscribed)."""
    import json
    import os

    from fedtrust.cores import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert usable_cores() == 2
    one_round = {**BASE, "train": {"rounds": 1, "lr": 0.5}, "sweep": {"seed": [0, 1]}}
    done = run_experiment(runs.config(one_round), tmp_path, progress=False, jobs=2)
    assert [o.status for o in done] == ["finished"] * 2
    assert {json.loads((o.directory / "manifest.json").read_text())["threads"] for o in done} == {1}
