"""Extending from outside: a rule defined in user code (examples/custom_rule.py) is registered and then
runs by name like a built-in rule, in a round, in fedtrust's simulator and behind the Flower strategy in
Flower's own simulation engine."""

import runpy
from pathlib import Path

import pytest
import torch

import fedtrust
from fedtrust.rules import RULES

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_rule.py"


@pytest.fixture
def example():
    before = dict(RULES)
    yield runpy.run_path(str(EXAMPLE))
    RULES.clear()
    RULES.update(before)


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
