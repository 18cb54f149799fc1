"""Many clients' local training as one batched computation (torch.func.vmap over per-client parameters).

The per-client loop in :mod:`fedtrust.sim.training` is the reference: every client draws its
mini-batches from its own generator in the same order, and here step s of all clients runs at once
(clients with fewer steps, and short last batches, are masked). The results agree with the loop up to
floating-point summation order. Models with running statistics (batch norm) cannot train here: a
vmapped forward cannot update each client's statistics in place; they train in the loop.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import grad, vmap

from fedtrust.models import FlatModel
from fedtrust.sim.training import batches


class Stacked:
    """Clients' data concatenated once (a simulation builds it at the start, not every round), with each
    client's offset; :meth:`select` picks a round's clients without copying their rows."""

    def __init__(self, data: list[tuple[torch.Tensor, torch.Tensor]]):
        self.x = torch.cat([x for x, _ in data])
        self.y = torch.cat([y for _, y in data])
        self.sizes = torch.tensor([len(y) for _, y in data])
        self.offsets = torch.cumsum(self.sizes, 0) - self.sizes

    @staticmethod
    def of(data) -> Stacked:
        return data if isinstance(data, Stacked) else Stacked(data)

    def select(self, clients: list[int]) -> Stacked:
        out = object.__new__(Stacked)
        out.x, out.y = self.x, self.y
        index = torch.as_tensor(clients, dtype=torch.long)
        out.sizes, out.offsets = self.sizes[index], self.offsets[index]
        return out

    def __len__(self) -> int:
        return len(self.sizes)

    def rows(self) -> torch.Tensor | slice:
        """The selected clients' rows of x and y, in client order (a slice when that is all of them)."""
        if len(self.sizes) and int(self.sizes.sum()) == len(self.y) and bool((self.offsets.diff() > 0).all()):
            return slice(None)
        return torch.cat(
            [torch.arange(o, o + s) for o, s in zip(self.offsets.tolist(), self.sizes.tolist(), strict=True)]
        )


def _step_plan(stacked: Stacked, steps: list[list[torch.Tensor]], batch_size: int):
    """(m, S, B) global row indices and a (m, S, B) float mask of the real entries (numpy scatter: one
    assignment for every step of every client). B is ``batch_size``, or the longest batch when none is
    that long: a batch_size above every client's rows trains on whole shares, and the buffers sized by it
    held 1.3 GB at 300000 and asked 154 GB at 1e8."""
    m, s = len(steps), max((len(st) for st in steps), default=0)
    batch_size = min(batch_size, max((len(rows) for st in steps for rows in st), default=1))
    index = np.zeros((m, s, batch_size), dtype=np.int64)
    mask = np.zeros((m, s, batch_size), dtype=np.float32)
    flat = [rows for client_steps in steps for rows in client_steps]
    if flat:
        lengths = np.fromiter((len(r) for r in flat), np.int64, len(flat))
        client = np.repeat(np.arange(m), [len(st) for st in steps])
        step = np.concatenate([np.arange(len(st)) for st in steps])
        slot = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        at = (np.repeat(client, lengths), np.repeat(step, lengths), slot)
        index[at] = torch.cat(flat).numpy() + np.repeat(stacked.offsets.numpy()[client], lengths)
        mask[at] = 1.0
    return torch.from_numpy(index), torch.from_numpy(mask)


def _masked_loss(model: FlatModel):
    if model.num_buffers:
        raise ValueError(
            f"the batched executor cannot train {model.name}: it has running statistics (batch norm) that "
            "a vmapped forward cannot update; use the per-client loop (train.executor: loop)"
        )

    def loss(w, x, y, m):
        per_sample = model.loss(w, x, y, reduction="none", train=True)
        return (per_sample * m).sum() / m.sum().clamp_min(1.0)

    return loss


def batched_local_sgd(
    model: FlatModel,
    start: torch.Tensor,
    data: list[tuple[torch.Tensor, torch.Tensor]] | Stacked,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """(m, d): each client's vector after ``epochs`` of mini-batch SGD from ``start`` (as local_sgd).

    Clients train in groups (:func:`group_size`), one group after another (all of a group's steps at
    once). A group the device's memory cannot hold (:func:`out_of_memory`) is trained again in halves, in
    this call only: its steps are a function of ``start`` and its step plan alone, drawn before any group
    trains, so the updates are the same to float rounding (a batched kernel's sums may round otherwise
    at another width)."""
    stacked = Stacked.of(data)
    steps = [[rows for _ in range(epochs) for rows in batches(n, batch_size, g)]
             for n, g in zip(stacked.sizes.tolist(), generators, strict=True)]  # fmt: skip
    index, mask = (t.to(start.device) for t in _step_plan(stacked, steps, batch_size))
    clients = len(stacked)
    size = group_size(clients, model.size * start.element_size(), start.device)
    out = torch.empty(clients, model.size, dtype=start.dtype, device=start.device)
    lo = 0
    while lo < clients:
        part, fits = slice(lo, min(clients, lo + size)), True
        try:
            out[part] = _sgd_steps(model, start, stacked, index[part], mask[part], lr, weight_decay)
        except RuntimeError as exc:
            if not out_of_memory(exc) or part.stop - part.start == 1:
                raise
            fits = False  # (retried after the handler, which holds the failed group's tensors)
        if fits:
            lo = part.stop
        else:
            size = (part.stop - part.start + 1) // 2
    return out


#: Bytes of parameter copies trained at once on the CPU. Above it the per-step weights, gradients and
#: temporaries leave the cache and each fresh allocation is a new memory mapping (glibc maps blocks over
#: 32 MiB): Fashion-MNIST MLP (159K parameters, 100 clients) trains 2x faster in two groups of 50 than in one.
GROUP_BYTES = 1 << 25


#: How torch's allocators other than CUDA's say an allocation failed, in a plain RuntimeError (MPS; the
#: CPU's "DefaultCPUAllocator: can't allocate memory" or "not enough memory")
_NO_MEMORY = ("out of memory", "not enough memory", "can't allocate memory")


def out_of_memory(exc: BaseException) -> bool:
    """Whether an allocation failed: ``torch.OutOfMemoryError`` (CUDA, XPU), or a RuntimeError that says
    so (:data:`_NO_MEMORY`)."""
    return isinstance(exc, torch.OutOfMemoryError) or any(words in str(exc) for words in _NO_MEMORY)


def group_size(clients: int, model_bytes: int, device: torch.device) -> int:
    """How many clients train at once. On the CPU, as many as keep their parameter copies within
    ``GROUP_BYTES`` (in equal groups). On another device (a GPU) all of them: there a group is a set of
    kernels each as wide as the group, and splitting it only adds launches (a 100-client round of the
    Fashion-MNIST CNN, 215K parameters, would take 3 groups by the CPU's bound); :func:`batched_local_sgd`
    halves a group the device's memory cannot hold."""
    if device.type != "cpu":
        return max(1, clients)
    groups = max(1, -(-clients * model_bytes // GROUP_BYTES))
    return max(1, -(-clients // groups))


def _sgd_steps(model, start, stacked: Stacked, index, mask, lr: float, weight_decay: float) -> torch.Tensor:
    """Plain SGD for one group of clients along its step plan (index, mask: (m, S, B))."""
    m, _, batch_size = index.shape
    live = mask.sum(2) > 0  # (m, S): client k takes step s
    steps = int(live.any(0).nonzero().max()) + 1 if bool(live.any()) else 0
    w = start.detach().expand(m, -1).clone()
    rates = -lr * live.to(w.dtype)  # (m, S): clients out of batches stay put
    step_grad = vmap(grad(_masked_loss(model)))
    # every step's mini-batches are gathered into the same buffers (index_select with out=: half the time
    # of fancy indexing into a fresh tensor)
    xb = torch.empty(m * batch_size, *stacked.x.shape[1:], dtype=stacked.x.dtype, device=stacked.x.device)
    yb = torch.empty(m * batch_size, dtype=stacked.y.dtype, device=stacked.y.device)
    for s in range(steps):
        rows = index[:, s].reshape(-1)
        torch.index_select(stacked.x, 0, rows, out=xb)
        torch.index_select(stacked.y, 0, rows, out=yb)
        g = step_grad(w, xb.view(m, batch_size, *xb.shape[1:]), yb.view(m, batch_size),
                      mask[:, s].to(stacked.x.dtype))  # fmt: skip
        if weight_decay:
            g.add_(w, alpha=weight_decay)
        w.addcmul_(rates[:, s, None], g)  # in place, one pass: w holds m copies of the model
    return w


def batched_minibatch_gradients(
    model: FlatModel,
    at: torch.Tensor,
    data: list[tuple[torch.Tensor, torch.Tensor]] | Stacked,
    batch_size: int,
    generators: list[torch.Generator],
) -> torch.Tensor:
    """(m, d): each client's gradient on one random mini-batch at ``at`` (as minibatch_gradient)."""
    stacked = Stacked.of(data)
    steps = [
        [torch.randperm(n, generator=g)[:batch_size]]
        for n, g in zip(stacked.sizes.tolist(), generators, strict=True)
    ]
    index, mask = (t.to(at.device) for t in _step_plan(stacked, steps, batch_size))
    rows, m = index[:, 0], mask[:, 0]
    w = at.detach().expand(len(stacked), -1)
    return vmap(grad(_masked_loss(model)))(w, stacked.x[rows], stacked.y[rows], m.to(stacked.x.dtype))


@torch.no_grad()
def mean_losses(
    model: FlatModel, at: torch.Tensor, data: list[tuple[torch.Tensor, torch.Tensor]] | Stacked
) -> torch.Tensor:
    """(m,): the mean loss of ``at`` on each client's data, from one pass over all of it."""
    stacked = Stacked.of(data)
    rows = stacked.rows()
    x, y = stacked.x[rows], stacked.y[rows]
    pieces = zip(x.split(8192), y.split(8192), strict=True)
    per_sample = torch.cat([model.loss(at, xb, yb, reduction="none") for xb, yb in pieces])
    sizes = stacked.sizes.to(per_sample.device)
    if per_sample.device.type == "cpu":
        owner = torch.repeat_interleave(torch.arange(len(stacked)), sizes, output_size=len(per_sample))
        totals = torch.zeros(len(stacked), dtype=per_sample.dtype).index_add_(0, owner, per_sample)
    else:  # index_add_ adds with atomics there, in no fixed order: a scan and differences at the ends do
        ends = torch.cumsum(torch.cat([sizes.new_zeros(1), sizes]), 0)
        running = torch.cat([per_sample.new_zeros(1, dtype=torch.float64), per_sample.double().cumsum(0)])
        totals = (running[ends[1:]] - running[ends[:-1]]).to(per_sample.dtype)
    return totals / sizes.to(per_sample.dtype)  # NaN for a client without rows, as the loop's empty mean
