"""FLTrust (Cao et al., NDSS 2021) as its paper states it: trust is the ReLU of the cosine with the
server's own root-data update, every update is rescaled to that update's norm, and the output is the
trust-weighted mean; a client that boosts its update gains nothing, one that points away gets nothing."""

import math

import pytest
import torch

from fedtrust import Round, rule
from fedtrust.aggregators.core import RoundRefused


class Server:
    def __init__(self, g0):
        self.g0 = torch.as_tensor(g0, dtype=torch.float64)

    def __call__(self, v):
        return 0.0

    def update(self):
        return self.g0


def test_by_hand_in_two_dimensions():
    # g0 = (1, 0): a = (2, 0) aligned (cos 1), b = (0, 3) orthogonal (0), c = (-1, 0) opposite (ReLU: 0),
    # d = (1, 1) at 45 degrees (cos 1/sqrt 2). Rescaled to ||g0|| = 1: a -> (1, 0), d -> (1, 1)/sqrt 2.
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    out = rule("fltrust")(Round(updates=x, reference=Server([1.0, 0.0])))
    s = 1 / math.sqrt(2)
    total = 1 + s
    torch.testing.assert_close(
        out.vector, torch.tensor([(1 + s * s) / total, s * s / total], dtype=torch.float64)
    )
    torch.testing.assert_close(out.weights, torch.tensor([1 / total, 0, 0, s / total], dtype=torch.float64))
    torch.testing.assert_close(
        out.info["clients"]["cosine"], torch.tensor([1, 0, -1, s], dtype=torch.float64)
    )


def test_boosting_an_update_gains_nothing():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 30, generator=g, dtype=torch.float64) + 0.5
    server = Server(torch.full((30,), 0.5))
    boosted = x.clone()
    boosted[3] *= 100
    a, b = (
        rule("fltrust")(Round(updates=x, reference=server)),
        rule("fltrust")(Round(updates=boosted, reference=server)),
    )
    torch.testing.assert_close(a.vector, b.vector)
    torch.testing.assert_close(a.weights, b.weights)


def test_tiny_and_zero_updates():
    x = torch.tensor([[1e-15, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float32)
    out = rule("fltrust")(Round(updates=x, reference=Server([1.0, 0.0])))
    assert torch.isfinite(out.vector).all() and out.weights[1] == 0  # a zero update has no direction
    assert out.weights[0] > out.weights[2] > 0  # the tiny update points exactly along g0


def test_refuses_without_root_data_and_makes_no_update_without_any_trusted_client():
    x = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(RoundRefused, match="set data.benchmark"):
        rule("fltrust")(Round(updates=x, reference=lambda v: 0.0))
    for g0, why in (([1.0, 0.0], "every trust score is 0"), ([0.0, 0.0], "zero this round")):
        out = rule("fltrust")(Round(updates=x, reference=Server(g0)))  # the paper's 0 / 0
        assert torch.equal(out.vector, torch.zeros(2)) and why in out.info["degenerate"]
        torch.testing.assert_close(out.weights, torch.full((2,), 0.5))
    with pytest.raises(
        RoundRefused, match="must be 2 finite numbers, got 2 of dtype torch.float64, 1 of them NaN or Inf"
    ):
        rule("fltrust")(Round(updates=x, reference=Server([1.0, math.nan])))


def test_in_the_simulator_sign_flippers_get_no_trust_and_the_model_learns():
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    cfg = validate({
        "data": {"name": "digits", "clients": 10, "benchmark": 0.05},
        "model": {"name": "softmax"},
        "train": {"rounds": 8, "lr": 0.5, "batch_size": 32},
        "corruption": {"name": "sign_flip", "scale": 4.0, "fraction": 0.4},
        "rule": {"name": "fltrust"},
    })  # fmt: skip
    sim = build_simulation(cfg)
    records = sim.run()
    assert all(r["error"] is None for r in records)
    flipped = [sum(w for w, bad in zip(r["weights"], r["corrupted"], strict=True) if bad) for r in records]
    assert (
        max(flipped) < 0.05 and sum(flipped) / len(flipped) < 0.01
    )  # late rounds: an honest update may point off
    assert records[-1]["metrics"]["accuracy"] > 0.85
    # the server's update is trained once a round, like a client's
    ref = sim.client_round(9, sim.sample(9)).reference
    assert ref.update() is ref.update() and ref.update().shape == (sim.model.size,)
