"""Defences against clients that misreport a loss (ARFL's and FOCUS's stated weakness).

A rule that trusts low reported losses can be gamed by a corrupted client reporting a tiny one. Two
server-side checks, shared by the rules that read reported losses:

- ``clip``: floor every report at median - 3 MAD of the round's reports (a robust lower bound: a
  lie can at best look like a typical good client);
- ``benchmark``: floor a client's report at the loss its own update reaches on the server's trusted
  split (``Round.reference``), a quantity the client cannot fake.
"""

from __future__ import annotations

import torch

from fedtrust.aggregators.core import Round

DEFENCES = ("none", "clip", "benchmark")


def robust_floor(values: torch.Tensor, spread: float = 3.0) -> torch.Tensor:
    """values floored at median - spread * MAD (MAD scaled to a normal sd)."""
    median = values.median()
    mad = 1.4826 * (values - median).abs().median()
    return values.clamp_min(float(median - spread * mad))


def reference_losses(round: Round) -> torch.Tensor:
    """Each client's update scored on the server's trusted split (float64, on the host). The reference
    may give each loss as a number or as a one-element tensor on any device
    (:class:`~fedtrust.aggregators.info.Reference`): the tensors are read together, in one transfer (on a
    GPU a read each was a sync a client: 100 of FOCUS's 102 at 100 clients)."""
    if round.reference is None:
        raise ValueError("this defence needs Round.reference: a trusted benchmark split on the server")
    losses = [round.reference(u) for u in round.updates]
    out = torch.empty(len(losses), dtype=torch.float64)
    tensors = []
    for i, loss in enumerate(losses):
        if not isinstance(loss, torch.Tensor):
            out[i] = float(loss)
        elif loss.numel() != 1 or loss.is_complex():
            raise ValueError(
                f"Round.reference returned a {loss.dtype} tensor of shape {tuple(loss.shape)} for client "
                f"{round.client_ids[i]!r}; it must return one real loss (a number or a one-element tensor)"
            )
        else:
            tensors.append(i)
    if tensors:
        device = losses[tensors[0]].device
        # stacked in their dtype when they share one (a model's float32 losses, exact in float64 after;
        # and MPS has no float64), else each in float64 (stacking promotes int64 and float16 to float32
        # together, which rounds). passes.moved would do the same: it moves in the common dtype.
        dtypes = {losses[i].dtype for i in tensors}
        common = dtypes.pop() if len(dtypes) == 1 else torch.float64
        read = torch.stack([losses[i].detach().reshape(()).to(device, common) for i in tensors])
        out[tensors] = read.to("cpu", torch.float64)
    return out


def defend(defence: str, round: Round, reported: torch.Tensor) -> torch.Tensor:
    reported = reported.to(torch.float64)
    if defence == "clip":
        return robust_floor(reported)
    if defence == "benchmark":
        return torch.maximum(reported, reference_losses(round).to(reported.device))
    return reported
