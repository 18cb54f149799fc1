"""Scoring how well a rule's trust separates corrupted from honest clients."""

from __future__ import annotations

from collections.abc import Sequence


def detection_auroc(weights: Sequence[float], corrupted: Sequence[bool]) -> float | None:
    """AUROC of "low trust means corrupted": the probability that a random corrupted client got less
    weight than a random honest one (ties count half). None when a round has only one kind of client."""
    bad = [w for w, c in zip(weights, corrupted, strict=True) if c]
    good = [w for w, c in zip(weights, corrupted, strict=True) if not c]
    if not bad or not good:
        return None
    wins = sum((b < h) + 0.5 * (b == h) for b in bad for h in good)
    return wins / (len(bad) * len(good))
