"""The adaptive attacks send what their papers say: min-max and min-sum scale their perturbation to the
edge of the benign spread (Shejwalkar & Houmansadr 2021), Fang et al.'s attacks get the crafted update
selected by Krum and push the trimmed mean against the honest direction, and the optimal ALIE / IPM
find the strength that moves the server's own rule furthest."""

import math

import pytest
import torch

from fedtrust import Round, rule
from fedtrust.attacks import AttackContext, attack
from fedtrust.attacks.adaptive import maximise


def context(benign, bad=2, aggregate=None, seed=0):
    benign = torch.as_tensor(benign, dtype=torch.float64)
    d = benign.shape[1]
    own = torch.randn(bad, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.tensor([True] * bad + [False] * len(benign))
    g = torch.Generator().manual_seed(seed + 1)
    return AttackContext(torch.cat([own, benign]), mask, torch.zeros(d), "params", g, 1, aggregate)


def random_benign(n=12, d=20, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5


# ------------------------------------------------------------------ min-max / min-sum


def test_min_max_and_min_sum_by_hand_in_one_dimension():
    # benign 0, 1, 5: mean 2, unit-vector perturbation -1, largest pairwise distance 5
    ctx = context([[0.0], [1.0], [5.0]])
    # min-max: |2 - g - x| <= 5 for x in {0, 1, 5}: g <= 7, 6, 2 -> g = 2, sends 0
    torch.testing.assert_close(attack("min_max")(ctx), torch.zeros(2, 1, dtype=torch.float64))
    # min-sum: sum (2 - g - x)^2 = 14 + 3 g^2 <= max_i sum_j (x_i - x_j)^2 = 41 -> g = 3, sends -1
    torch.testing.assert_close(attack("min_sum")(ctx), torch.full((2, 1), -1.0, dtype=torch.float64))


@pytest.mark.parametrize("direction", ["unit_vec", "sign", "std"])
def test_min_max_sits_on_the_edge_of_the_benign_spread(direction):
    benign = random_benign()
    sent = attack("min_max", direction=direction)(context(benign))
    assert torch.equal(sent[0], sent[1])  # every corrupted client sends the same vector
    spread = torch.cdist(benign, benign).max()
    torch.testing.assert_close(torch.cdist(sent[:1], benign).max(), spread)
    # and it is the largest such gamma: 1% further along the perturbation breaks the criterion
    mu = benign.mean(0)
    further = mu + 1.01 * (sent[0] - mu)
    assert torch.cdist(further[None], benign).max() > spread
    # it points the way the paper's perturbation does: against the benign mean for unit_vec / sign
    if direction != "std":
        assert float((sent[0] - mu) @ mu) < 0


def test_min_sum_sits_on_the_edge_of_the_largest_benign_sum_of_squares():
    benign = random_benign(seed=3)
    sent = attack("min_sum", direction="sign")(context(benign))
    sq = torch.cdist(benign, benign).square()
    torch.testing.assert_close((benign - sent[0]).square().sum(), sq.sum(1).max())


def test_min_max_with_partial_knowledge_uses_only_its_own_clients_honest_updates():
    benign = random_benign(seed=4)
    a = attack("min_max", knowledge="partial")
    assert a.uses_own_update  # the simulator must train the corrupted clients
    ctx1, ctx2 = context(benign), context(benign * 3 - 7)  # same own updates, other benign ones
    torch.testing.assert_close(a(ctx1), a(ctx2))
    assert not attack("min_max").uses_own_update


def test_bad_options_name_the_option_and_the_value():
    with pytest.raises(ValueError, match="direction.*'up'"):
        attack("min_max", direction="up")
    with pytest.raises(ValueError, match="knowledge.*'some'"):
        attack("fang_krum", knowledge="some")


# ------------------------------------------------------------------ Fang et al.


@pytest.mark.parametrize("seed", range(4))
def test_fang_krum_gets_its_crafted_update_selected_by_krum(seed):
    benign = random_benign(n=14, d=30, seed=seed)
    krum = rule("krum", f=6)
    ctx = context(benign, bad=6, seed=seed)
    sent = attack("fang_krum")(ctx)
    s = torch.sign(benign.mean(0))
    lam = -float(sent[0] @ s) / len(s)
    torch.testing.assert_close(sent, (-lam * s).expand(6, -1))  # -lambda * s, every corrupted client alike
    out = krum(Round(ctx.with_sent(sent)))
    assert out.info["selected"][0] < 6  # a corrupted client's crafted update is the aggregate
    assert float(out.vector @ benign.mean(0)) < 0  # which moves the model against the honest direction


def test_fang_trimmed_mean_draws_from_the_papers_intervals_by_hand():
    # coordinate 0: benign 1, 2, 3 move up -> push down from w_min = 1 > 0: [1/2, 1]
    # coordinate 1: benign -1, -2, -3 move down -> push up from w_max = -1 < 0: [-1, -1/2]
    # coordinate 2: benign -1, 0, 4 move up -> w_min = -1 <= 0: [-2, -1]
    ctx = context([[1.0, -1.0, -1.0], [2.0, -2.0, 0.0], [3.0, -3.0, 4.0]], bad=50)
    sent = attack("fang_trimmed_mean")(ctx)
    low, high = torch.tensor([0.5, -1.0, -2.0]), torch.tensor([1.0, -0.5, -1.0])
    assert bool(((sent >= low) & (sent <= high)).all())
    assert float(sent.std(0).min()) > 0.05  # each client draws its own values


def test_fang_trimmed_mean_moves_the_trimmed_mean_and_the_median_against_the_honest_direction():
    benign = random_benign(n=12, d=40, seed=5)
    ctx = context(benign, bad=5, seed=5)
    for name, options in [("trimmed_mean", {"f": 5}), ("median", {})]:
        clean = rule(name, **options)(Round(benign)).vector
        attacked = rule(name, **options)(Round(ctx.with_sent(attack("fang_trimmed_mean")(ctx)))).vector
        direction = torch.sign(benign.mean(0))
        assert float(((attacked - clean) * direction).mean()) < 0


# ------------------------------------------------------------------ optimised strength


def test_maximise_finds_the_peak_of_a_known_function():
    assert maximise(lambda x: -((x - 1.3) ** 2), 5.0, grid=8, steps=20) == pytest.approx(1.3, abs=1e-3)
    # a function with two peaks: the grid finds the higher one
    two = lambda x: math.exp(-((x - 0.5) ** 2) * 20) + 2 * math.exp(-((x - 4.0) ** 2) * 20)  # noqa: E731
    assert maximise(two, 5.0, grid=10, steps=20) == pytest.approx(4.0, abs=1e-3)


@pytest.mark.parametrize("name", ["optimal_alie", "optimal_ipm"])
@pytest.mark.parametrize("rule_name", ["median", "geometric_median", "trimmed_mean"])
def test_optimal_strength_harms_the_rule_at_least_as_much_as_the_papers_fixed_one(name, rule_name):
    benign = random_benign(n=14, d=25, seed=7)
    server = rule(rule_name, **({"f": 5} if rule_name == "trimmed_mean" else {}))
    ctx = context(benign, bad=5, aggregate=lambda u: server(Round(u)).vector)
    fixed = attack("alie" if name == "optimal_alie" else "ipm")(ctx)
    optimal = attack(name)
    sent = optimal(ctx)
    assert ctx.deviation(sent) >= ctx.deviation(fixed) - 1e-9
    grid = [optimal.high * i / 8 for i in range(9)]
    assert all(ctx.deviation(sent) >= ctx.deviation(optimal.craft(*ctx.mean_std("omniscient"), s)) - 1e-9
               for s in grid)  # fmt: skip


@pytest.mark.parametrize("name", ["optimal_alie", "optimal_ipm"])
def test_a_partial_knowledge_optimal_attack_never_reads_the_benign_updates(name):
    # Fang et al. 2020, Section 3: with partial knowledge the attacker sees only its own clients' honest
    # updates; it scores strengths on stand-ins drawn from their mean and spread, so what it sends is the
    # same whatever the benign clients computed (the omniscient attacker's is not)
    server = rule("median")
    benign = random_benign(n=12, d=20, seed=8)

    def sent(benign, knowledge):
        ctx = context(benign, bad=5, aggregate=lambda u: server(Round(u)).vector)
        return attack(name, knowledge=knowledge)(ctx)

    torch.testing.assert_close(sent(benign, "partial"), sent(benign * 3 - 7, "partial"))
    assert not torch.allclose(sent(benign, "omniscient"), sent(benign * 3 - 7, "omniscient"))
    ctx = context(benign, bad=5, aggregate=lambda u: server(Round(u)).vector)
    stand_ins = ctx.with_sent(torch.zeros(5, 20), "partial")
    assert torch.equal(stand_ins[5:].isfinite(), torch.ones(12, 20, dtype=torch.bool))
    assert not torch.isin(benign, stand_ins).any()  # no benign value leaks into the attacker's picture


def test_an_attack_that_optimises_against_the_rule_needs_the_oracle():
    with pytest.raises(ValueError, match="no 'aggregate' oracle"):
        attack("optimal_alie")(context(random_benign()))


def test_a_refused_round_counts_as_no_harm():
    from fedtrust.aggregators.core import RoundRefused

    def refuse(u):
        raise RoundRefused("no")

    assert context(random_benign(), aggregate=refuse).deviation(torch.zeros(2, 20)) == 0.0


# ------------------------------------------------------------------ in the simulator


def simulation(corruption, rule_block):
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    cfg = validate({
        "data": {"name": "digits", "clients": 10},
        "model": {"name": "softmax"},
        "train": {"rounds": 2, "lr": 0.5, "batch_size": 64},
        "corruption": {"fraction": 0.3, **corruption},
        "rule": rule_block,
    })  # fmt: skip
    return build_simulation(cfg)


def test_in_the_simulator_an_attack_queries_a_copy_of_the_rule_and_never_its_state():
    sim = simulation(
        {"name": "optimal_alie", "grid": 3, "steps": 2}, {"name": "centered_clipping", "tau": 1.0}
    )
    assert sim.rule.state_dict() == {}
    round_ = sim.client_round(1, sim.sample(1))
    assert sim.rule.state_dict() == {}  # the attack's queries left the server's rule untouched
    assert sim.attack.last is not None and round_.updates[sim.fed.corrupted[sim.sample(1)]].isfinite().all()


@pytest.mark.parametrize(
    "corruption",
    [{"name": "min_max", "direction": "std"}, {"name": "min_sum"}, {"name": "fang_krum", "knowledge": "partial"},
     {"name": "fang_trimmed_mean"}, {"name": "optimal_ipm", "grid": 2, "steps": 1}],
)  # fmt: skip
def test_every_adaptive_attack_runs_from_a_config(corruption):
    records = simulation(corruption, {"name": "median"}).run()
    assert len(records) == 2 and all(r["error"] is None for r in records)
