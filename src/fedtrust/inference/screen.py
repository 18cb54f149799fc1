"""The IVAR/ICOV fit as a screen (``weighting="screen"``): find a minority of clients whose updates stand
apart from the fitted consensus, drop them, and give every other source one equal vote.

Why. The papers weight each source by its precision (Nguyen et al. eq 6: w_j proportional to
1/sigma_j^2; eq 3 for ICOV). That ranks clients well (the robustness table's detection AUROC is near 1
under every attack), but as weights it has two costs in a heterogeneous federation: honest clients with
unusual data get a fraction of an equal share, so the model learns less from them (IVAR-MLE loses 1-3
points of accuracy to the mean on Dirichlet(0.5) shares with no attacker at all), and attackers whose
noise is only a few times the honest clients' keep a few percent each, which adaptive attacks (Fang et
al.'s at 40%) turn into 15 points of accuracy. The screen keeps the fit and drops the weighting: a source
is in or out, and those in count equally, as in the mean.

What it reads. Each group's observed spread about the estimator's consensus y of this round, the mean
over coordinates of (x_j - y)^2 (:func:`observed_spread`): what the noise variance sigma_j^2 estimates
(IVAR-MLE's estimate, eq 7 and Algorithm 1 line 3, is this spread pooled over the window). It is not the
model's variance Phi_jj: ICOV's Phi_jj = sigma_u^2 (||v_j||^2 + tr Psi_j) + sigma_j^2 (Algorithm 2) is a
prediction under the prior on the factors u, and where colluders need large factors, the honest clients'
predicted variance swells with them. Measured (Fashion-MNIST, ICOV-VB, boosted backdoor at 40%, seed 1,
round 28): the honest clients' log Phi_jj had median -1.8 and sd 2.3, overlapping the attackers' (from
1.7), while their observed spread was -7.2 +- 0.4 against the attackers' 2.0 and above. The fit of Phi_jj
was too unsure to split (BIC gain 4.8), the round went to the mean, and 20 updates boosted 50-fold took
the model (accuracy 0.80 -> 0.04). On the observed spread the same round splits with a gain of about 180.

How. The groups' log spread (one value per group of copies, so sybils count once here too) is fitted by
a one- and a two-component Gaussian mixture (scikit-learn's ``GaussianMixture``). The round is split only
when the two-component fit is better by at least ``BIC_MARGIN`` in BIC (6: "strong" evidence on Kass and
Raftery's scale, JASA 1995) and its higher-spread component holds fewer than half of the round's clients
(the honest-majority assumption every robust rule makes). Then the groups assigned to that component are
dropped; otherwise every group is kept. Kept groups get one vote each, split evenly among their members.
The estimator and its window state are untouched: the screen only changes how its fit is used.

A second look (:func:`drop_followers`), only once a group has been dropped: the dropped clients' mean
less the kept clients' mean is the direction the dropped ones pushed the model. A kept client far along
that same direction is one of them that the spread alone could not tell from the noisiest honest
clients, and is dropped too: its position along the direction is an outlier among the kept clients'
by the modified z-score (0.6745 (p_j - median) / MAD > 3.5; Iglewicz and Hoaglin 1993, "How to
Detect and Handle Outliers"), one-sided (only towards the dropped group). Measured (Fashion-MNIST,
IVAR-MLE, the split backdoor at 40%, seed 0): in 12 of 30 rounds one of the 20 attackers, boosted
2.5-fold, sat at the top of the honest clients' spread and kept its vote (accuracy 0.823 with 12% of
triggered images obeying the trigger); along the direction its modified z was 44-116, the honest
clients' at most 2.9. The honest-majority assumption holds here too: the second look never takes the
dropped clients to half of the round's.

A look before the spread (:func:`standing_apart`), for a coordinated group that the fit takes for its
best sources. Attackers who send one crafted vector, each with noise of its own added (the
``noisy_sybil_ipm`` column of the robustness table: IPM's vector plus 0.3 of the honest spread), are no
longer copies, and their tightness buys them precision: IVAR-MLE's consensus settles on them and the
honest clients look like the outliers (digits, 40%, seed 0: the attackers' log spread about the consensus
about -9.2, the honest clients' -6 to -5; the honest clients are the majority, so the spread dropped no
one and the model fell to 0.000). Such a group gives itself away twice. Its mean stands apart from the
other clients' mean: for two sides B and R of the groups, T = ||m_B - m_R||^2 / (v_B / k_B + v_R / k_R)
(m a side's mean update, v the unbiased mean squared deviation of its k members from it: the two-sample
statistic, about 1 when both sides scatter about one centre and the sides were chosen in advance). And it
agrees with itself: its members scatter about their mean far less than the other clients about theirs.
The block is read off the top eigenvector of the groups' correlation matrix about their mean (a
coordinated group is its largest common mode): the loadings are cut in two by exact one-dimensional
2-means, and the side whose members correlate more with each other is the candidate. T is judged
against the honest clients' own heterogeneity, since a split chosen from the data finds differences
between honest clients too, well above 1 on Dirichlet shares: the rest is split the same way,
and the block stands apart when its T is more than ``APART_RATIO`` times the rest's and its spread is
under ``TIGHTNESS`` times the rest's. Then it is dropped, if it holds fewer than half of the round's
clients, and the spread screen runs on the groups left, about their own mean. Measured on digits (the
screened rules, 3 seeds, 90 rounds a column): with no attack and with 20% or 40% of the clients absent
the ratio is at most 2.11 and the look never fires; the noisy sybils at 40% with noise 0.3 / 0.6 have
ratio median 6.4 / 5.2, spread 0.08-0.10 / 0.34-0.38 of the honest clients', and are dropped in 83 / 71-74
of 90 rounds. At noise 1.0 the copies scatter as honest clients do (0.94-1.07): the ordinary Byzantine
case, left to the spread. An honest minority population whose data differ from the rest's is as spread
as the rest and is kept (tests/test_screen.py); a minority that both stands apart and agrees with itself
is what a coordinated group looks like, and no statistic of the updates alone tells it from honest
clients that happen to be so.
"""

from __future__ import annotations

import numpy as np
import torch

from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.distances import gram as gram_about
from fedtrust.aggregators.passes import weighted_sum

#: The two-component fit must lower BIC by at least this much to split the round.
BIC_MARGIN = 6.0
#: Fewer groups than this are never split (a two-component fit needs a few points per component).
MIN_GROUPS = 5
#: A coordinated block is dropped when its two-sample statistic against the other groups exceeds the
#: other groups' own largest split's this many times (:func:`standing_apart`).
APART_RATIO = 4.0
#: ... and when its members scatter about their mean less than this fraction of the other groups' spread
#: about theirs: a group that agrees with itself, not a population of honest clients with data of its own.
TIGHTNESS = 0.5
#: The second look drops a kept group whose modified z-score along the dropped group's direction
#: exceeds this (Iglewicz and Hoaglin's outlier criterion).
FOLLOWER_Z = 3.5


def observed_spread(updates: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """(n,) each update's mean squared deviation from ``consensus`` over the d coordinates, in float64 on
    the updates' device (one read of the (n, d) matrix, block by block: no (n, d) temporary)."""
    total = torch.zeros(len(updates), dtype=torch.float64, device=updates.device)
    for cols in column_blocks(updates):
        total += (updates[:, cols] - consensus[cols]).square().sum(1, dtype=torch.float64)
    return total / max(1, updates.shape[1])


def sides(gram: torch.Tensor, side: torch.Tensor) -> tuple[float, float, float] | None:
    """For the rows ``side`` (B) and the rest (R), from their Gram matrix ``gram`` (k, k) about any common
    centre: the squared distance between the two sides' means, and each side's mean squared deviation
    from its mean (unbiased, v_B and v_R); None when a side has fewer than two rows."""
    rest = ~side
    kb, kr = int(side.sum()), int(rest.sum())
    if kb < 2 or kr < 2:
        return None
    ab, ar = side.to(gram) / kb, rest.to(gram) / kr
    diff = ab - ar
    vb = (gram.diagonal()[side].mean() - ab @ gram @ ab) * kb / (kb - 1)
    vr = (gram.diagonal()[rest].mean() - ar @ gram @ ar) * kr / (kr - 1)
    return float(diff @ gram @ diff), float(vb), float(vr)


def two_sample(gram: torch.Tensor, side: torch.Tensor) -> float | None:
    """T = ||m_B - m_R||^2 / (v_B / k_B + v_R / k_R) for the rows ``side`` against the rest (:func:`sides`;
    T does not depend on the Gram matrix's centre); None when a side has fewer than two rows or no
    spread."""
    found = sides(gram, side)
    if found is None:
        return None
    kb, kr = int(side.sum()), int((~side).sum())
    scale = found[1] / kb + found[2] / kr
    return found[0] / scale if scale > 0.0 else None


def coherent_side(gram: torch.Tensor) -> torch.Tensor:
    """The rows' (k,) largest common mode, as a bool mask: the top eigenvector of their correlation matrix
    about their own mean, its loadings cut in two by exact 1-D 2-means (the cut minimising the two sides'
    sums of squares), and of the two sides the one whose members correlate more with each other."""
    k = len(gram)
    centring = torch.eye(k, dtype=gram.dtype) - 1.0 / k
    g = centring @ gram @ centring
    # a variance below the largest one's rounding is none (two updates of 1e12 in opposite directions
    # left the others' centred variances at -910 and -1730 by cancellation; floored at the dtype's tiny,
    # their correlations were 1e300 and beyond, and eigh failed)
    diagonal = g.diagonal()
    floor = max(float(diagonal.max()) * torch.finfo(g.dtype).eps, torch.finfo(g.dtype).tiny)
    sd = diagonal.clamp_min(floor).sqrt()
    corr = g / (sd[:, None] * sd[None, :])
    loadings = torch.linalg.eigh(corr)[1][:, -1]
    order = torch.argsort(loadings)
    v = loadings[order]
    left = torch.arange(1, k, dtype=v.dtype)
    s1, s2 = v.cumsum(0)[:-1], (v * v).cumsum(0)[:-1]
    cost = (s2 - s1 * s1 / left) + ((v * v).sum() - s2) - (v.sum() - s1) ** 2 / (k - left)
    side = torch.zeros(k, dtype=torch.bool)
    side[order[int(torch.argmin(cost)) + 1 :]] = True

    def agreement(mask: torch.Tensor) -> float:
        m = int(mask.sum())
        return float((corr[mask][:, mask].sum() - m) / (m * (m - 1))) if m > 1 else -1.0

    return side if agreement(side) >= agreement(~side) else ~side


def standing_apart(gram: torch.Tensor | None, sizes: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """The look for a coordinated block (module docstring): from the groups' Gram matrix ``gram``
    (groups, groups; about any common centre; None: no look) and member counts ``sizes``, the block to
    drop as a bool (groups,) CPU tensor, or None; and what was found (``ratio``: the block's two-sample
    statistic over the rest's own largest split's; ``tightness``: the block's spread about its mean over
    the rest's; None where there are too few groups to tell; ``dropped``: how many groups)."""
    found: dict = {"ratio": None, "tightness": None, "dropped": 0}
    if gram is None or len(gram) < 2 * MIN_GROUPS or not bool(torch.isfinite(gram).all()):
        return None, found
    gram = gram.detach().to("cpu", torch.float64)
    members = sizes.detach().to("cpu", torch.float64)
    try:
        block = coherent_side(gram)
        rest = torch.nonzero(~block).flatten()
        t_block = two_sample(gram, block)
        if t_block is None or len(rest) < MIN_GROUPS:
            return None, found
        inner = gram[rest][:, rest]
        t_rest = two_sample(inner, coherent_side(inner))
    except torch.linalg.LinAlgError as exc:  # no common mode to read: no block, and why (the round goes on)
        return None, {**found, "unresolved": f"the correlations' eigenvectors did not converge ({exc})"}
    if t_rest is None:
        return None, found
    found["ratio"] = t_block / t_rest
    _, v_block, v_rest = sides(gram, block)
    found["tightness"] = v_block / max(v_rest, torch.finfo(gram.dtype).tiny)
    if (
        found["ratio"] <= APART_RATIO
        or found["tightness"] >= TIGHTNESS
        or float(members[block].sum()) * 2 >= float(members.sum())
    ):
        return None, found
    found["dropped"] = int(block.sum())
    return block, found


def spread_screen(spread: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Which groups to keep, from their spread about the consensus ``spread`` (groups,) and member
    counts ``sizes`` (groups,): a bool (groups,) tensor on the CPU, and what the screen found (``split``:
    whether it dropped any; ``bic_gain``: how much the two-component fit lowered BIC, None with fewer than
    ``MIN_GROUPS`` groups)."""
    keep = torch.ones(len(spread), dtype=torch.bool)
    if len(spread) < MIN_GROUPS:
        return keep, {"split": False, "bic_gain": None}
    from sklearn.mixture import GaussianMixture

    x = spread.detach().to("cpu", torch.float64).clamp_min(torch.finfo(torch.float64).tiny).log().numpy()
    x = x.reshape(-1, 1)
    if np.ptp(x) == 0.0:
        return keep, {"split": False, "bic_gain": 0.0}
    one = GaussianMixture(1, random_state=0).fit(x)
    two = GaussianMixture(2, n_init=3, random_state=0).fit(x)
    gain = float(one.bic(x) - two.bic(x))
    high = two.predict(x) == int(np.argmax(two.means_[:, 0]))
    members = sizes.detach().to("cpu", torch.float64).numpy()
    if gain < BIC_MARGIN or members[high].sum() * 2 >= members.sum():
        return keep, {"split": False, "bic_gain": gain}
    return torch.as_tensor(~high), {"split": True, "bic_gain": gain}


def drop_followers(
    updates: torch.Tensor, keep: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The second look: ``keep`` (groups,) less the kept groups far along the direction from the kept
    groups' mean to the dropped groups' mean (``updates``: one row per group), and how many it dropped.
    Nothing changes when no group was dropped, fewer than ``MIN_GROUPS`` are kept, the kept positions
    have no spread (MAD 0), or the followers would take the dropped clients to half of the round's."""
    kept = keep.to(updates.device)
    if bool(kept.all()) or int(kept.sum()) < MIN_GROUPS:
        return keep, 0
    # two reads of the matrix in its dtype (no float64 copy): both means at once, then the positions
    centre, dropped = weighted_sum(
        updates, torch.stack([m.to(updates.dtype) / m.sum() for m in (kept, ~kept)])
    )
    direction = dropped - centre
    length = direction.norm()
    if not bool(torch.isfinite(length)) or float(length) == 0.0:
        return keep, 0
    unit = direction / length
    position = (updates @ unit - centre @ unit).to("cpu", torch.float64)
    inside = position[keep]
    median = inside.median()
    mad = (inside - median).abs().median()
    if float(mad) == 0.0:
        return keep, 0
    followers = keep & (0.6745 * (position - median) / mad > FOLLOWER_Z)
    members = sizes.detach().to("cpu", torch.float64)
    if float(members[~keep | followers].sum()) * 2 >= float(members.sum()):
        return keep, 0
    return keep & ~followers, int(followers.sum())


def screen(
    updates: torch.Tensor, consensus: torch.Tensor, sizes: torch.Tensor, gram: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    """Which groups to keep (bool (groups,) on the CPU) and what each look found, from the groups' updates
    (one row each), the fit's ``consensus``, their member counts ``sizes`` and their Gram matrix ``gram``
    about any common centre (taken here, one pass, where none is given and the look can use it). A block
    :func:`standing_apart` is dropped first (``found["apart"]``); the spread (:func:`spread_screen` on
    :func:`observed_spread`) is then read about the other groups' mean, not the consensus, which the block
    may hold, and what it drops is dropped only while the two together stay under half the round's
    clients. Last the second look, :func:`drop_followers` (``found["followers"]``)."""
    if gram is None and len(updates) >= 2 * MIN_GROUPS:
        gram = gram_about(updates, "mean")
    block, apart = standing_apart(gram, sizes)
    if block is None:
        keep, found = spread_screen(observed_spread(updates, consensus), sizes)
    else:
        keep = ~block
        centre = weighted_sum(updates, keep.to(torch.float64) / keep.sum())
        inner, found = spread_screen(observed_spread(updates, centre)[keep], sizes[keep])
        if float(sizes[block].sum() + sizes[keep][~inner].sum()) * 2 < float(sizes.sum()):
            keep[torch.nonzero(keep).flatten()[~inner]] = False
    found["apart"] = apart
    keep, found["followers"] = drop_followers(updates, keep, sizes)
    return keep, found
