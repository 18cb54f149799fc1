"""Extending from outside: a rule defined in user code (examples/custom_rule.py) is registered and then
runs by name like a built-in rule, in a round, in fedtrust's simulator and behind the Flower strategy in
Flower's own simulation engine."""

import runpy
from pathlib import Path

import pytest
import torch

import fedtrust
from fedtrust.aggregators import BaseRule
from fedtrust.rules import RULES

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_rule.py"


@pytest.fixture
def example():
    before = dict(RULES)
    yield runpy.run_path(str(EXAMPLE))
    RULES.clear()
    RULES.update(before)


@pytest.mark.usefixtures("alone_with_its_processes")  # its Flower simulation starts Ray
def test_the_example_rule_runs_by_name_in_a_round_in_a_simulation_and_on_flower(example):
    out = example["main"](rounds=3, flower_rounds=3)
    assert out["one_round"].weights[5] == 0 and torch.allclose(
        out["one_round"].weights[:5], torch.full((5,), 0.2)
    )
    last = out["records"][-1]
    assert last["error"] is None and last["metrics"]["accuracy"] > 0.5
    assert sum(w for w, bad in zip(last["weights"], last["corrupted"], strict=True) if bad) < 0.01
    # on Flower: the broken node (features x100, huge updates) gets no trust in any round, the model learns
    flower = out["flower"]
    assert flower["accuracy_after"] > flower["accuracy_before"] + 0.5
    zero = [{node for node, w in trust.items() if w == 0} for trust in flower["trust"]]
    assert zero == [{"partition-3"}] * 3
    # the front door screens the user's rule too: a NaN update is quarantined with a reason
    x = torch.randn(5, 10)
    x[2, 3] = float("nan")
    screened = fedtrust.rule("norm_capped")(fedtrust.Round(updates=x))
    assert screened.weights[2] == 0 and "non-finite" in screened.info["quarantined"][2]
    # and FedAG takes it as a base by name
    assert "posterior_var" in fedtrust.rule("fedag", base="norm_capped")(fedtrust.Round(updates=x)).info


def test_register_refuses_a_bad_name_and_will_not_shadow_a_rule_by_accident(example):
    with pytest.raises(ValueError, match="identifier"):
        fedtrust.register("not a name", example["NormCapped"])
    with pytest.raises(ValueError, match="already a registered rule"):
        fedtrust.register("median", example["NormCapped"])
    with pytest.raises(TypeError, match="needs a rule class"):
        fedtrust.register("x", 3)


def _mean(round):
    return round.updates.mean(0), torch.full((round.n,), 1.0 / round.n)


BROKEN = {
    "a scalar broadcast over the model": (
        lambda r: (_mean(r)[0][:1], _mean(r)[1]),
        "shape \\(1,\\), expected",
    ),
    "the updates themselves": (lambda r: (r.updates, _mean(r)[1]), "shape \\(4, 650\\), expected \\(650,\\)"),
    "another dtype": (
        lambda r: (_mean(r)[0].double(), _mean(r)[1]),
        "torch.float64 vector on cpu for torch.fl",
    ),
    "one weight short": (
        lambda r: (_mean(r)[0], _mean(r)[1][:-1]),
        "weights of shape \\(3,\\), expected \\(4,\\)",
    ),
    "a negative weight": (
        lambda r: (_mean(r)[0], torch.tensor([-5.0, 2.0, 2.0, 2.0])),
        "not a distribution .*client 'client-0': -5.0",
    ),
    "a NaN weight": (
        lambda r: (_mean(r)[0], torch.tensor([float("nan"), 0.25, 0.25, 0.25])),
        "client 'client-0': nan",
    ),
    "scores, not a distribution": (lambda r: (_mean(r)[0], torch.ones(4)), "they sum to 4"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_user_rule_that_breaks_the_aggregate_contract_stops_the_run_naming_what_it_returned(case):
    """Before, a (1,) vector was broadcast onto every coordinate and the run 'finished' at chance
    accuracy, and weights of -5 or NaN went into the records and the trust numbers: now the run fails
    with the rule's name and what it returned (the simulator and the Flower strategy share this step)."""
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    make, message = BROKEN[case]

    class Broken(BaseRule):
        name = "broken"

        def aggregate(self, round):
            return fedtrust.Aggregate(*make(round))

    before = dict(RULES)
    fedtrust.register("broken", Broken)
    try:
        cfg = validate({"name": "broken", "data": {"name": "digits", "clients": 4},
                        "train": {"rounds": 1}, "rule": {"name": "broken"}})  # fmt: skip
        with pytest.raises(ValueError, match=f"rule 'broken' returned .*{message}"):
            build_simulation(cfg).run()
    finally:
        RULES.clear()
        RULES.update(before)
