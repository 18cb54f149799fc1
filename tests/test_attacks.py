"""Each update attack sends what its paper says."""

import math
from statistics import NormalDist

import pytest
import torch

from fedtrust.attacks import AttackContext, attack


def context(mode="params", n=10, bad=3, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    updates = torch.randn(n, d, generator=g) + 1.0
    mask = torch.zeros(n, dtype=torch.bool)
    mask[:bad] = True
    return AttackContext(updates, mask, torch.full((d,), 0.5), mode, torch.Generator().manual_seed(seed + 1))


def test_gaussian_replaces_the_parameters_or_the_update():
    ctx = context()
    sent = attack("gaussian", std=1.0)(ctx)
    noise = sent + ctx.global_vector  # in parameter mode the vector replaces the parameters
    assert sent.shape == (3, 6) and abs(noise.mean().item()) < 1.0
    assert torch.allclose(attack("gaussian", of="update")(context()), noise)
    assert torch.allclose(attack("gaussian")(context(mode="gradient")), noise)


def test_sign_flip_and_scaling():
    ctx = context()
    assert torch.equal(attack("sign_flip")(ctx), -ctx.own)
    assert torch.equal(attack("sign_flip", scale=4.0)(ctx), -4 * ctx.own)
    assert torch.equal(attack("scaling", factor=10.0)(ctx), 10 * ctx.own)


def test_random_update_keeps_the_norm():
    ctx = context()
    sent = attack("random_update")(ctx)
    torch.testing.assert_close(sent.norm(dim=1), ctx.own.norm(dim=1))
    assert (torch.nn.functional.cosine_similarity(sent, ctx.own) < 0.99).all()


def test_alie_sends_mean_minus_z_sigma_with_baruchs_z():
    ctx = context(n=10, bad=3)
    sent = attack("alie")(ctx)
    s = 10 // 2 + 1 - 3
    z = NormalDist().inv_cdf((10 - s) / 10)
    expected = ctx.benign.mean(0) - z * ctx.benign.std(0)
    torch.testing.assert_close(sent, expected.expand(3, -1))
    torch.testing.assert_close(attack("alie", z=1.5)(ctx)[0], ctx.benign.mean(0) - 1.5 * ctx.benign.std(0))


def test_ipm_sends_minus_epsilon_times_the_benign_mean():
    ctx = context()
    torch.testing.assert_close(attack("ipm", epsilon=0.5)(ctx), (-0.5 * ctx.benign.mean(0)).expand(3, -1))


@pytest.mark.parametrize("name, options", [("ipm", {"epsilon": 3.0}), ("mimic", {"target": 0})])
def test_noisy_sybils_add_their_own_noise_of_a_share_of_the_honest_spread(name, options):
    """``noise`` s: each corrupted client adds independent N(0, (s sd_k)^2) to what the group sends, sd_k the
    benign updates' per-coordinate standard deviation: copies that are no longer copies, scattered about
    the crafted vector by s times the honest spread."""
    ctx = context(n=60, bad=20, d=4000)
    exact = attack(name, **options)(ctx)
    noisy = attack(name, **options, noise=0.3)(context(n=60, bad=20, d=4000))
    assert torch.equal(attack(name, **options, noise=0.0)(ctx), exact)
    assert len(set(map(tuple, noisy.tolist()))) == 20  # no two alike
    ratio = (noisy - exact) / ctx.benign.std(0)
    assert abs(float(ratio.std()) - 0.3) < 0.01 and abs(float(ratio.mean())) < 0.01
    with pytest.raises(ValueError, match=f"attack {name}: noise"):
        attack(name, noise=-1.0)


def test_mimic_copies_the_benign_client_furthest_along_the_top_variance_direction():
    ctx = context(n=10, bad=3, d=6)
    benign = ctx.benign
    centred = benign - benign.mean(0)
    z = torch.linalg.svd(centred.double(), full_matrices=False).Vh[0]  # the paper's direction, by SVD
    star = int((centred.double() @ z).abs().argmax())
    sent = attack("mimic")(ctx)
    assert torch.equal(sent, benign[star].expand(3, -1))  # an exact copy, the same for every attacker
    assert torch.equal(attack("mimic", target=2)(ctx), benign[2].expand(3, -1))
    assert torch.equal(attack("mimic", target=9)(ctx), benign[9 % 7].expand(3, -1))
    with pytest.raises(ValueError, match="attack mimic: target must be one of 'variance'; got 'max'"):
        attack("mimic", target="max")


def test_mimic_never_copies_an_honest_client_whose_training_diverged():
    """A benign update with a NaN (local training that diverged, which every rule quarantines) is no one
    to copy, and it must not break the choice of whom to copy (found on FedAG's cubic toy)."""
    ctx = context(n=10, bad=3, d=6)
    ctx.updates[3, 2] = math.nan  # the first benign client (the first three are the attackers)
    finite = ctx.benign[1:]
    sent = attack("mimic")(ctx)
    assert torch.isfinite(sent).all()
    assert any(torch.equal(sent[0], row) for row in finite)
    assert torch.equal(attack("mimic", target=0)(ctx), finite[0].expand(3, -1))


def test_crash_sends_non_finite_values():
    assert torch.isnan(attack("crash")(context())).all()
    assert torch.isinf(attack("crash", value=float("inf"))(context())).all()


def test_crash_refuses_a_finite_value_beyond_float32_naming_it():
    """1e39 passed the config's validation, then failed the run inside torch ("value cannot be converted
    to type float without overflow")."""
    with pytest.raises(
        ValueError, match=r"attack crash: value 1e\+39 overflows float32 \(max 3.4e\+38\); use inf"
    ):
        attack("crash", value=1e39)
    assert torch.equal(attack("crash", value=-3e38)(context()), torch.full((3, 6), -3e38))


def test_bad_attack_options_are_clear():
    with pytest.raises(ValueError, match=r"attack gaussian: of must be one of 'params', 'update'; got 'x'"):
        attack("gaussian", of="x")
    with pytest.raises(ValueError, match=r"unknown attack 'alei'. Did you mean 'alie'\?"):
        attack("alei")


@pytest.mark.parametrize(
    "name, options",
    [("alie", {"z": 1.5}), ("ipm", {}), ("min_max", {}), ("min_sum", {}), ("fang_trimmed_mean", {})],
)
def test_a_benign_update_that_diverged_is_left_out_of_what_the_attacker_computes(name, options):
    """One honest NaN row (a client whose training diverged) must not make the attack's statistics NaN:
    its vectors would be quarantined, and the robustness table would credit the defence with an attack
    that never ran. The attack sends what it sends on the round without that client."""
    ctx = context(n=10, bad=3, d=6)
    without = AttackContext(
        torch.cat([ctx.updates[:3], ctx.updates[4:]]), torch.cat([ctx.bad[:3], ctx.bad[4:]]),
        ctx.global_vector, ctx.mode, torch.Generator().manual_seed(1),
    )  # fmt: skip
    ctx.updates[3, 2] = math.nan  # the first benign client (the first three are the attackers)
    sent = attack(name, **options)(ctx)
    assert torch.isfinite(sent).all()
    torch.testing.assert_close(sent, attack(name, **options)(without))


def test_a_diverged_row_the_attacker_does_not_read_changes_nothing():
    """The statistics skip the check of the rows when their result is finite; a NaN in a row outside
    what the attacker reads (an attacker's own update, to an omniscient ALIE) must not leak in, whether
    the BLAS skips a zero weight or not."""
    ctx = context(n=10, bad=3, d=6)
    expected = attack("alie", z=1.5)(context(n=10, bad=3, d=6))
    ctx.updates[0, 4] = math.nan
    torch.testing.assert_close(attack("alie", z=1.5)(ctx), expected)


@pytest.mark.parametrize("knowledge", ["omniscient", "partial"])
def test_a_round_without_corrupted_clients_sends_nothing(knowledge):
    """Every attack that reads the honest updates, on a context with no corrupted client: an empty (0, d)
    tensor. The partial-knowledge ones averaged their own none (ZeroDivisionError)."""
    from fedtrust.attacks import ATTACKS, sent_by

    ctx = context(bad=0)
    for name in ("alie", "ipm", "min_max", "min_sum", "fang_krum", "fang_trimmed_mean", "optimal_alie",
                 "optimal_ipm"):  # fmt: skip
        assert name in ATTACKS
        assert sent_by(attack(name, knowledge=knowledge), ctx).shape == (0, 6)


@pytest.mark.parametrize("name", ["ipm", "alie", "mimic", "min_max"])
def test_a_round_of_only_corrupted_clients_attacks_with_their_trained_updates(name):
    """With no benign client in a round (a sampled round, or every client corrupted), an omniscient
    attack reads every client's honest update: the simulator trains them for it rather than leave the
    zeros of clients it skips (the attack sent exact zeros, silently weaker, before). IPM sends -0.1
    times the mean of those clients' trained updates; mimic copies one of them."""
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    def simulation(corruption):
        config = {"name": "x", "data": {"name": "digits", "clients": 10}, "train": {"rounds": 2, "lr": 0.5},
                  "rule": {"name": "mean"}, **corruption}  # fmt: skip
        return build_simulation(validate(config))

    sim = simulation({"corruption": {"name": name, "fraction": 0.3}})
    bad = torch.nonzero(sim.fed.corrupted).flatten().tolist()
    sent = sim.client_round(1, bad).updates
    honest, _ = simulation({}).local_updates(1, bad)
    assert bool(torch.isfinite(sent).all()) and bool((sent.norm(dim=1) > 0).all())
    if name == "ipm":
        torch.testing.assert_close(sent, (-0.1 * honest.mean(0)).expand_as(sent))
    if name == "mimic":
        assert any(torch.equal(sent[0], row) for row in honest)
