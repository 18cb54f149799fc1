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
"""

from __future__ import annotations

import numpy as np
import torch

from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.passes import weighted_sum

#: The two-component fit must lower BIC by at least this much to split the round.
BIC_MARGIN = 6.0
#: Fewer groups than this are never split (a two-component fit needs a few points per component).
MIN_GROUPS = 5
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
