"""FLTrust (Cao, Fang, Liu, Gong, NDSS 2021)."""

from __future__ import annotations

import torch

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import Aggregate, Round, RoundRefused
from fedtrust.aggregators.passes import row_norms, weighted_sum


class FLTrust(BaseRule):
    """FLTrust: trust bootstrapped from the server's own update g_0 on a small clean root dataset
    (Cao, Fang, Liu, Gong, "FLTrust: Byzantine-robust Federated Learning via Trust Bootstrapping",
    NDSS 2021, Algorithm 1 and its aggregation rule):

    - trust score TS_i = ReLU(cos(g_i, g_0)) (a client pointing away from the server's update gets none);
    - each update rescaled to the server update's norm, g_i * ||g_0|| / ||g_i|| (a boosted update gains
      nothing);
    - g = sum_i TS_i (||g_0|| / ||g_i||) g_i / sum_j TS_j.

    The root data is the server's benchmark split (``data.benchmark``), and g_0 comes from
    ``Round.reference.update()`` (:class:`~fedtrust.aggregators.info.Reference`): the simulator trains
    it once a round exactly as a client trains. Trust weights are the normalised trust scores
    TS_i / sum_j TS_j (each client's share of the output, before the rescaling); ``info["clients"]``
    has ``trust_score`` and ``cosine``. A zero update has no direction: TS 0. Where every trust score is
    0, or the server's update is zero, the paper's g is 0 / 0: the output is the zero update (the model
    stays where it is), the weights are uniform for want of any trust, and ``info["degenerate"]`` says
    why.

    Cosines come from one matrix-vector product with the unit server update and the float64 row norms,
    so d = 1e7 costs two reads of the matrix.
    """

    name = "fltrust"
    reads_deltas = True
    reads_reference = ("update",)
    paper = "Cao, Fang, Liu, Gong 2021, FLTrust: Byzantine-robust Federated Learning via Trust Bootstrapping"

    def aggregate(self, round: Round) -> Aggregate:
        g0, norm0 = self.server_update(round)
        x = round.updates
        if not norm0 > 0:
            return self.no_update(round, "the server's update on its root data is zero this round")
        tiny = torch.finfo(x.dtype).tiny
        unit = (g0 / norm0).to(x.dtype)
        # the products in one transfer, the norms as the front door's screen read them: the rule's
        # arithmetic on n numbers runs on the host (on a GPU it was 20 kernels and a sync)
        dots, norms = (x @ unit).cpu(), round.norms_on_host
        positive = norms > tiny
        cosine = torch.where(positive, dots.to(torch.float64) / norms.clamp_min(tiny), 0.0)
        cosine = cosine.clamp(-1.0, 1.0)
        trust = cosine.clamp_min(0.0)
        total = float(trust.sum())
        if not total > 0:
            return self.no_update(
                round, "no client's update points the way of the server's update (every trust score is 0)"
            )
        coef = torch.where(positive, trust * norm0 / norms.clamp_min(tiny), 0.0) / total
        info = {"clients": {"trust_score": trust.to(x.device), "cosine": cosine.to(x.device)}}
        return Aggregate(weighted_sum(x, coef), (trust / total).to(x.device, x.dtype), info)

    @staticmethod
    def no_update(round: Round, why: str) -> Aggregate:
        x = round.updates
        weights = torch.full((round.n,), 1.0 / round.n, dtype=x.dtype, device=x.device)
        return Aggregate(torch.zeros_like(x[0]), weights, {"degenerate": f"{why}: no update this round"})

    def server_update(self, round: Round) -> tuple[torch.Tensor, float]:
        """g_0 from ``round.reference.update()``, checked, and its norm (float64; both read in one
        transfer)."""
        update = getattr(round.reference, "update", None)
        if not callable(update):
            raise RoundRefused(
                "fltrust: needs the server's own update on its root data: a Round.reference with an "
                "update() method (in configs, set data.benchmark so the server keeps a clean split)"
            )
        g0 = torch.as_tensor(update(), device=round.updates.device).reshape(-1)
        norm, finite = 0.0, False
        if g0.numel() == round.d and g0.is_floating_point():
            read = torch.stack([row_norms(g0[None])[0], torch.isfinite(g0).all().to(torch.float64)])
            norm, finite = read.tolist()
        if not finite:
            bad = (  # (read only on this failing path)
                f", {int((~torch.isfinite(g0)).sum())} of them NaN or Inf"
                if g0.numel() == round.d and g0.is_floating_point()
                else ""
            )
            raise RoundRefused(
                f"fltrust: the server's update must be {round.d} finite numbers, got "
                f"{g0.numel()} of dtype {g0.dtype}{bad}"
            )
        return g0, norm
