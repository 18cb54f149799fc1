"""FLAME (Nguyen et al., USENIX Security 2022)."""

from __future__ import annotations

import numpy as np
import torch

from fedtrust._checks import check_float, check_seed
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused
from fedtrust.aggregators.distances import gram, moments_about
from fedtrust.aggregators.mean import normalised
from fedtrust.aggregators.norm_bounding import clip_factors, median_norm
from fedtrust.aggregators.passes import moved, weighted_sum
from fedtrust.aggregators.state import SeededCalls


def cosine_distances(g: torch.Tensor) -> torch.Tensor:
    """(n, n) float64 cosine distances 1 - cos(x_i, x_j) from the rows' Gram matrix, in [0, 2], exactly
    symmetric with a zero diagonal. A zero row is at distance 1 (orthogonal) from every other row."""
    norms = g.diagonal().clamp_min(0).sqrt()
    cos = g / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
    dist = (1 - (cos + cos.T) / 2).clamp(0, 2)
    dist.fill_diagonal_(0)
    return dist


def majority_cluster(dist: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the clients in the largest cluster HDBSCAN finds on the precomputed distances with
    min_cluster_size = n // 2 + 1, min_samples = 1 and a single cluster allowed (FLAME's clustering step):
    at most one cluster can hold more than half the clients, and points HDBSCAN labels noise are left
    out. Fewer than 3 clients: all of them (there is no majority to find among two, and HDBSCAN needs
    clusters of at least 2)."""
    # imported here: scikit-learn takes ~1.6 s to import, which every `import fedtrust` paid (each CLI
    # call, each Flower ClientApp process, one per message) whether or not it ran FLAME
    from sklearn.cluster import HDBSCAN

    n = dist.shape[0]
    if n < 3:
        return torch.ones(n, dtype=torch.bool, device=dist.device)
    clusterer = HDBSCAN(
        metric="precomputed", min_cluster_size=n // 2 + 1, min_samples=1, allow_single_cluster=True, copy=True
    )
    labels = clusterer.fit(dist.cpu().numpy()).labels_
    found = labels[labels >= 0]
    if found.size == 0:
        return torch.zeros(n, dtype=torch.bool, device=dist.device)
    largest = np.bincount(found).argmax()
    return torch.as_tensor(labels == largest, device=dist.device)


class FLAME(SeededCalls, BaseRule):
    """FLAME: cluster the updates by cosine distance and admit the majority cluster, clip the admitted ones
    to the median distance S_t from the previous model, average them, and add Gaussian noise of standard
    deviation lambda S_t (Nguyen et al., "FLAME: Taming Backdoors in Federated Learning", USENIX Security
    2022, Algorithm 1, whose steps are, in order):

        c_ij = 1 - cos(W_i, W_j)                          cosine distances of the n models
        b_1..b_L = the majority cluster of HDBSCAN on c    the L admitted models
        e_i = ||G_{t-1} - W_i||,  S_t = median(e_1..e_n)   the adaptive clipping bound, over all n
        W^c_l = G_{t-1} + (W_l - G_{t-1}) min(1, gamma),   gamma = S_t / e_l
        G_t = sum_l W^c_l / L
        G*_t = G_t + N(0, sigma^2),  sigma = lambda S_t    adaptive noise, per coordinate

    FLAME is written for models W_i. A round with ``previous`` (G_{t-1}) is read that way (as CFL reads
    it, but with Algorithm 1's cosines of the models, from their moments about G_{t-1} in float64),
    e_i their distances from ``previous``, the output a model. A round
    without it holds deltas x_i = W_i - G_{t-1} (the simulator and the Flower strategy send deltas): the
    clipping, averaging and noise are then the same up to the translation by G_{t-1} (e_i = ||x_i||, the
    output is G*_t - G_{t-1}), while the cosines are taken between the deltas, which is where the
    direction of a poisoned update shows (the models' cosines are all near 1, dominated by the shared
    G_{t-1}).

    noise: lambda, 0.001 by default (the paper's value for image classification), at most 1 (a noise
           std per coordinate as large as the whole clipping bound: beyond it the noise drowns any model,
           and 1e308 made the aggregate inf); 0 gives a deterministic rule.
    seed:  the noise of round t comes from a stream keyed by (seed, t)
           (:class:`~fedtrust.aggregators.state.SeededCalls`; ``state_dict`` holds t).

    HDBSCAN is scikit-learn's (``sklearn.cluster.HDBSCAN``). With fewer than 3 clients every client is
    admitted (see :func:`majority_cluster`); a round in which HDBSCAN finds no cluster (every client a
    noise point) is refused. Trust: the admitted clients' normalised coefficients min(1, S_t / e_l) / L
    (0 for the others); ``info["admitted"]`` lists them, ``info["clip_bound"]`` is S_t,
    ``info["noise_std"]`` lambda S_t, ``info["clients"]["clip"]`` each client's min(1, S_t / e_i).
    """

    name = "flame"
    paper = "Nguyen et al. 2022, FLAME: Taming Backdoors in Federated Learning (USENIX Security), Algorithm 1"

    def __init__(self, noise: float = 0.001, seed: int = 0):
        self.noise = check_float(f"{self.name}: noise", noise, minimum=0.0, maximum=1.0)
        self.seed = check_seed(f"{self.name}: seed", seed)

    def aggregate(self, round: Round) -> Aggregate:
        x, prev = round.updates, round.previous
        if prev is None:
            dist, e = cosine_distances(gram(x)), round.norms
        else:  # the models' inner products from their moments about G_{t-1}, in float64: W_i . W_j =
            # r_i . r_j + r_i . G + r_j . G + ||G||^2 (a float32 Gram of the models themselves, all near G,
            # left their cosine distances 5% off and changed the admitted set in 10 of 20 trials); the same
            # pass gives e_i = ||W_i - G_{t-1}||, r_i . r_i
            m = moments_about(x, prev)
            dist = cosine_distances(m.gram + m.cross[:, None] + m.cross[None, :] + m.centre_sq)
            e = m.gram.diagonal().clamp_min(0).sqrt()
        # the clustering and the arithmetic on n numbers run on the host (HDBSCAN's input is there anyway;
        # on a GPU every read of a device scalar is a sync): the distances and norms in one transfer
        dist, e = moved(torch.device("cpu"), dist, e)
        admitted = majority_cluster(dist)
        if not bool(admitted.any()):
            raise RoundRefused(f"{self.name}: HDBSCAN found no cluster among the {round.n} updates")
        bound = median_norm(e)
        clip = clip_factors(e, bound)
        coef = torch.where(admitted, clip, 0.0) / admitted.sum()
        vector = weighted_sum(x, coef)
        if prev is not None:  # G_{t-1} + sum_l coef_l (W_l - G_{t-1})
            vector += (1 - coef.sum()).to(x.dtype) * prev
        generator = self.round_generator("flame")
        std = self.noise * bound
        if std > 0:
            vector += (std * torch.randn(round.d, generator=generator, dtype=x.dtype)).to(x.device)
        weights = normalised(coef) if coef.sum() > 0 else admitted.to(torch.float64) / admitted.sum()
        weights, clip = moved(x.device, weights.to(x.dtype), clip)
        info = {
            "admitted": [round.client_ids[i] for i in torch.nonzero(admitted).flatten().tolist()],
            "clip_bound": bound,
            "noise_std": std,
            "clients": {"clip": clip},
        }
        return Aggregate(vector, weights, info)
