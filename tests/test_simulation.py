"""The simulator: clean FedAvg matches centralised training, runs are deterministic and resume exactly,
and every mode, attack, lie and failure is handled as documented."""

import json
import math

import numpy as np
import pytest
import runs
import torch
from runs import strip_times

from fedtrust.data import load_digits
from fedtrust.models import build_model
from fedtrust.sim.store import RunStore
from fedtrust.sim.training import local_sgd
from fedtrust.sweeps.runner import build_simulation

BASE = {
    "name": "t",
    "data": {"name": "digits", "clients": 10},
    "model": {"name": "softmax"},
    "train": {"rounds": 6, "lr": 0.5, "batch_size": 32},
    "rule": {"name": "fedavg"},
}


def config(**overrides):
    return runs.config(BASE, **overrides)


def test_clean_fedavg_reaches_centralised_accuracy():
    """FedAvg over 10 IID clients vs the same model trained centrally for as many epochs."""
    records = build_simulation(config(train__rounds=40)).run()
    federated = records[-1]["metrics"]["accuracy"]
    data = load_digits()
    model = build_model("softmax", data)
    central = local_sgd(
        model, model.init(0), data.x_train, data.y_train, 40, 32, 0.5, 0.0, torch.Generator().manual_seed(0)
    )
    centralised = model.evaluate(central, data.x_test, data.y_test)["accuracy"]
    assert centralised > 0.93
    assert federated > centralised - 0.03


def test_same_seed_same_results_and_different_seed_different_results():
    a = strip_times(
        build_simulation(
            config(corruption__name="label_flip", corruption__fraction=0.3, train__fraction=0.5)
        ).run()
    )
    b = strip_times(
        build_simulation(
            config(corruption__name="label_flip", corruption__fraction=0.3, train__fraction=0.5)
        ).run()
    )
    c = strip_times(
        build_simulation(
            config(seed=1, corruption__name="label_flip", corruption__fraction=0.3, train__fraction=0.5)
        ).run()
    )
    assert a == b
    assert a != c


class Crash(Exception):
    pass


def interrupt(cfg, store: RunStore, after: int) -> None:
    """Run ``cfg`` into ``store`` and kill it (:class:`Crash`) once round ``after`` is written."""

    def crash(record):
        if record["round"] == after:
            raise Crash

    with pytest.raises(Crash):
        build_simulation(cfg).run(store, on_round=crash)


@pytest.mark.parametrize("rule", ["fedavg", "centered_clipping", "cfl"])
def test_resume_after_a_crash_gives_the_uninterrupted_result(tmp_path, rule):
    cfg = config(rule__name=rule, train__rounds=8, train__checkpoint_every=3, train__fraction=0.6,
                 corruption__name="sign_flip", corruption__fraction=0.2)  # fmt: skip
    whole = build_simulation(cfg).run(RunStore(tmp_path / "whole"))

    store = RunStore(tmp_path / "crashed")
    interrupt(cfg, store, after=7)
    assert [r["round"] for r in store.rounds()] == list(range(1, 8))  # 7 written, checkpoint at 6
    assert not store.is_finished()
    resumed = build_simulation(cfg).run(store)  # a fresh process would rebuild everything from config
    assert [r["round"] for r in store.rounds()] == list(range(1, 9))  # round 7 redone once, none lost
    assert strip_times(resumed) == strip_times(whole)
    assert store.is_finished()
    again = build_simulation(cfg).run(store)  # finished: nothing runs again
    assert strip_times(again) == strip_times(whole)


def test_gradient_mode_trains_by_distributed_sgd():
    records = build_simulation(config(train__mode="gradient", train__rounds=60, train__lr=0.5)).run()
    first, last = records[0]["metrics"]["accuracy"], records[-1]["metrics"]["accuracy"]
    assert last > 0.8 and last > first


def test_one_round_estimation_aggregates_locally_trained_models_once():
    cfg = config(train__mode="one_round", train__local_epochs=20, rule__name="mean")
    sim = build_simulation(cfg)
    records = sim.run()
    assert len(records) == 1 and records[0]["metrics"]["accuracy"] > 0.85
    # the final model is the plain mean of the ten locally trained models
    locals_ = []
    for k in range(10):
        x, y = sim.fed.data[k]
        from fedtrust.seeding import stream

        locals_.append(local_sgd(sim.model, sim.initial, x, y, 20, 32, 0.5, 0.0, stream(0, "train", 1, k)))
    torch.testing.assert_close(sim.vector, torch.stack(locals_).mean(0), rtol=1e-5, atol=1e-6)


def test_crashed_clients_are_quarantined_and_recorded():
    records = build_simulation(
        config(corruption__name="crash", corruption__fraction=0.2, rule__name="median")
    ).run()
    for r in records:
        bad = [c for c, flag in zip(r["clients"], r["corrupted"], strict=True) if flag]
        assert sorted(r["quarantined"]) == sorted(bad)
        assert all(w == 0 for w, flag in zip(r["weights"], r["corrupted"], strict=True) if flag)
    assert records[-1]["metrics"]["accuracy"] > 0.8


def test_liars_report_the_fake_metric_and_honest_clients_the_truth():
    cfg = config(corruption__name="label_flip", corruption__fraction=0.3, corruption__lie={"value": 0.001})
    r = build_simulation(cfg).run()[0]
    losses = dict(zip(r["clients"], r["train_loss"], strict=True))
    flags = dict(zip(r["clients"], r["corrupted"], strict=True))
    assert all(losses[c] == pytest.approx(0.001) for c in losses if flags[c])
    assert all(losses[c] > 1.0 for c in losses if not flags[c])  # an untrained model's cross-entropy


@pytest.mark.parametrize("executor", ["loop", "batched"])
def test_clients_report_losses_only_when_something_reads_them(executor):
    """The loss pass over every client's data runs for rules that read train_loss (ARFL), on request,
    and never for FedAvg by default (the round records None)."""

    def first(**kw):
        return build_simulation(config(train__rounds=1, train__executor=executor, **kw)).run()[0][
            "train_loss"
        ]

    assert first(rule__name="fedavg") is None
    assert len(first(rule__name="arfl")) == 10
    assert all(v > 1.0 for v in first(rule__name="fedavg", train__report_loss="always"))


def test_benchmark_split_is_held_out_and_reference_scores_updates():
    sim = build_simulation(config(data__benchmark=50))
    bx, by = sim.fed.benchmark
    assert len(by) == 50 and sum(sim.fed.sizes()) == len(load_digits()) - 50
    seen = []

    class Spy:
        def __call__(self, round_):
            seen.append(round_.reference(round_.updates[0]))
            from fedtrust import rule

            return rule("fedavg")(round_)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    sim.rule = Spy()
    sim.run()
    assert len(seen) == 6 and all(math.isfinite(v) for v in seen)
    assert seen[-1] < seen[0]  # models improve on the trusted split


def test_a_rule_error_skips_the_round_and_the_run_goes_on_and_fails_when_no_round_is_left():
    # every client sends NaN: each round quarantines all of them and fails, cleanly
    sim = build_simulation(config(corruption={"name": "crash", "fraction": 1.0}))
    records = sim.run()
    assert len(records) == 6 and all("all 10 clients were quarantined" in r["error"] for r in records)
    assert sim.failure.startswith("no round could be aggregated: all 6 failed (NoValidUpdates: fedavg:")


def test_partial_participation_samples_the_requested_share():
    records = build_simulation(config(train__fraction=0.3)).run()
    assert all(len(r["clients"]) == 3 for r in records)
    assert len({tuple(r["clients"]) for r in records}) > 1


@pytest.mark.parametrize(
    "model, lr, floor", [({"name": "mlp", "hidden": 32}, 0.3, 0.7), ({"name": "cnn"}, 0.1, 0.5)]
)
def test_other_models_train(model, lr, floor):
    records = build_simulation(config(model=model, train__rounds=8, train__lr=lr, train__batch_size=16)).run()
    accuracy = [r["metrics"]["accuracy"] for r in records]
    assert accuracy[-1] > floor and accuracy[-1] > accuracy[0] + 0.3


def test_regression_runs_report_rmse():
    cfg = config(data={"name": "synthetic_linear", "clients": 5, "partition": {"name": "natural"}},
                 model={"name": "linear"}, train__lr=0.05)  # fmt: skip
    records = build_simulation(cfg).run()
    assert "rmse" in records[-1]["metrics"] and records[-1]["metrics"]["rmse"] < records[0]["metrics"]["rmse"]


def test_evaluation_is_a_pluggable_step():
    """A user's evaluation sees every applied round (the new global model, the client models the round's
    updates lead to, which clients) and its metrics are what the run records."""
    from fedtrust.sim.evaluation import TestSetMetrics
    from fedtrust.sim.loop import Simulation

    class Distance:
        def __init__(self):
            self.seen = []

        def observe(self, t, vector, aggregate, members, chosen):
            self.seen.append((t, members.shape[0], list(chosen)))
            self.mean_member = members.mean(0)

        def __call__(self, t, vector):
            return {"distance_to_members": float((vector - self.mean_member).norm())}

        def predictions(self, t, vector):
            return None

    built = build_simulation(config(train__rounds=3, train__fraction=0.5, train__eval_every=2))
    mine = Distance()
    sim = Simulation(built.fed, built.model, built.rule, built.settings, evaluation=mine)
    records = sim.run()
    assert [t for t, _, _ in mine.seen] == [1, 2, 3]
    assert [(n, chosen) for _, n, chosen in mine.seen] == [(5, sim.sample(t)) for t in (1, 2, 3)]
    # FedAvg's aggregate is the sample-weighted mean of the members, not their plain mean: a distance > 0
    assert [r["metrics"] is not None for r in records] == [False, True, True]  # eval_every 2, and the last
    assert all(r["metrics"]["distance_to_members"] > 0 for r in records[1:])
    # the default evaluation of a classification run: the test-set metrics
    default = build_simulation(config(train__rounds=1)).evaluation
    assert type(default) is TestSetMetrics


def test_a_resumed_fedag_run_scores_an_unaggregated_round_under_the_posterior_before_it(tmp_path):
    """FedAG scores a round that aggregates nothing (every sampled client crashed) under the last posterior.
    The checkpoint keeps that posterior: resumed just before such a round, the run used to score it as
    a point prediction (RMSE 53.817 for 53.806, no NLL, CRPS or coverage, no predictions.npz) and still
    said "finished"; now its records and predictions are the uninterrupted run's."""
    cfg = config(data={"name": "cubic_toy", "workers": 6, "clients": 6}, model={"name": "mlp", "hidden": 8},
                 train={"rounds": 6, "lr": 0.05, "checkpoint_every": 1, "fraction": 0.5},
                 corruption={"name": "crash", "fraction": 0.67}, rule={"name": "fedag"})  # fmt: skip
    whole = build_simulation(cfg).run(RunStore(tmp_path / "whole"))
    assert [r["error"] is None for r in whole] == [False, True, True, False, True, False]
    assert "crps" in whole[-1]["metrics"]  # the last round is scored under round 5's posterior

    store = RunStore(tmp_path / "resumed")
    interrupt(cfg, store, after=5)
    resumed = build_simulation(cfg).run(store)
    assert json.dumps(strip_times(resumed)) == json.dumps(strip_times(whole))  # (NaN weights: as text)
    saved = [np.load(tmp_path / run / "predictions.npz") for run in ("whole", "resumed")]
    for key in ("y", "mu", "sigma"):
        assert np.array_equal(saved[0][key], saved[1][key])
    evaluation = build_simulation(cfg).evaluation
    state = evaluation.state_dict()
    assert state == {"posterior": None}  # before any round
    with pytest.raises(ValueError, match=r"names clients \[0, 9\], not indices of this run's 6"):
        evaluation.load_state_dict({"posterior": {"mean": torch.zeros(1), "var": torch.zeros(1),
                                                  "members": None, "weights": None, "chosen": [0, 9]}})  # fmt: skip
    assert evaluation.posterior is None  # refused before anything changed


def test_a_session_killed_after_a_failed_one_leaves_no_earlier_result_in_the_manifest(tmp_path):
    """A run that failed is run again and killed hard in round 1: its manifest said "running" beside the
    failed session's final metrics, finish time and count, a result no finished computation gave (a
    freshness review's suspicion, confirmed here)."""
    cfg = config(train__rounds=3)
    store = RunStore(tmp_path / "run")
    build_simulation(cfg).run(store, {"config": {}})
    store.clear()  # the files of a session that failed in round 1
    store.write_manifest({"config": {}, "status": "failed", "error": "x", "final": {"accuracy": 0.5},
                          "finished": "2026-01-01T00:00:00+0000", "not_aggregated": 1})  # fmt: skip
    interrupt(cfg, store, after=1)
    manifest = store.manifest()
    assert manifest["status"] == "running" and "interrupted" in manifest
    assert not {"final", "finished", "not_aggregated", "error"} & set(manifest)
