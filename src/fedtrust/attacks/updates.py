"""Update-level attacks: what corrupted clients send instead of their honest update.

An attack is a class whose constructor validates its options and whose call gets an
:class:`~fedtrust.attacks.context.AttackContext` (this round's honest updates of every sampled client,
which of them are corrupted, the global vector) and returns the (n_bad, d) vectors the corrupted clients
send. ALIE and IPM read the benign clients' updates by default (``knowledge="omniscient"``), as IPM's
paper assumes; with ``knowledge="partial"`` they estimate the same statistics from the corrupted clients'
own honest updates, which is ALIE's own setting (Baruch et al. 2019, Algorithm 3 takes the corrupted
workers' gradients) and Fang et al. 2020's partial knowledge. ALIE's omniscient default is the stronger
attacker most benchmarks run (ByzFL's, Karimireddy et al.'s). The attacks that search against the rule are in
:mod:`fedtrust.attacks.adaptive`.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

from fedtrust._checks import check_bool, check_choice, check_float, check_int
from fedtrust.aggregators.distances import gram
from fedtrust.attacks.context import AttackContext, Knowing

_FLOAT32_MAX = torch.finfo(torch.float32).max


class Gaussian:
    """Send a N(0, std^2) vector instead of the model (Nguyen et al.'s Gaussian adversary: in parameter
    mode the vector replaces the parameters, so the delta is noise - global; ``of="update"`` replaces
    the update itself)."""

    uses_own_update = False

    def __init__(self, std: float = 1.0, of: str = "params"):
        self.std = check_float("attack gaussian: std", std, minimum=0.0)
        self.of = check_choice("attack gaussian: of", of, ("params", "update"))

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        own = ctx.own
        noise = self.std * ctx.draw(own.shape)
        if self.of == "params" and ctx.mode == "params":
            return noise - ctx.global_vector
        return noise


class RandomUpdate:
    """A random local update: a random direction with the norm of the client's honest update, times
    ``scale``."""

    def __init__(self, scale: float = 1.0):
        self.scale = check_float("attack random_update: scale", scale, minimum=0.0)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        own = ctx.own
        direction = ctx.draw(own.shape)
        direction /= direction.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return self.scale * own.norm(dim=1, keepdim=True) * direction


class SignFlip:
    """Send -scale times the honest update."""

    def __init__(self, scale: float = 1.0):
        self.scale = check_float("attack sign_flip: scale", scale, minimum=0.0)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        return -self.scale * ctx.own


class Scaling:
    """Send factor times the honest update (model-replacement boosting)."""

    def __init__(self, factor: float = 10.0):
        self.factor = check_float("attack scaling: factor", factor)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        return self.factor * ctx.own


class ModelReplacement:
    """Model replacement (Bagdasaryan, Veit, Hua, Estrin, Shmatikov, "How To Backdoor Federated
    Learning", AISTATS 2020, eq 3): the attacker sends X~ = gamma (X - G) + G, its model trained on
    poisoned data boosted so that averaging with the others' updates lands the global model near X. In
    update space that is gamma times its honest-on-poisoned-data update, gamma = n / eta: n the clients in
    the round, eta the server's learning rate on the aggregate (``train.server_lr``); ``boost`` overrides
    gamma. Pair it with a backdoor data corruption (``corruption: {name: backdoor, attack: {name:
    model_replacement}}``).

    Eq 3 is one attacker's boost. When k corrupted clients each send it, the mean moves the global model
    k times as far as replacement needs (the default, as a single attacker's boost is usually applied
    per attacker). ``split=True`` shares the boost, gamma = n / (eta k): together the k attackers replace
    the model exactly, with k times smaller, stealthier updates.

    A Flower node sees neither n nor eta: there it needs ``boost``."""

    name = "model_replacement"

    def __init__(self, boost: float | None = None, split: bool = False):
        self.boost = None if boost is None else check_float("attack model_replacement: boost", boost)
        self.split = check_bool("attack model_replacement: split", split)

    @property
    def colluding(self) -> bool:
        """Without ``boost`` the attack reads the round's size: a lone node cannot run it."""
        return self.boost is None

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        gamma = self.boost if self.boost is not None else len(ctx.updates) / ctx.server_lr
        if self.split:
            gamma /= max(ctx.num_bad, 1)
        return gamma * ctx.own


class ALIE(Knowing):
    """ "A little is enough" (Baruch, Baruch, Goldberg 2019): every corrupted client sends
    mu - z * sigma, the coordinate-wise mean and standard deviation of the benign updates (omniscient, the
    default) or of the corrupted clients' own honest ones (``knowledge="partial"``, the paper's), with
    z = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - f (their eq. for z_max) unless ``z`` is given. With
    f >= n / 2 + 1 the formula has no finite z; the quantile is clipped to 1 - 1e-6 (z = 4.75)."""

    name = "alie"

    def __init__(self, z: float | None = None, knowledge: str = "omniscient"):
        super().__init__(knowledge)
        self.z = None if z is None else check_float("attack alie: z", z)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        n, f = len(ctx.bad), int(ctx.bad.sum())
        z = self.z
        if z is None:
            s = n // 2 + 1 - f
            z = NormalDist().inv_cdf(min(max((n - s) / n, 1e-6), 1 - 1e-6))
        mean, std = ctx.mean_std(self.knowledge)
        return (mean - z * std).expand(f, -1)


def camouflaged(ctx: AttackContext, sent: torch.Tensor, noise: float, knowledge: str) -> torch.Tensor:
    """``sent`` (num_bad, d) with independent N(0, (noise s_k)^2) added to each row and coordinate k, s the
    known honest updates' per-coordinate standard deviation: a sybil group's copies no longer copies to
    the rounding, for a defence that merges copies (``noise`` 0: ``sent`` itself, no draw)."""
    if noise == 0:
        return sent
    _, std = ctx.mean_std(knowledge)
    return sent + noise * std * ctx.draw(tuple(sent.shape))


class IPM(Knowing):
    """Inner-product manipulation (Xie, Koyejo, Gupta 2020): every corrupted client sends -epsilon times
    the benign clients' mean update. ``noise`` > 0: each adds its own independent noise of ``noise`` times
    the benign clients' per-coordinate standard deviation (:func:`camouflaged`), so the identical vectors
    are no longer exact copies (a sybil attacker's answer to a defence that merges copies)."""

    name = "ipm"

    def __init__(self, epsilon: float = 0.1, knowledge: str = "omniscient", noise: float = 0.0):
        super().__init__(knowledge)
        self.epsilon = check_float("attack ipm: epsilon", epsilon, minimum=0.0)
        self.noise = check_float("attack ipm: noise", noise, minimum=0.0)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        sent = (-self.epsilon * ctx.mean(self.knowledge)).expand(ctx.num_bad, -1)
        return camouflaged(ctx, sent, self.noise, self.knowledge)


class Mimic:
    """Mimic (Karimireddy, He, Jaggi, ICLR 2022, "Byzantine-robust learning on heterogeneous datasets via
    bucketing", section 3): every corrupted client sends a copy of one benign client's update. Nothing
    it sends is an outlier, yet the copied client's data is over-represented: under heterogeneous data
    the aggregate drifts towards that one client, and rules that read agreement as reliability see a
    tight cluster.

    ``target="variance"`` (the paper's choice) copies the benign client furthest along the benign
    updates' top principal direction z, i* = argmax_i |<z, x_i - mean>| (the paper fixes i* after a
    warm-up; here it is chosen afresh each round from that round's benign updates, from their centred
    Gram matrix: z's scores are the top eigenvector of G, so no d-sized SVD). An integer ``target`` k
    copies the k-th benign client of the round (modulo their number). Benign updates that are not finite
    (local training that diverged) are never copied. ``noise`` > 0: each copy gets its own independent
    noise of ``noise`` times the benign clients' per-coordinate standard deviation (:func:`camouflaged`)."""

    uses_own_update = False
    colluding = True

    def __init__(self, target: str | int = "variance", noise: float = 0.0):
        if isinstance(target, str):
            self.target = check_choice("attack mimic: target", target, ("variance",))
        else:
            self.target = check_int("attack mimic: target", target, minimum=0)
        self.noise = check_float("attack mimic: noise", noise, minimum=0.0)

    def choose(self, benign: torch.Tensor) -> int:
        """The position, among ``benign``, of the client to copy."""
        if self.target != "variance":
            return self.target % len(benign)
        g = gram(benign, "mean")
        if len(benign) < 2 or not bool(torch.isfinite(g).all()):  # no finite benign update to rank
            return 0
        _, vectors = torch.linalg.eigh(g)
        return int(vectors[:, -1].abs().argmax())  # the top eigenvector's entries are the scores / sqrt(l)

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        rows = ctx.rows("omniscient")  # finite ones: a client whose training diverged is no one to copy
        if self.target == "variance":
            pick = self.choose(ctx.updates.index_select(0, rows))
        else:
            pick = self.target % len(rows)
        sent = ctx.updates[int(rows[pick])].expand(ctx.num_bad, -1)
        return camouflaged(ctx, sent, self.noise, "omniscient")


class Crash:
    """A broken device: sends NaN (or ``value``, e.g. inf) in every coordinate. Rules quarantine it.
    ``value`` must be NaN, infinite or a float32 number (fedtrust's models, and so the updates, are
    float32): a finite value beyond float32's range has no float32 value to send, and is refused."""

    uses_own_update = False

    def __init__(self, value: float = float("nan")):
        if not isinstance(value, float | int) or isinstance(value, bool):
            raise TypeError(f"attack crash: value must be a number, got {value!r}")
        self.value = float(value)
        if math.isfinite(self.value) and abs(self.value) > _FLOAT32_MAX:
            raise ValueError(
                f"attack crash: value {value!r} overflows float32 (max {_FLOAT32_MAX:.2g}); use inf to send "
                "infinities"
            )

    def __call__(self, ctx: AttackContext) -> torch.Tensor:
        return torch.full_like(ctx.own, self.value)
