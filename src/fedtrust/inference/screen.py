"""The IVAR/ICOV noise estimates as a screen (``weighting="screen"``): find a minority of clients whose
noise stands apart from the rest, drop them, and give every other source one equal vote.

Why. The papers weight each source by its precision (Nguyen et al. eq 7: w_j proportional to
1/sigma_j^2). That ranks clients well (the robustness table's detection AUROC is near 1 under every
attack), but as weights it has two costs in a heterogeneous federation: honest clients with unusual data
get a fraction of an equal share, so the model learns less from them (IVAR-MLE loses 1-3 points of
accuracy to the mean on Dirichlet(0.5) shares with no attacker at all), and attackers whose noise is only
a few times the honest clients' keep a few percent each, which adaptive attacks (Fang et al.'s at 40%)
turn into 15 points of accuracy. The screen keeps the ranking and drops the weighting: a source is in or
out, and those in count equally, as in the mean.

How. The groups' log noise (one value per group of copies, so sybils count once here too) is fitted by a
one- and a two-component Gaussian mixture (scikit-learn's ``GaussianMixture``). The round is split only
when the two-component fit is better by at least ``BIC_MARGIN`` in BIC (6: "strong" evidence on Kass and
Raftery's scale, JASA 1995) and its higher-noise component holds fewer than half of the round's clients
(the honest-majority assumption every robust rule makes). Then the groups assigned to that component are
dropped; otherwise every group is kept. Kept groups get one vote each, split evenly among their members.
The estimator and its window state are untouched: the screen only changes how its estimates are used.
"""

from __future__ import annotations

import numpy as np
import torch

#: The two-component fit must lower BIC by at least this much to split the round.
BIC_MARGIN = 6.0
#: Fewer groups than this are never split (a two-component fit needs a few points per component).
MIN_GROUPS = 5


def noise_screen(noise: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Which groups to keep, from their noise variances ``noise`` (groups,) and member counts ``sizes``
    (groups,): a bool (groups,) tensor on the CPU, and what the screen found (``split``:
    whether it dropped any; ``bic_gain``: how much the two-component fit lowered BIC, None with fewer than
    ``MIN_GROUPS`` groups)."""
    keep = torch.ones(len(noise), dtype=torch.bool)
    if len(noise) < MIN_GROUPS:
        return keep, {"split": False, "bic_gain": None}
    from sklearn.mixture import GaussianMixture

    x = noise.detach().to("cpu", torch.float64).clamp_min(torch.finfo(torch.float64).tiny).log().numpy()
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
