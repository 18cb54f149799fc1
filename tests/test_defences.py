"""Norm bounding, DnC, FLAME and FoolsGold (issue 19): each paper's claim on rounds small enough to work
out by hand."""

import math

import pytest
import torch

from fedtrust import Round, RoundRefused, rule

F64 = torch.float64


def close(a, b, scale=1.0):
    """Equal to float64 rounding: 8 eps, the absolute part times the values' scale."""
    tol = 8 * torch.finfo(F64).eps
    a, b = (torch.as_tensor(v, dtype=F64) for v in (a, b))
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)


# ---------------------------------------------------------------- norm bounding (Sun et al. 2019)

NB = torch.tensor([[3.0, 4.0], [0.0, 0.5], [-2.0, 0.0]], dtype=F64)  # norms 5, 0.5, 2
NB_COUNTS = torch.tensor([1.0, 2.0, 1.0], dtype=F64)


def test_norm_bounding_clips_each_update_to_the_bound_then_takes_the_sample_weighted_mean():
    out = rule("norm_bounding", bound=1.0)(Round(updates=NB, num_samples=NB_COUNTS))
    # clipped: (0.6, 0.8), (0, 0.5), (-1, 0); sample weights 1/4, 1/2, 1/4
    close(out.vector, [0.25 * 0.6 - 0.25, 0.25 * 0.8 + 0.5 * 0.5])
    close(out.info["clients"]["clip"], [1 / 5, 1.0, 1 / 2])
    # trust: n_i min(1, M / ||x_i||) normalised = (0.2, 2, 0.5) / 2.7
    close(out.weights, [2 / 27, 20 / 27, 5 / 27])
    assert out.info["clip_bound"] == 1.0


def test_norm_bounding_by_default_bounds_by_the_median_norm():
    out = rule("norm_bounding")(Round(updates=NB, num_samples=NB_COUNTS))
    assert out.info["clip_bound"] == 2.0  # the median of 5, 0.5, 2
    close(out.vector, [0.25 * 1.2 - 0.25 * 2, 0.25 * 1.6 + 0.5 * 0.5])  # (3, 4) clipped to (1.2, 1.6)
    four = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 10.0]], dtype=F64)
    assert rule("norm_bounding")(Round(updates=four)).info["clip_bound"] == 2.5  # even n: the middle two


def test_norm_bounding_with_a_bound_above_every_norm_is_fedavg():
    g = torch.Generator().manual_seed(0)
    r = Round(updates=torch.randn(6, 20, generator=g, dtype=F64), num_samples=torch.arange(1.0, 7.0))
    out, fedavg = rule("norm_bounding", bound=1e6)(r), rule("fedavg")(r)
    close(out.vector, fedavg.vector, scale=10)
    close(out.weights, fedavg.weights)


def test_norm_bounding_refuses_a_bound_that_is_not_positive():
    with pytest.raises(ValueError, match=r"norm_bounding: bound must be > 0.0, got 0"):
        rule("norm_bounding", bound=0)


# ---------------------------------------------------------------- DnC (Shejwalkar & Houmansadr 2021)

# centred on their mean (2, 0): (-1, 0), (-3, 0), (-2, 1), (-2, -1), (8, 0); X_c^T X_c = diag(82, 2), so
# the top right singular vector is (1, 0) and the scores (squared projections) are 1, 9, 4, 4, 64
DNC = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [10.0, 0.0]], dtype=F64)


def test_dnc_scores_by_the_squared_projection_on_the_top_singular_vector_and_drops_the_highest():
    out = rule("dnc", f=1)(Round(updates=DNC, client_ids=list("abcde")))
    close(out.info["clients"]["score"], [1.0, 9.0, 4.0, 4.0, 64.0], scale=64)
    assert out.info["admitted"] == list("abcd") and out.info["f"] == 1
    close(out.weights, [0.25, 0.25, 0.25, 0.25, 0.0])
    close(out.vector, [0.0, 0.0])  # the mean of the other four


def test_dnc_removes_c_f_clients_per_iteration():
    out = rule("dnc", f=1, c=2.0)(Round(updates=DNC))
    close(out.weights, [1 / 3, 0.0, 1 / 3, 1 / 3, 0.0])  # scores 9 and 64 removed
    with pytest.raises(RoundRefused, match=r"dnc: needs n > c f clients, got n=5 with f=3"):
        rule("dnc", f=3, c=2.0)(Round(updates=DNC))


def test_dnc_removes_a_client_far_out_along_one_direction_whatever_coordinates_it_samples():
    """Ten honest N(0, 1) clients in d = 400 (each about 20 from the others) and one 1000 away along a
    random direction: every subsample of b = 40 coordinates finds it on its top singular vector, so the
    good set is the honest clients and the aggregate their mean."""
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(10, 400, generator=g, dtype=F64)
    u = torch.randn(400, generator=g, dtype=F64)
    x = torch.cat([honest, (honest[0] + 50 * 20 * u / u.norm())[None]])
    out = rule("dnc", f=1, b=40, niters=5)(Round(updates=x))
    close(out.weights, [0.1] * 10 + [0.0])
    close(out.vector, honest.mean(0), scale=10)


def test_dnc_removes_clients_whose_centred_gram_overflows():
    """Three float64 updates of norm 1.25e154, under the front door's limit (1.34e154), one along +e and
    two along -e: centred, the first exceeds the limit and the n x n Gram matrix overflows (its
    eigenvalues NaN); the top singular vector still points along e, so the three score highest (an
    infinite score) and go. (A spread test on the eigenvalues alone scored everyone 0 and kept them.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 20, generator=g, dtype=F64)
    e = torch.randn(20, generator=g, dtype=F64)
    x[0], x[1], x[2] = 1.25e154 * e / e.norm(), -1.25e154 * e / e.norm(), -1.25e154 * e / e.norm()
    out = rule("dnc", f=3)(Round(updates=x))
    assert out.info.get("quarantined") is None  # (under the limit: not the front door's doing)
    close(out.weights, [0.0] * 3 + [1 / 7] * 7)


def test_dnc_removes_a_group_of_copies_the_cut_would_split_whole():
    """Two identical outliers with f = 1: the cut falls inside the group; both go (identical clients,
    identical trust)."""
    x = torch.cat([DNC[:4], DNC[4:], DNC[4:]])
    out = rule("dnc", f=1)(Round(updates=x))
    close(out.weights, [0.25, 0.25, 0.25, 0.25, 0.0, 0.0])
    same = rule("dnc", f=1)(Round(updates=DNC[:1].expand(5, 2)))  # all tied: nobody to tell apart
    close(same.weights, [0.2] * 5)


def test_dnc_refuses_a_round_whose_iterations_keep_no_client_in_common_and_keeps_its_stream():
    """Client j is the outlier of coordinate j: subsamples of one coordinate each remove a different
    client, and after 20 of them nobody was kept every time."""
    dnc = rule("dnc", f=1, b=1, niters=20)
    with pytest.raises(RoundRefused, match=r"dnc: no client was among the 2 lowest scores in all 20"):
        dnc(Round(updates=10 * torch.eye(3, dtype=F64)))
    assert dnc.state_dict() == {}  # the next round draws what this one drew


def _dnc_rounds():
    g = torch.Generator().manual_seed(2)
    return [Round(updates=torch.randn(8, 60, generator=g, dtype=F64)) for _ in range(2)]


def test_dnc_draws_its_coordinates_from_its_seed_and_round_and_resumes_from_its_state():
    first, second = _dnc_rounds()
    a, b = rule("dnc", f=2, b=5), rule("dnc", f=2, b=5)
    a(first)
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"calls": 1}
    score = a(second).info["clients"]["score"]
    close(b(second).info["clients"]["score"], score)  # the resumed rule samples what the first one does
    fresh = rule("dnc", f=2, b=5)(second).info["clients"]["score"]  # round 1's coordinates
    other = rule("dnc", f=2, b=5, seed=1)(second).info["clients"]["score"]
    assert not torch.allclose(fresh, score) and not torch.allclose(fresh, other)
    close(rule("dnc", f=2, b=5)(second).info["clients"]["score"], fresh)  # and the same seed repeats


# ---------------------------------------------------------------- FLAME (Nguyen et al. 2022)

# three benign updates in the first quadrant ((6, 8) points like (3, 4)), two sign-flipped small ones;
# norms 5, 5, 10, 0.5, 0.5: S_t = 5
FLAME = torch.tensor([[3.0, 4.0], [4.0, 3.0], [6.0, 8.0], [-0.3, -0.4], [-0.4, -0.3]], dtype=F64)
FLAME_MEAN = [(3 + 4 + 3) / 3, (4 + 3 + 4) / 3]  # (6, 8) clipped to norm 5: (3, 4)


def test_flame_admits_the_majority_cluster_clips_to_the_median_norm_and_averages():
    out = rule("flame", noise=0)(Round(updates=FLAME, client_ids=list("abcde")))
    assert out.info["admitted"] == list("abc")
    assert out.info["clip_bound"] == 5.0 and out.info["noise_std"] == 0.0
    close(out.info["clients"]["clip"], [1.0, 1.0, 0.5, 1.0, 1.0])
    close(out.vector, FLAME_MEAN, scale=4)
    close(out.weights, [0.4, 0.4, 0.2, 0.0, 0.0])  # coefficients (1, 1, 1/2) / 3, normalised


def test_flame_reads_a_round_with_previous_as_models():
    """W_i = G + x_i: the clustering sees the models, the clipping their distances from G, and the output
    is the model G + the clipped mean of W_i - G."""
    g = torch.tensor([0.01, -0.02], dtype=F64)
    out = rule("flame", noise=0)(Round(updates=FLAME + g, previous=g))
    close(out.vector, torch.tensor(FLAME_MEAN, dtype=F64) + g, scale=4)
    close(out.info["clients"]["clip"], [1.0, 1.0, 0.5, 1.0, 1.0])


def test_flame_tells_models_near_the_global_model_apart_as_float64_does():
    """Models G + delta_i with ||G|| ~ 300 ||delta_i|| (one round's step), four of twelve sharing a
    direction: Algorithm 1's cosine distances of the models are about 1e-5, the float32 Gram of the models
    themselves resolved them to 5% and the admitted set differed from an exact float64 computation in 10
    of 20 draws. From the moments about G_{t-1} in float64 it agrees in all of them."""
    from fedtrust.aggregators.flame import majority_cluster

    g = torch.Generator().manual_seed(9)
    for _ in range(20):
        centre = torch.randn(1000, generator=g, dtype=torch.float64)
        delta = 0.003 * torch.randn(12, 1000, generator=g, dtype=torch.float64)
        delta[:4] = 0.003 * (torch.randn(1000, generator=g, dtype=torch.float64) + 0.3 * delta[:4] / 0.003)
        models = (centre + delta).float()
        exact = models.double() / models.double().norm(dim=1, keepdim=True)
        distances = (1 - exact @ exact.T).clamp(0, 2).fill_diagonal_(0)
        out = rule("flame", noise=0.0)(Round(updates=models, previous=centre.float()))
        assert torch.equal(out.weights > 0, majority_cluster(distances))


class _Server:
    """The server's benchmark for FLTrust and the loss defence, in the round's own terms: ``server`` its
    update g_0, ``origin`` what a row is measured from (the global model for a round of models, else 0)."""

    size = 5

    def __init__(self, server, origin):
        self.server, self.origin = server, origin

    def __call__(self, row):
        return float((row - self.origin - self.server).square().sum())

    def update(self):
        return self.server + self.origin


@pytest.mark.parametrize(
    "name, options",
    [("norm_bounding", {}), ("foolsgold", {}), ("centered_clipping", {}), ("fltrust", {}), ("arc+mean", {}),
     ("clipping+median", {}), ("fedag", {"base": "norm_bounding"}), ("fedag", {"base": "centered_clipping"})],
)  # fmt: skip
def test_a_round_of_models_is_read_as_their_updates_by_rules_that_measure_from_the_origin(name, options):
    """Given models (Round.previous, the global model), these clipped or compared the parameters as
    vectors: the step differed by up to 7.9 from the same round given as updates (a defences review),
    FLTrust compared updates with the server's model, FedAG's base clipped models (a diff review). Over
    three rounds (FoolsGold's history, centred clipping's centre) the models' round gives the updates'
    round's result plus the global model, and the same weights."""
    g = torch.Generator().manual_seed(3)
    models_rule, updates_rule = rule(name, **options), rule(name, **options)
    for _ in range(3):
        centre = 10 * torch.randn(30, generator=g, dtype=torch.float64)
        x = torch.randn(8, 30, generator=g, dtype=torch.float64)
        x[:2] *= 20  # two large updates for the clipping to bite on
        server = x[2:].mean(0)
        loss = {"train_loss": torch.rand(8, generator=g, dtype=torch.float64)}
        a = updates_rule(Round(updates=x, metrics=loss, reference=_Server(server, 0.0)))
        b = models_rule(
            Round(updates=x + centre, metrics=loss, reference=_Server(server, centre), previous=centre)
        )
        torch.testing.assert_close(b.vector, a.vector + centre)
        torch.testing.assert_close(b.weights, a.weights)


def test_flame_and_cfl_read_models_behind_a_stage_that_reads_updates():
    """clipping(c=1e9), which clips nothing, in front of FLAME took the round's models away from it (the
    front door handed the whole composition updates): its admitted set changed in 9 of 10 draws. The
    composition now hands its stages the updates and the rule the clipped models."""
    g = torch.Generator().manual_seed(4)
    for _ in range(10):
        centre = 3 * torch.randn(200, generator=g, dtype=torch.float64)
        delta = 0.3 * torch.randn(9, 200, generator=g, dtype=torch.float64)
        delta[:4] += 0.5 * torch.randn(200, generator=g, dtype=torch.float64)
        r = Round(updates=centre + delta, previous=centre)
        for name in ("flame", "cfl"):
            plain = rule(name, **({"noise": 0.0} if name == "flame" else {}))(r)
            staged = rule(
                name, pre=[{"name": "clipping", "c": 1e9}], **({"noise": 0.0} if name == "flame" else {})
            )(r)
            torch.testing.assert_close(staged.weights, plain.weights)
            torch.testing.assert_close(staged.vector, plain.vector)


def test_flame_adds_gaussian_noise_of_std_lambda_times_the_median_norm():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 20000, generator=g, dtype=F64) + 1
    quiet, noisy = rule("flame", noise=0)(Round(updates=x)), rule("flame", noise=0.01)(Round(updates=x))
    std = noisy.info["noise_std"]
    assert std == pytest.approx(0.01 * noisy.info["clip_bound"])
    residual = noisy.vector - quiet.vector
    assert float(residual.mean()) == pytest.approx(0.0, abs=5 * std / math.sqrt(x.shape[1]))
    assert float(residual.std()) == pytest.approx(std, rel=0.05)  # 20000 draws: sd of the sd 0.5%
    torch.testing.assert_close(noisy.weights, quiet.weights)
    again = rule("flame", noise=0.01)(Round(updates=x))
    torch.testing.assert_close(again.vector, noisy.vector, rtol=0, atol=0)  # seeded by (seed, round)
    with pytest.raises(ValueError, match=r"flame: noise must be <= 1.0, got 1e\+308"):
        rule("flame", noise=1e308)  # its aggregate was inf


def test_flame_admits_every_client_of_a_round_of_two():
    """Two clients have no majority to find (HDBSCAN's clusters need two members): both are admitted."""
    x = torch.tensor([[1.0, 0.0], [-3.0, 0.0]], dtype=F64)
    out = rule("flame", noise=0)(Round(updates=x))
    assert out.info["clip_bound"] == 2.0  # (-3, 0) clipped to (-2, 0)
    close(out.vector, [(1.0 - 2.0) / 2, 0.0])
    close(out.weights, [0.6, 0.4])  # coefficients (1, 2/3) / 2, normalised
    one = rule("flame", noise=0)(Round(updates=x[:1]))
    close(one.vector, x[0])


# ---------------------------------------------------------------- FoolsGold (Fung et al. 2020)

E = torch.eye(3, dtype=F64)


def test_foolsgold_gives_exact_sybil_copies_no_weight_and_distinct_clients_theirs():
    x = torch.stack([E[0], E[1], E[2], E[2]])  # two sybils send the same update
    out = rule("foolsgold")(Round(updates=x, client_ids=["h1", "h2", "s1", "s2"]))
    close(out.weights, [0.5, 0.5, 0.0, 0.0])
    close(out.vector, [0.5, 0.5, 0.0])
    close(out.info["clients"]["similarity"], [0.0, 0.0, 1.0, 1.0])


def test_foolsgold_logit_with_confidence_kappa():
    """cos(x1, x2) = 0.6, x3 orthogonal to both: alpha = 1 - max cs = (0.4, 0.4, 1), already max-normalised;
    the logit kappa (ln(0.4 / 0.6) + 0.5) = 0.0945 kappa, and 1 -> +inf -> clipped to 1."""
    x = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    for kappa in (1.0, 2.0):
        a = kappa * (math.log(0.4 / 0.6) + 0.5)
        out = rule("foolsgold", kappa=kappa)(Round(updates=x))
        close(out.info["clients"]["alpha"], [a, a, 1.0])
        close(out.weights, torch.tensor([a, a, 1.0], dtype=F64) / (2 * a + 1))


def test_foolsgold_pardons_an_honest_client_that_resembles_sybils():
    """x1 has cosine 0.6 with two sybil copies (v = 1): pardoning scales it by v_1 / v_sybil = 0.6 to 0.36,
    alpha_1 = 0.64, normalised by alpha_4 = 1 and through the logit: ln(0.64 / 0.36) + 0.5 > 1, full
    weight (without pardoning alpha_1 = 0.4 would give it 0.0945 of x4's)."""
    x = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.6, 0.8, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    out = rule("foolsgold")(Round(updates=x))
    close(out.info["clients"]["similarity"], [0.6, 1.0, 1.0, 0.0])
    close(out.weights, [0.5, 0.0, 0.0, 0.5])


def test_foolsgold_compares_histories_accumulated_across_rounds_and_keeps_them_in_its_state():
    """Round 2's updates of a and b are identical, but their histories (a: (1, 0.2), b: (-0.2, 1.2)) are
    not: the weights are FoolsGold's on the histories, applied to round 2's updates. A client absent from
    a round keeps its history."""
    ids = ["a", "b", "c"]
    one = torch.tensor([[1.0, 0.0], [-0.2, 1.0], [-1.0, -1.0]], dtype=F64)
    two = torch.tensor([[0.0, 0.2], [0.0, 0.2], [-1.0, -1.0]], dtype=F64)
    close(rule("foolsgold")(Round(updates=two)).weights[:2], [0.0, 0.0])  # round 2 alone: two copies
    fg = rule("foolsgold")
    fg(Round(updates=one, client_ids=ids))
    resumed = rule("foolsgold")
    resumed.load_state_dict(fg.state_dict())
    out = fg(Round(updates=two, client_ids=ids))
    on_histories = rule("foolsgold")(Round(updates=one + two, client_ids=ids))
    close(out.weights, on_histories.weights)
    close(out.weights, [1 / 3] * 3)  # cos(H_a, H_b) = 0.03, both against H_c negative: alpha ~ 1 each
    close(out.vector, out.weights @ two)
    close(resumed(Round(updates=two, client_ids=ids)).vector, out.vector)
    history = fg.state_dict()["history"]
    assert list(history) == ids
    close(history["a"], [1.0, 0.2])
    fg(Round(updates=two[:2], client_ids=ids[:2]))
    close(fg.state_dict()["history"]["c"], one[2] + two[2])


def test_foolsgold_history_is_the_sum_of_each_clients_updates_over_the_rounds_it_reported_in():
    """Clients join, skip rounds, come back in another order, arrive in a round of new clients only, after
    a checkpoint, and in a float32 round between float64 ones: each client's history (kept as a row of one
    matrix) is its own updates summed in the order of its rounds, whatever the others did; a float32 round
    rounds nobody's history but its own clients' updates, and 60 clients met a few at a time are all
    kept."""
    g = torch.Generator().manual_seed(5)
    fg, sums = rule("foolsgold"), {}
    rounds = [["a", "b"], ["c", "a"], ["x", "y", "z"], ["d", "b", "c"], ["b"], "checkpoint", ["u", "v"],
              ["e", "d", "a", "c", "b"], ("float32", ["a", "e"]), ["a", "b", "x", "d"]]  # fmt: skip
    rounds += [[f"s{i}", f"s{i + 1}", "a"] for i in range(0, 60, 2)]
    for present in rounds:
        if present == "checkpoint":
            fg, state = rule("foolsgold"), fg.state_dict()
            fg.load_state_dict(state)
            continue
        dtype, present = present if isinstance(present, tuple) else ("float64", present)
        x = torch.randn(len(present), 4, generator=g, dtype=F64).to(getattr(torch, dtype))
        fg(Round(updates=x, client_ids=present))
        for cid, update in zip(present, x, strict=True):
            sums[cid] = (sums[cid].to(x.dtype) + update).double() if cid in sums else update.double()
        history = fg.state_dict()["history"]
        assert sorted(history) == sorted(sums)
        for cid, total in sums.items():
            torch.testing.assert_close(history[cid], total, rtol=0, atol=0)


def test_foolsgolds_similarities_over_several_column_blocks_are_the_float64_cosines_to_float32_rounding(
    monkeypatch,
):
    """The histories' Gram matrix is taken by column blocks (16 MiB on the CPU, shrunk here to 64 columns
    of 10 rows): the cosines are those of one float64 pass to float32's rounding."""
    from fedtrust.aggregators import chunks
    from fedtrust.aggregators.foolsgold import cosine_similarities

    monkeypatch.setitem(chunks.BUDGETS, "stream", 64 * 10 * 4)
    x = torch.randn(10, 1000, generator=torch.Generator().manual_seed(2))
    x[3] = x[7] * 2 + 0.01 * x[3]
    unit = x.double() / x.double().norm(dim=1, keepdim=True)
    torch.testing.assert_close(cosine_similarities(x), unit @ unit.T, rtol=0, atol=1e-6)


def test_foolsgold_returns_the_mean_when_every_client_has_a_copy():
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [-3.0, 1.0], [-3.0, 1.0]], dtype=F64)
    out = rule("foolsgold")(Round(updates=x))
    close(out.weights, [0.25] * 4)
    close(out.vector, x.mean(0))
    assert out.info["degenerate"].startswith("every alpha is 0")


def test_foolsgold_refuses_a_history_of_another_length():
    fg = rule("foolsgold")
    fg.load_state_dict({"history": {0: torch.ones(3)}})
    with pytest.raises(ValueError, match=r"foolsgold: the stored history of client 0 has d=3"):
        fg(Round(updates=torch.ones(2, 4)))


def test_foolsgold_cosines_survive_histories_whose_float32_squares_overflow_or_underflow():
    """Updates of norm 1.5e19 (their squares fit in float32) add up to histories whose squares do not;
    updates of norm 1e-25 have squares below float32's subnormals. Either way the weights are those of
    the same directions at norm 1 (:func:`test_foolsgold_logit_with_confidence_kappa`)."""
    x = torch.tensor([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.0, 0.0, 1.0]])
    a = math.log(0.4 / 0.6) + 0.5
    want = torch.tensor([a, a, 1.0]) / (2 * a + 1)
    for scale, rounds in ((1.5e19, 2), (1e-25, 1)):
        fg = rule("foolsgold")
        for _ in range(rounds):
            out = fg(Round(updates=x * scale))
        torch.testing.assert_close(out.weights, want, rtol=1e-5, atol=1e-6)


def test_foolsgold_refuses_a_stored_history_that_does_not_fit_the_rounds_dtype():
    fg = rule("foolsgold")
    fg.load_state_dict({"history": {0: torch.full((3,), 1e300, dtype=F64)}})
    before = fg.state_dict()
    with pytest.raises(
        ValueError, match=r"foolsgold: the history of client 0 .* does not fit in torch.float32"
    ):
        fg(Round(updates=torch.ones(2, 3)))
    torch.testing.assert_close(fg.state_dict(), before, rtol=0, atol=0)
