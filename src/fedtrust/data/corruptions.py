"""Data corruptions applied to a corrupted client's local data (a chosen fraction of its samples).

Each is a class whose constructor validates its options and whose call
``(x, y, num_classes, generator) -> (x, y)`` returns corrupted copies. Which clients are corrupted is
decided by the simulator and recorded; rules never see it.
"""

from __future__ import annotations

import inspect

import torch

from fedtrust._checks import check_float, check_int
from fedtrust.data.backdoor import Backdoor, DistributedBackdoor
from fedtrust.registry import build, lookup, options_of


def _need_classes(name: str, num_classes: int | None) -> int:
    if num_classes is None:
        raise ValueError(
            f"corruption {name!r} changes class labels; this is a regression task (use target_noise)"
        )
    return num_classes


class LabelShuffle:
    """Shuffle the labels among the client's samples (ARFL's "label shuffling")."""

    def __call__(self, x, y, num_classes, g):
        _need_classes("label_shuffle", num_classes)
        return x, y[torch.randperm(len(y), generator=g)]


class LabelFlip:
    """Set every label to one class, random per client unless ``target`` is given (ARFL's label flipping)."""

    def __init__(self, target: int | None = None):
        self.target = (
            None if target is None else check_int("corruption label_flip: target", target, minimum=0)
        )

    def __call__(self, x, y, num_classes, g):
        classes = _need_classes("label_flip", num_classes)
        if self.target is not None and self.target >= classes:
            raise ValueError(f"corruption label_flip: target {self.target} is not a class (0..{classes - 1})")
        target = self.target if self.target is not None else int(torch.randint(classes, (1,), generator=g))
        return x, torch.full_like(y, target)


class RandomLabels:
    """Replace labels by uniformly random classes (FOCUS's randomised labels)."""

    def __call__(self, x, y, num_classes, g):
        classes = _need_classes("random_labels", num_classes)
        return x, torch.randint(classes, y.shape, generator=g, dtype=y.dtype)


class FeatureNoise:
    """x + N(0, std^2), then each sample rescaled to [0, 1] (ARFL's "noisy" clients, std = 0.7)."""

    def __init__(self, std: float = 0.7):
        self.std = check_float("corruption feature_noise: std", std, minimum=0.0)

    def __call__(self, x, y, num_classes, g):
        noisy = x + self.std * torch.randn(x.shape, generator=g, dtype=x.dtype)
        low = noisy.min(dim=1, keepdim=True).values
        span = (noisy.max(dim=1, keepdim=True).values - low).clamp_min(1e-12)
        return (noisy - low) / span, y


class TargetNoise:
    """Regression targets + N(0, (std * sd(y))^2): noise relative to the targets' own spread, sd(y) that
    of the rows it corrupts (a client's ``samples`` share of its rows: all of them by default). A single
    row has no spread: its scale is 1.0, the spread of standardised targets (the regression data sets
    but synthetic_linear are standardised; there, 1.0 is in the targets' own units)."""

    def __init__(self, std: float = 1.0):
        self.std = check_float("corruption target_noise: std", std, minimum=0.0)

    def __call__(self, x, y, num_classes, g):
        if num_classes is not None:
            raise ValueError("corruption target_noise is for regression targets; use a label corruption")
        scale = float(y.std()) if len(y) > 1 else 1.0
        return x, y + self.std * scale * torch.randn(y.shape, generator=g, dtype=y.dtype)


DATA_CORRUPTIONS = {
    "label_shuffle": LabelShuffle,
    "label_flip": LabelFlip,
    "random_labels": RandomLabels,
    "feature_noise": FeatureNoise,
    "target_noise": TargetNoise,
    "backdoor": Backdoor,
    "dba": DistributedBackdoor,
}


def data_corruption(name: str, input_shape: tuple[int, ...] | None = None, **options):
    """The data corruption ``name`` with ``options``; ``input_shape`` (the data's, supplied by the caller)
    goes to the corruptions that stamp images (the backdoors), which refuse to be built without it."""
    builder = lookup("corruption", DATA_CORRUPTIONS, name)
    supplied = {}
    if "input_shape" in options_of(builder):
        if input_shape is None:
            raise ValueError(
                f"corruption {name!r} stamps a trigger on images: it needs their input_shape (C, H, W)"
            )
        supplied["input_shape"] = input_shape
    return build("corruption", DATA_CORRUPTIONS, name, options, **supplied)


def _takes_client(corruption) -> bool:
    try:
        return "client" in inspect.signature(corruption).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def corrupt(corruption, x, y, num_classes, fraction: float, g: torch.Generator, client: int | None = None):
    """Apply ``corruption`` to a random ``fraction`` of the rows of (x, y), at least one row where
    ``fraction`` > 0: a client counted as corrupted holds corrupted data (a 1-row client at ``samples:
    0.5``, or 68 rows at 0.005, was left clean and still scored as an attacker). The rows are counted by
    Python's ``round`` (half to even: 4.5 rows -> 4), unlike the clients
    (:func:`~fedtrust._checks.share_count`, half up), so that the stored runs' corrupted rows stay what
    they were (the robustness tables' backdoor clients poison half their rows). Returns new tensors.
    ``client`` (the client's rank among the corrupted ones) is passed on to a corruption that takes it
    (DBA: which stripe of the trigger this client stamps)."""
    k = min(len(y), max(round(fraction * len(y)), int(fraction > 0)))
    if k == 0:
        return x, y
    rows = torch.randperm(len(y), generator=g)[:k]
    which = {"client": client} if client is not None and _takes_client(corruption) else {}
    cx, cy = corruption(x[rows], y[rows], num_classes, g, **which)
    x, y = x.clone(), y.clone()
    x[rows], y[rows] = cx, cy
    return x, y
