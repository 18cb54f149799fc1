"""Scoring how well a rule's trust separates corrupted from honest clients."""

from __future__ import annotations

import math
from collections.abc import Sequence


def detection_auroc(weights: Sequence[float], corrupted: Sequence[bool]) -> float | None:
    """AUROC of "low trust means corrupted" (scikit-learn's ``roc_auc_score`` of the corrupted flags
    against minus the weight): the probability that a random corrupted client got less weight than a
    random honest one, ties counting half. None when a round has only one kind of client, or a weight
    is not a number (a refused round)."""
    if len(weights) != len(corrupted):
        raise ValueError(f"detection_auroc: {len(weights)} weights but {len(corrupted)} corrupted flags")
    if all(corrupted) or not any(corrupted) or not all(math.isfinite(w) for w in weights):
        return None
    from sklearn.metrics import roc_auc_score  # here: importing scikit-learn takes ~1.6 s (flame.py says why)

    return float(roc_auc_score([bool(c) for c in corrupted], [-float(w) for w in weights]))
