"""A simulated federation: who holds which data, who is corrupted, what the server holds."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch

from fedtrust._checks import share_count
from fedtrust.data.corruptions import corrupt
from fedtrust.data.datasets import Dataset
from fedtrust.seeding import stream


@dataclass
class Federation:
    """Local data per client (already corrupted where the client is), the hidden corrupted flags, and
    the server's small trusted benchmark split (if any). The flags are for scoring only: rules never see
    them."""

    dataset: Dataset
    ids: list[str]
    data: list[tuple[torch.Tensor, torch.Tensor]]
    corrupted: torch.Tensor
    benchmark: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.ids)

    def sizes(self) -> list[int]:
        return [len(y) for _, y in self.data]

    def to(self, device: torch.device) -> Federation:
        """The same federation with every client's data, the benchmark and the dataset's tensors on
        ``device`` (the corrupted flags, bookkeeping, stay on the CPU; tensors already there are not
        copied)."""
        move = {f: getattr(self.dataset, f).to(device) for f in ("x_train", "y_train", "x_test", "y_test")}
        return replace(
            self,
            dataset=replace(self.dataset, **move),
            data=[(x.to(device), y.to(device)) for x, y in self.data],
            benchmark=None if self.benchmark is None else tuple(t.to(device) for t in self.benchmark),
        )


def benchmark_rows(size: int | float, n: int) -> int:
    """How many of ``n`` training rows ``data.benchmark`` (rows, an int, or a share, a float < 1) keeps for
    the server; 0 without a benchmark. A share so small that it rounds to no row, or rows that leave no
    training data, are refused (a rule that reads the benchmark would refuse every round)."""
    count = share_count(size, n) if isinstance(size, float) else int(size)
    if size > 0 and count <= 0:
        raise ValueError(f"data.benchmark: a share of {size!r} of the {n} training rows is no row; ask for "
                         "at least one (an int counts rows)")  # fmt: skip
    if count >= n:
        raise ValueError(f"data.benchmark: {count} rows would leave no training data (of {n})")
    return max(count, 0)


def hold_out_benchmark(dataset: Dataset, size: int | float, g: torch.Generator):
    """Carve the server's benchmark rows out of the training set (stratified by class where there are
    classes). Returns the remaining dataset (natural groups re-indexed) and the benchmark (x, y)."""
    n = len(dataset)
    count = benchmark_rows(size, n)
    if count == 0:
        return dataset, None
    if dataset.num_classes is None:
        rows = torch.randperm(n, generator=g)[:count]
    else:  # proportional per class
        y = dataset.y_train
        order = torch.randperm(n, generator=g)
        ranked = order[torch.argsort(y[order], stable=True)]
        rows = ranked[torch.linspace(0, n - 1, count).round().long()]
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    new_index = torch.cumsum(keep.long(), 0) - 1
    groups = None
    if dataset.groups is not None:
        groups = tuple(new_index[grp[keep[grp]]] for grp in dataset.groups)
    rest = replace(dataset, x_train=dataset.x_train[keep], y_train=dataset.y_train[keep], groups=groups)
    return rest, (dataset.x_train[rows], dataset.y_train[rows])


def build_federation(
    dataset: Dataset,
    clients: int,
    partition,
    seed: int,
    corruption=None,
    corrupted_fraction: float = 0.0,
    corrupted_samples: float = 1.0,
    benchmark: int | float = 0,
    added: int = 0,
) -> Federation:
    """Partition ``dataset`` over ``clients``, pick ``corrupted_fraction`` of them at random and apply the
    data ``corruption`` (if any) to ``corrupted_samples`` of each one's rows. ``added`` more clients,
    all corrupted, join on top: each holds a copy of a random original client's data (so the original
    clients keep their shares however many adversaries join, as in "5 genuine parties + R adversaries")."""
    dataset, bench = hold_out_benchmark(dataset, benchmark, stream(seed, "benchmark"))
    parts = partition(dataset, clients, stream(seed, "partition"))
    empty = [k for k, rows in enumerate(parts) if len(rows) == 0]
    if empty:
        warnings.warn(
            f"data.partition: {len(empty)} of {clients} clients hold no training rows (positions "
            f"{', '.join(map(str, empty[:10]))}{' ...' if len(empty) > 10 else ''}): each sends a zero "
            "update and a NaN training loss every round",
            stacklevel=2,
        )
    n_bad = share_count(corrupted_fraction, clients)
    bad = torch.zeros(clients, dtype=torch.bool)
    bad[torch.randperm(clients, generator=stream(seed, "corrupted"))[:n_bad]] = True
    data = []
    for k, rows in enumerate(parts):
        x, y = dataset.x_train[rows], dataset.y_train[rows]
        if bad[k] and corruption is not None:
            x, y = corrupt(corruption, x, y, dataset.num_classes, corrupted_samples,
                           stream(seed, "corrupt", k), client=int(bad[:k].sum()))  # fmt: skip
        data.append((x, y))
    for a in range(added):
        source = int(torch.randint(clients, (1,), generator=stream(seed, "added", a)))
        x, y = dataset.x_train[parts[source]], dataset.y_train[parts[source]]
        if corruption is not None:
            x, y = corrupt(corruption, x, y, dataset.num_classes, corrupted_samples,
                           stream(seed, "corrupt", clients + a), client=n_bad + a)  # fmt: skip
        data.append((x, y))
    bad = torch.cat([bad, torch.ones(added, dtype=torch.bool)])
    total = clients + added
    width = len(str(total - 1))
    ids = [f"client-{k:0{width}d}" for k in range(total)]
    return Federation(dataset, ids, data, bad, bench)
