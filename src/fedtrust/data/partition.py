"""Partitioners: split a dataset's training rows over clients.

Each is a small class whose constructor validates its options and whose call
``(dataset, clients, generator) -> list of index tensors`` does the split. All but ``overlapping``
give every training row to exactly one client.
"""

from __future__ import annotations

import numpy as np
import torch

from fedtrust._checks import check_float, check_int, share_count
from fedtrust.data.datasets import Dataset
from fedtrust.registry import build


def _labels(dataset: Dataset, who: str) -> torch.Tensor:
    if dataset.num_classes is None:
        raise ValueError(f"partition {who!r} splits by label; {dataset.name} is a regression set (use iid)")
    return dataset.y_train


def _check_clients(clients: int, rows: int) -> None:
    if clients > rows:
        raise ValueError(f"cannot give {clients} clients at least one of only {rows} training rows")


def _check_each(who: str, option: str, each: int, unit: str, clients: int, rows: int) -> None:
    """Refuse an option that gives each client ``each`` units of at least one row (``min_size`` rows,
    ``per_client`` shards) when the clients need more rows than there are, naming the option."""
    _check_clients(clients, rows)
    if clients * each > rows:
        raise ValueError(
            f"partition {who}: {clients} clients x {option}={each} {unit} each = {clients * each} {unit} "
            f"> {rows} training rows; lower {option} to at most {rows // clients}"
        )


class IID:
    """Uniformly shuffled, near-equal shares."""

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        _check_clients(clients, len(dataset))
        return list(torch.randperm(len(dataset), generator=g).tensor_split(clients))


class Dirichlet:
    """Label skew: each class's rows are spread over the clients in proportions p_k ~ Dirichlet_N(alpha)
    (Yurochkin et al. 2019; the "label distribution skew" of Li et al.'s NIID-Bench, 2022, the split
    most Byzantine-robustness studies use). Small alpha: each client sees few classes, and client sizes
    vary too. (Hsu, Qi, Brown 2019 instead draw each client's class mix from Dirichlet(alpha p) at equal
    sizes.) Draws again until every client holds at least ``min_size`` rows."""

    def __init__(self, alpha: float = 0.5, min_size: int = 1):
        self.alpha = check_float("partition dirichlet: alpha", alpha, minimum=0.0, strict_min=True)
        self.min_size = check_int("partition dirichlet: min_size", min_size, minimum=0)

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        y = _labels(dataset, "dirichlet")
        _check_each("dirichlet", "min_size", self.min_size, "rows", clients, len(y))
        concentration = torch.full((clients,), self.alpha, dtype=torch.float64)
        for _ in range(1000):
            parts: list[list[torch.Tensor]] = [[] for _ in range(clients)]
            for c in torch.unique(y).tolist():
                rows = torch.nonzero(y == c).flatten()
                rows = rows[torch.randperm(len(rows), generator=g)]
                p = _dirichlet(concentration, g)
                cuts = (torch.cumsum(p, 0)[:-1] * len(rows)).round().long().tolist()
                for k, piece in enumerate(torch.tensor_split(rows, cuts)):
                    parts[k].append(piece)
            out = [torch.cat(p) for p in parts]
            if min(len(p) for p in out) >= self.min_size:
                return out
        raise ValueError(
            f"partition dirichlet: no draw gave all {clients} clients >= {self.min_size} rows in 1000 tries "
            f"(alpha={self.alpha}); lower min_size or raise alpha"
        )


def _dirichlet(concentration: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A Dirichlet draw driven by ``g`` (so partitions are reproducible under a seed)."""
    rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=g)))
    p = rng.dirichlet(concentration.numpy())
    if not np.isfinite(p).all() or p.sum() <= 0:  # tiny alpha can underflow: all mass on one client
        p = np.zeros(len(p))
        p[rng.integers(len(p))] = 1.0
    return torch.as_tensor(p)


class Shards:
    """Pathological label skew of McMahan et al. 2017: sort rows by label, cut them into
    ``clients * per_client`` shards, give each client ``per_client`` random shards."""

    def __init__(self, per_client: int = 2):
        self.per_client = check_int("partition shards: per_client", per_client, minimum=1)

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        y = _labels(dataset, "shards")
        count = clients * self.per_client
        _check_each("shards", "per_client", self.per_client, "shards", clients, len(y))
        order = torch.argsort(y, stable=True)
        shards = order.tensor_split(count)
        pick = torch.randperm(count, generator=g).reshape(clients, self.per_client)
        return [torch.cat([shards[s] for s in row.tolist()]) for row in pick]


class QuantitySkew:
    """Clients hold different amounts of IID data: shares drawn from Dirichlet(alpha), at least
    ``min_size`` rows each (small alpha: a few clients hold most of the data)."""

    def __init__(self, alpha: float = 1.0, min_size: int = 1):
        self.alpha = check_float("partition quantity_skew: alpha", alpha, minimum=0.0, strict_min=True)
        self.min_size = check_int("partition quantity_skew: min_size", min_size, minimum=1)

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        n = len(dataset)
        _check_each("quantity_skew", "min_size", self.min_size, "rows", clients, n)
        p = _dirichlet(torch.full((clients,), self.alpha, dtype=torch.float64), g)
        extra = n - clients * self.min_size
        sizes = self.min_size + (p * extra).floor().long()
        sizes[torch.argmax(p)] += n - int(sizes.sum())
        return list(torch.randperm(n, generator=g).split(sizes.tolist()))


class Overlapping:
    """IID shares plus a common pool every client also holds: a fraction ``overlap`` of each client's
    rows is shared with all other clients (the overlapping local data of Nguyen et al., Proposition 2).
    The pool is the rounded count (half up) and the own shares differ by at most a row: ``overlap`` 0 is
    the ``iid`` split itself (the rows the floored own shares left over went to the pool: every client
    held the same n mod clients rows at 0, and 22% of them were shared at 0.2)."""

    def __init__(self, overlap: float = 0.2):
        self.overlap = check_float("partition overlapping: overlap", overlap, minimum=0.0, maximum=0.99)

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        n = len(dataset)
        # per client: s shared + o own rows, with s = overlap * (s + o) and s + clients * o = n
        shared = share_count(self.overlap / (clients * (1 - self.overlap) + self.overlap), n)
        _check_clients(clients, n - shared)
        order = torch.randperm(n, generator=g)
        pool, rest = order[:shared], order[shared:]
        return [torch.cat([pool, piece]) for piece in rest.tensor_split(clients)]


class Natural:
    """The dataset's own split by owner (LEAF users, synthetic parties). With fewer clients than
    owners, a random subset of owners; more clients than owners is an error."""

    def __call__(self, dataset: Dataset, clients: int, g: torch.Generator) -> list[torch.Tensor]:
        if dataset.groups is None:
            raise ValueError(
                f"partition natural: {dataset.name} has no natural split by owner; use iid or dirichlet"
            )
        owners = len(dataset.groups)
        if clients > owners:
            raise ValueError(
                f"partition natural: {dataset.name} has {owners} owners, fewer than {clients} clients"
            )
        if clients == owners:
            return list(dataset.groups)
        pick = torch.randperm(owners, generator=g)[:clients].sort().values
        return [dataset.groups[i] for i in pick.tolist()]


PARTITIONERS = {
    "iid": IID,
    "dirichlet": Dirichlet,
    "shards": Shards,
    "quantity_skew": QuantitySkew,
    "overlapping": Overlapping,
    "natural": Natural,
}


def partitioner(name: str, **options):
    """Build a partitioner by name, e.g. ``partitioner("dirichlet", alpha=0.5)``."""
    return build("partition", PARTITIONERS, name, options)
