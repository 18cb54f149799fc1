"""Issue 17: an estimator that stops at max_iter before converging says so wherever a user looks: the
rule's info and a ConvergenceWarning (once per rule, not once per round), robust FedAG's info, the round
records of a simulation, and its report. (The Flower strategy's log: tests/test_flower.py.)"""

import json
import warnings

import pytest
import runs
import torch

from fedtrust import Round, rule
from fedtrust.inference import ConvergenceWarning
from fedtrust.report import load_runs, write_report
from fedtrust.sweeps.runner import run_experiment

ESTIMATORS = ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"]


def noisy_round(seed: int = 0) -> Round:
    """Eight clients estimating one 40-vector, from very good to bad."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(40, generator=g)
    scales = torch.tensor([0.1, 0.1, 0.2, 0.2, 0.3, 1.0, 2.0, 3.0])
    return Round(updates=truth + torch.randn(8, 40, generator=g) * scales[:, None])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_rule_stopped_at_max_iter_puts_the_warning_in_info_and_warns_once(name):
    r = rule(name, max_iter=1)
    with pytest.warns(ConvergenceWarning) as caught:
        outs = [r(noisy_round(seed)) for seed in range(3)]
    ours = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert len(ours) == 1  # one per rule object, not one per round: a simulation is not flooded
    assert str(ours[0].message).startswith(f"{name} stopped at its iteration limit (1 iterations)")
    assert "raise max_iter or loosen tol" in str(ours[0].message)
    for out in outs:  # every round keeps its own
        assert out.info["converged"] is False and out.info["iterations"] == 1
        assert out.info["warning"].startswith(f"{name} stopped at its iteration limit (1 iterations)")


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_rule_that_converges_neither_warns_nor_records_a_warning(name):
    r = rule(name, tol=1e-3)  # (the budget each needs on this round; icov_vb needs the looser tol)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        out = r(noisy_round())
    assert out.info["converged"] is True and "warning" not in out.info


def test_the_warning_does_not_change_the_result():
    quiet, stopped = rule("ivar_vb", max_iter=1), rule("ivar_vb", max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        a = quiet(noisy_round())
    with pytest.warns(ConvergenceWarning):
        b = stopped(noisy_round())
    assert torch.equal(a.vector, b.vector) and torch.equal(a.weights, b.weights)


def test_robust_fedag_passes_its_base_rules_warning_through():
    with pytest.warns(ConvergenceWarning, match="ivar_vb stopped at its iteration limit"):
        out = rule("fedag", base="ivar_vb", base_options={"max_iter": 1})(noisy_round())
    assert out.info["converged"] is False
    assert out.info["warning"].startswith("ivar_vb stopped at its iteration limit (1 iterations)")
    assert "posterior_var" in out.info


def digits_runs(out, rounds: int, *rules: dict) -> None:
    """A sweep over ``rules``, six IID digits clients, written under ``out / "t"``."""
    spec = {"name": "t", "data": {"name": "digits", "clients": 6}, "train": {"rounds": rounds, "lr": 0.5}}
    run_experiment(runs.config({**spec, "sweep": {"rule": list(rules)}}), out, progress=False)


def test_a_simulation_keeps_the_warning_in_its_rounds_and_the_report_counts_the_rounds(tmp_path):
    with pytest.warns(ConvergenceWarning) as caught:
        digits_runs(tmp_path, 3, {"name": "ivar_vb", "max_iter": 1}, {"name": "ivar_vb", "max_iter": 500})
    assert sum(issubclass(w.category, ConvergenceWarning) for w in caught) == 1  # 3 rounds, one warning
    stopped, enough = (tmp_path / "t" / f"rule=ivar_vb,max_iter={k}" for k in (1, 500))
    records = [json.loads(line) for line in (stopped / "rounds.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["info"]["converged"] is False and r["info"]["iterations"] == 1
        assert r["info"]["warning"].startswith("ivar_vb stopped at its iteration limit (1 iterations)")
    assert all("warning" not in json.loads(line)["info"] for line in (enough / "rounds.jsonl").open())

    loaded = load_runs(tmp_path / "t")
    assert {r.rule: r.unconverged() for r in loaded} == {
        "ivar_vb(max_iter=1)": (3, 3),
        "ivar_vb(max_iter=500)": (0, 3),
    }
    text = write_report(tmp_path / "t", runs=loaded).read_text()
    assert "Some rounds stopped at max_iter without converging (listed below)." in text
    assert "## Rounds that stopped at max_iter without converging" in text
    assert (
        "- ivar_vb(max_iter=1), t: 3 of 3 rounds stopped at max_iter "
        "(see rule=ivar_vb,max_iter=1/rounds.jsonl)"
    ) in text
    assert "- ivar_vb(max_iter=500)" not in text  # a rule whose rounds all converged is not listed


def test_a_report_whose_rounds_all_converged_says_nothing_about_convergence(tmp_path):
    digits_runs(tmp_path, 2, {"name": "ivar_mle"})
    text = write_report(tmp_path / "t").read_text()
    assert "max_iter" not in text and "converg" not in text


def test_weights_flipping_between_two_floats_have_converged_not_stalled():
    """At the rounding floor the weights may flip between two neighbouring floats, moving by the same
    amount every step. IVAR-VB warm-started at its own fixed point (50 x 1e5) did so at 8.33e-17 for 200
    iterations and reported 'stopped at its iteration limit without converging'. Equal changes are not a
    geometric tail still shrinking towards a far fixed point; a tail that shrinks at every step is."""
    from fedtrust.inference.result import FLOOR_STEPS, converged

    tol = 7.6e-6
    assert converged([8.33e-17] * FLOOR_STEPS, tol)
    assert not converged([8.33e-17] * (FLOOR_STEPS - 1), tol)  # not yet enough steps to tell
    slow = [1e-6 * 0.999**k for k in range(FLOOR_STEPS)]  # within tol, 1e-3 of the way per step
    assert not converged(slow, tol)  # the rest of the way, 1e-3, is far above tol


def test_weights_going_steadily_one_way_after_one_step_back_have_not_converged():
    """Changes within tol that do not shrink are the rounding floor only if the weights stay in place. A
    slow tail that stepped back once (the transient after a SQUAREM jump) and then went on one way had
    moved, over the eight changes, 0.49 of their sum (on an Intel AVX-512 CPU: IVAR-MLE's flat-prior fit
    said "converged" 90 times its tolerance from its fixed point). Over its last four changes it moved their
    whole sum: not the floor. Weights jittering in place, back and forth, are."""
    from fedtrust.inference.result import FLOOR_STEPS, WeightChanges, converged

    def judged(steps):
        changes, w = WeightChanges(), torch.zeros(3, dtype=torch.float64)
        changes.add(w.clone())
        for s in steps:
            w[0] += s
            changes.add(w.clone())
        return converged(changes, 7.6e-6)

    assert FLOOR_STEPS == 8
    assert not judged([4.2e-5, -2.2e-6] + [9.1e-7, 9.2e-7] * 3 + [9.1e-7])
    assert judged([4.2e-5, -2.2e-6] + [9.1e-7, -9.2e-7] * 3 + [9.1e-7])  # in place: the floor


def test_a_fit_stopped_by_its_limit_right_after_a_jump_does_not_say_it_converged():
    """SQUAREM's jump leaves the fast directions far from their fixed point and the slow ones near it: the
    changes of the jump and the first plain step after it shrink fast and pass the geometric-tail test,
    though the fit is still on its way. The loop never judges them; a fit that its iteration limit ended
    there was judged on them afterwards (IVAR-MLE's flat-prior estimate, 200 iterations: "converged",
    6e-4 from its fixed point; here, a linear iteration of rates 0.999 and 0.95 stopped at 7 iterations,
    11 times its tolerance away). Whatever the limit, a fit that says it converged is within a few times
    its tolerance."""
    from fedtrust.inference.accelerate import Step, squarem

    star = torch.tensor([0.3, -0.2], dtype=torch.float64)
    rates = torch.tensor([0.999, 0.95], dtype=torch.float64)

    def weights(s):
        return torch.softmax(torch.cat([s, torch.zeros(1, dtype=s.dtype)]), 0)[None]

    def update(s):
        step = star + rates * (s - star)
        return Step(step, weights(step), -float(((step - star) ** 2).sum()))

    tol, settled = 1e-6, 0
    for limit in range(3, 60):
        fit = squarem(update, torch.tensor([1.0, 0.5], dtype=torch.float64), limit, tol)
        if fit.converged:
            settled += 1
            assert float((fit.last.weights - weights(star)).abs().max()) <= 3 * tol, limit
    assert settled > 30  # most limits are past its convergence
