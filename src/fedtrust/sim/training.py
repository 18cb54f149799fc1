"""Local computation of one client: SGD epochs from a starting vector, or one mini-batch gradient.

This per-client loop is the reference; a batched executor must give the same results.
"""

from __future__ import annotations

import torch

from fedtrust.models import FlatModel


def batches(
    n: int, batch_size: int, g: torch.Generator, device: torch.device | None = None
) -> list[torch.Tensor]:
    """One epoch's mini-batches: a random permutation (drawn on the CPU, from ``g``) cut into batch_size
    pieces (the last may be short); none for a client without data. ``device``: where the pieces index,
    the permutation moved there once (on CUDA indexing with a CPU index is a copy each, which waits for the
    queued kernels)."""
    if n == 0:
        return []
    order = torch.randperm(n, generator=g)
    return list((order if device is None else order.to(device)).split(batch_size))


def local_sgd(
    model: FlatModel,
    start: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    g: torch.Generator,
) -> torch.Tensor:
    """Plain mini-batch SGD (optionally with L2 weight decay on the parameters) for ``epochs`` epochs, in
    train mode; returns the new point. A model's running statistics (batch norm) are not trained: each
    step's forward updates them from its batch and the new point carries them."""
    w = start.detach().clone()
    for _ in range(epochs):
        for rows in batches(len(y), batch_size, g, x.device):
            w.requires_grad_(True)
            loss, buffers = model.training_loss(w, x[rows], y[rows])
            (grad,) = torch.autograd.grad(loss, w)
            with torch.no_grad():
                if weight_decay:
                    grad = grad + weight_decay * model.parameters_only(w)
                w = model.with_buffers((w - lr * grad).detach(), buffers)
    return w


def minibatch_gradient(
    model: FlatModel,
    at: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    g: torch.Generator,
    step: float = 1.0,
) -> torch.Tensor:
    """The gradient of the mean loss on one random mini-batch at ``at`` (train mode).

    A model's running statistics (batch norm) have no gradient; their entries hold (old - new) / step,
    new being the statistics this batch leaves, so that the server's step ``at - step * gradient``
    moves them to the batch's (to the aggregate of the clients' statistics) as in params mode."""
    rows = torch.randperm(len(y), generator=g)[:batch_size]
    w = at.detach().clone().requires_grad_(True)
    loss, buffers = model.training_loss(w, x[rows], y[rows])
    (grad,) = torch.autograd.grad(loss, w)
    if buffers is None:
        return grad
    old = at.detach()[~model.param_mask.to(at.device)]
    return model.with_buffers(grad, (old - buffers.to(old.dtype)) / step)


@torch.no_grad()
def mean_loss(model: FlatModel, at: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean loss of ``at`` on (x, y), in eval mode (batch norm with the running statistics)."""
    return float(model.loss(at, x, y))
