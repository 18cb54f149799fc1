"""The model zoo: softmax / linear regression, MLP, small CNN."""

from __future__ import annotations

import math

from torch import nn

from fedtrust._checks import check_int
from fedtrust.data.datasets import Dataset
from fedtrust.models.flat import FlatModel
from fedtrust.registry import build


def _outputs(dataset: Dataset) -> int:
    return 1 if dataset.num_classes is None else dataset.num_classes


def softmax(dataset: Dataset) -> nn.Module:
    """Multinomial logistic regression (one linear layer on the flattened input); for a regression
    task, ordinary linear regression."""
    return nn.Linear(dataset.num_features, _outputs(dataset))


def linear(dataset: Dataset) -> nn.Module:
    """Linear model: for regression y = w'x + b; for classification the same as softmax."""
    return nn.Linear(dataset.num_features, _outputs(dataset))


def mlp(dataset: Dataset, hidden: int | list[int] = 200) -> nn.Module:
    """Fully connected ReLU network with the given hidden widths."""
    widths = [hidden] if isinstance(hidden, int) else list(hidden)
    if not widths:
        raise ValueError("model mlp: hidden needs at least one width")
    layers: list[nn.Module] = []
    fan_in = dataset.num_features
    for i, w in enumerate(widths):
        check_int(f"model mlp: hidden[{i}]", w, minimum=1)
        layers += [nn.Linear(fan_in, w), nn.ReLU()]
        fan_in = w
    layers.append(nn.Linear(fan_in, _outputs(dataset)))
    return nn.Sequential(*layers)


class _Fold(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x):
        return x.reshape(x.shape[0], *self.shape)


def cnn(dataset: Dataset, channels: list[int] = (16, 32), hidden: int = 128) -> nn.Module:
    """Small CNN: [conv 5x5 (same) -> ReLU -> 2x2 max-pool] per entry of ``channels``, then a hidden
    fully connected layer. Needs image-shaped inputs (input_shape = (C, H, W))."""
    if len(dataset.input_shape) != 3:
        raise ValueError(f"model cnn needs images; {dataset.name} has input shape {dataset.input_shape}")
    c, h, w = dataset.input_shape
    layers: list[nn.Module] = [_Fold(dataset.input_shape)]
    for i, out in enumerate(channels):
        check_int(f"model cnn: channels[{i}]", out, minimum=1)
        layers += [nn.Conv2d(c, out, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
        c, h, w = out, math.ceil(h / 2), math.ceil(w / 2)
    check_int("model cnn: hidden", hidden, minimum=1)
    layers += [nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(), nn.Linear(hidden, _outputs(dataset))]
    return nn.Sequential(*layers)


MODELS = {"softmax": softmax, "linear": linear, "mlp": mlp, "cnn": cnn}


def build_model(name: str, dataset: Dataset, **options) -> FlatModel:
    """A model for ``dataset`` by name, e.g. ``build_model("mlp", data, hidden=200)``."""
    module = build("model", MODELS, name, options, dataset=dataset)
    return FlatModel(module, dataset.task, name)
