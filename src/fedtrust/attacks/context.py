"""What an attack sees each round, and the one check on what it sends.

An attack is a callable ``attack(ctx) -> (n_bad, d)`` tensor: the vectors the corrupted clients send in
place of their honest updates, in the same space (deltas from the global model, or gradients). The
:class:`AttackContext` carries this round's honest updates of every sampled client, which clients are
corrupted, the global vector and a random generator; under the simulator also the round number and an
``aggregate`` oracle (the server's rule, a throwaway copy of it, applied to a full matrix of sent
updates), for attacks that know the rule and optimise against it (Fang et al.'s threat model, ByzFL's
optimal ALIE / IPM).

What the attacker knows is an attack's ``knowledge`` option (Fang et al. 2020, Section 3):

- ``"omniscient"``: the benign clients' updates this round (IPM, min-max and min-sum assume it; the
  default of every attack that takes the option);
- ``"partial"``: only the corrupted clients' own honest updates, which they compute by training on their
  own data (so the simulator trains them; ALIE's paper assumes this):
  :meth:`AttackContext.known` returns what the option allows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedtrust._checks import check_choice
from fedtrust.aggregators.chunks import column_blocks
from fedtrust.aggregators.passes import row_norms, weighted_sum

__all__ = ["KNOWLEDGE", "AttackContext", "Knowing", "sent_by"]

#: What an attacker can see (Fang et al. 2020, Section 3: full and partial knowledge).
KNOWLEDGE = ("omniscient", "partial")


@dataclass(frozen=True)
class AttackContext:
    """What an attack sees. Attacks that never read their own honest update set ``uses_own_update =
    False`` so the simulator can skip the corrupted clients' local training.

    aggregate: the server's rule on an (n, d) matrix of sent updates (rows in ``updates``' order) ->
    the aggregate vector; it raises :class:`~fedtrust.aggregators.core.RoundRefused` when the rule
    refuses. None where the rule is not known (a lone real client).
    """

    updates: torch.Tensor  # (n, d) what every sampled client computed honestly
    bad: torch.Tensor  # (n,) bool: the corrupted ones
    global_vector: torch.Tensor  # (d,) the global parameters the clients started from
    mode: str  # "params": updates are deltas (new params - global); "gradient": updates are gradients
    generator: torch.Generator
    round: int = 0
    aggregate: Callable[[torch.Tensor], torch.Tensor] | None = None
    server_lr: float = 1.0  # the server's step on the aggregate (model replacement's eta)

    def __post_init__(self):
        x, bad = self.updates, self.bad
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
            got = f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise TypeError(f"AttackContext.updates must be an (n, d) float tensor, got {got}")
        if not isinstance(bad, torch.Tensor) or bad.dtype != torch.bool or bad.shape != (len(x),):
            got = (
                f"{bad.dtype} of shape {tuple(bad.shape)}"
                if isinstance(bad, torch.Tensor)
                else type(bad).__name__
            )
            raise TypeError(
                f"AttackContext.bad must be an ({len(x)},) bool tensor (True: corrupted), got {got}"
            )
        # the attacks index the updates with the mask and combine them with the global vector: both where
        # the updates are (a mask left on the host made every indexing attack fail on a GPU)
        for name in ("bad", "global_vector"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.device != x.device:
                object.__setattr__(self, name, value.to(x.device))

    @property
    def benign(self) -> torch.Tensor:
        return self.updates[~self.bad]

    @property
    def own(self) -> torch.Tensor:
        return self.updates[self.bad]

    @property
    def num_bad(self) -> int:
        return int(self.bad.sum())

    def draw(
        self, shape: tuple[int, ...], uniform: bool = False, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Standard normal (or, ``uniform``, U[0, 1)) numbers in ``dtype`` (default: the updates') from
        the attack's generator, drawn where the generator lives and moved to the updates' device: the
        same draws on every device."""
        sample = torch.rand if uniform else torch.randn
        dtype = dtype or self.updates.dtype
        x = sample(shape, generator=self.generator, dtype=dtype, device=self.generator.device)
        return x.to(self.updates.device)

    def rows(self, knowledge: str) -> torch.Tensor:
        """Positions of the honest updates an attacker with this ``knowledge`` sees: the benign clients'
        (or, in a round without any, every client's) when omniscient; its own clients' when partial.
        Updates that are not finite (local training that diverged, a broken device) tell the attacker
        nothing and are left out, unless every candidate is one: one NaN row would make every statistic
        NaN, the attack's vectors would be quarantined, and the table would credit the defence with an
        attack that never ran."""
        mask = self._candidates(knowledge)
        finite = mask & self._finite()
        return torch.nonzero(finite if bool(finite.any()) else mask).squeeze(1)

    def _candidates(self, knowledge: str) -> torch.Tensor:
        mask = self.bad if knowledge == "partial" else ~self.bad
        if knowledge != "partial" and not bool(mask.any()):
            mask = torch.ones_like(self.bad)
        return mask

    def _finite(self) -> torch.Tensor:
        """(n,) bool, on ``bad``'s device: the rows whose norm is finite (one read, once a round; an
        overflowing norm counts as not finite)."""
        if "_finite_rows" not in self.__dict__:
            self.__dict__["_finite_rows"] = torch.isfinite(row_norms(self.updates)).to(self.bad.device)
        return self.__dict__["_finite_rows"]

    def known(self, knowledge: str) -> torch.Tensor:
        """The honest updates an attacker with this ``knowledge`` sees (a copy of those rows)."""
        return self.updates.index_select(0, self.rows(knowledge))

    def _weighted(self, knowledge: str, checked: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(x, w, k): the known updates' mean is w @ x, over k of them. Unchecked: every candidate row,
        x the round's matrix and w zero outside them (no copy, no pass to check the rows). Checked: the
        finite ones (:meth:`rows`), x a copy of them (a zero weight on a NaN row can still give NaN)."""
        if not checked:
            mask = self._candidates(knowledge)
            k = int(mask.sum())
            w = torch.zeros(len(self.updates), dtype=self.updates.dtype, device=self.updates.device)
            w[mask.to(w.device)] = 1.0 / k
            return self.updates, w, k
        rows = self.rows(knowledge)
        x = self.updates.index_select(0, rows)
        return x, torch.full((len(rows),), 1.0 / len(rows), dtype=x.dtype, device=x.device), len(rows)

    def _statistics(self, knowledge: str, compute):
        """``compute(x, w, k)`` (a tuple of tensors) over the candidate rows unchecked, the common case at
        no extra pass; where a result is not finite, a row may not be, and it is computed again over the
        finite rows alone."""
        out = compute(*self._weighted(knowledge, checked=False))
        if all(bool(torch.isfinite(t.sum())) for t in out):  # a sum carries any NaN/inf (or overflows)
            return out
        return compute(*self._weighted(knowledge, checked=True))

    def mean(self, knowledge: str) -> torch.Tensor:
        """The coordinate-wise mean of the known updates: one matrix-vector product."""
        return self._statistics(knowledge, lambda x, w, k: (weighted_sum(x, w),))[0]

    def mean_std(self, knowledge: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The coordinate-wise mean and (unbiased) standard deviation of the known updates, in one read
        of the matrix: a weighted matrix-vector product, then the centred squares column block by column
        block (torch's own std over the client axis is several times slower on wide matrices). The
        standard deviation of a single update is 0."""
        return self._statistics(knowledge, _mean_std)

    def with_sent(self, sent: torch.Tensor, knowledge: str = "omniscient") -> torch.Tensor:
        """The (n, d) matrix the server receives when the corrupted clients send ``sent``, as an attacker
        with this ``knowledge`` pictures it: the benign rows are the true updates when omniscient, and
        with ``partial`` knowledge stand-ins drawn from N(mean, std^2) of its own clients' honest updates,
        coordinate by coordinate (the estimate Fang et al. 2020, Section 3, give such an attacker),
        drawn once a round. One buffer per knowledge, written afresh on each call (an attack's queries of
        the rule do not allocate a matrix each)."""
        buffers = self.__dict__.setdefault("_buffers", {})
        buffer = buffers.get(knowledge)
        if buffer is None:
            buffer = self.updates.clone()
            if knowledge == "partial":
                mean, std = self.mean_std("partial")
                good = ~self.bad
                buffer[good] = mean + std * self.draw((int(good.sum()), buffer.shape[1]))
            buffers[knowledge] = buffer
        buffer[self.bad] = sent.to(buffer.dtype)
        return buffer

    def deviation(self, sent: torch.Tensor, knowledge: str = "omniscient") -> float:
        """How far the server's aggregate moves from the benign clients' mean when the corrupted ones send
        ``sent``: the harm an attack that knows the rule maximises (0 when the rule refuses the round or
        its aggregate is not finite: the server would keep its model). An attacker with ``partial``
        knowledge has not seen the benign updates: it scores ``sent`` on a round whose benign rows are its
        own stand-ins (:meth:`with_sent`), against the mean of the updates it knows."""
        from fedtrust.aggregators.core import RoundRefused

        if self.aggregate is None:
            raise ValueError(
                "this attack optimises against the server's rule, but the context has no 'aggregate' "
                "oracle: run it in the simulator (or pass AttackContext(aggregate=...))"
            )
        try:
            out = self.aggregate(self.with_sent(sent, knowledge))
        except RoundRefused:
            return 0.0
        if not bool(torch.isfinite(out).all()):
            return 0.0
        targets = self.__dict__.setdefault("_targets", {})
        if knowledge not in targets:
            targets[knowledge] = self.mean(knowledge).to(torch.float64)
        return float((out.to(torch.float64) - targets[knowledge]).norm())


def _mean_std(x: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = weighted_sum(x, w)
    var = torch.zeros_like(mean)
    if k > 1:
        for cols in column_blocks(x, "stream"):
            centred = x[:, cols] - mean[cols]
            var[cols] = w @ centred.square_()
        var *= k / (k - 1)
    return mean, var.sqrt_()


class Knowing:
    """Base of the attacks with a ``knowledge`` option: a partial-knowledge attacker trains its own
    clients (``uses_own_update``) to see anything at all."""

    colluding = True  # the corrupted clients pool what they know: a lone real client cannot run it

    def __init__(self, knowledge: str = "omniscient"):
        self.knowledge = check_choice(f"attack {self.name}: knowledge", knowledge, KNOWLEDGE)

    name = "attack"

    @property
    def uses_own_update(self) -> bool:
        return self.knowledge == "partial"


def sent_by(attack, ctx: AttackContext) -> torch.Tensor:
    """``attack(ctx)`` checked: a floating (n_bad, d) tensor (empty, the attack not called, without
    corrupted clients), or a ValueError naming the attack and what it returned (a user's attack with the
    wrong shape fails here, not deep inside a rule). Non-finite values pass: they are a broken device's,
    and the rules' front door quarantines them."""
    name = getattr(attack, "name", None) or getattr(attack, "__name__", None) or type(attack).__name__
    want = (ctx.num_bad, ctx.updates.shape[1])
    if ctx.num_bad == 0:  # no one to send (a partial-knowledge attack would average its own none: 1 / 0)
        return ctx.updates.new_empty(want)
    out = attack(ctx)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"attack {name!r} must return a tensor of shape {want}, got {type(out).__name__}")
    if tuple(out.shape) != want:
        raise ValueError(
            f"attack {name!r} must return one update per corrupted client, shape {want}, "
            f"got {tuple(out.shape)}"
        )
    if not out.is_floating_point():
        raise TypeError(f"attack {name!r} must return floating-point updates, got dtype {out.dtype}")
    return out
