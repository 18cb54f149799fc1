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
    """Each client's update scored on the server's trusted split (float64, on the host)."""
    if round.reference is None:
        raise ValueError("this defence needs Round.reference: a trusted benchmark split on the server")
    return torch.tensor([float(round.reference(u)) for u in round.updates], dtype=torch.float64)


def defend(defence: str, round: Round, reported: torch.Tensor) -> torch.Tensor:
    reported = reported.to(torch.float64)
    if defence == "clip":
        return robust_floor(reported)
    if defence == "benchmark":
        return torch.maximum(reported, reference_losses(round).to(reported.device))
    return reported
