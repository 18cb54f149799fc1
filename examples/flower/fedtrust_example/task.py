"""The model and the data each node holds (its partition of digits or Fashion-MNIST)."""

from __future__ import annotations

import torch
from torch import nn

from fedtrust.data import load_digits, load_fashion_mnist
from fedtrust.flower import LocalData

MODELS = ("cnn", "softmax", "mlp")


def load(dataset: str):
    if dataset not in ("digits", "fashion_mnist"):
        raise ValueError(f"run config dataset must be digits or fashion_mnist, got {dataset!r}")
    return load_digits() if dataset == "digits" else load_fashion_mnist()


def make_model(dataset: str, model: str = "cnn") -> nn.Module:
    """``cnn``: two 3x3 convolutions with batch norm (whose running statistics are federated too, and
    whose integer counter stays the server's); ``softmax``: one linear layer; ``mlp``: one hidden layer.
    Rows come flat (64 or 784 values) and are folded into an image for the CNN."""
    side = 8 if dataset == "digits" else 28
    if model == "softmax":
        return nn.Linear(side * side, 10)
    if model == "mlp":
        return nn.Sequential(nn.Linear(side * side, 100), nn.ReLU(), nn.Linear(100, 10))
    if model != "cnn":
        raise ValueError(f"run config model must be one of {MODELS}, got {model!r}")
    return nn.Sequential(
        nn.Unflatten(1, (1, side, side)),
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * (side // 4) ** 2, 10),
    )  # fmt: skip


def setting(cfg, key: str, kind: type, minimum: float | None = None):
    """The run config's ``key`` as ``kind`` (an int where a float is asked for counts), or an error
    naming the key and the value."""
    value = cfg[key]
    ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if isinstance(value, bool) or not ok:
        raise ValueError(f"run config {key} must be {kind.__name__}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"run config {key} must be >= {minimum}, got {value!r}")
    return kind(value)


def partition(dataset: str, index: int, parts: int, benchmark: int = 0) -> LocalData:
    """Node ``index`` of ``parts`` gets an IID share of the training rows (after the first ``benchmark``
    rows, which the server keeps) and the test split for evaluation."""
    if not 0 <= index < parts:
        raise ValueError(f"node config partition-id must be in [0, num-partitions = {parts}), got {index}")
    data = load(dataset)
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))[benchmark:]
    rows = order.tensor_split(parts)[index]
    return LocalData(data.x_train[rows], data.y_train[rows], data.x_test, data.y_test, data.num_classes,
                     data.input_shape)  # fmt: skip


def server_data(dataset: str, benchmark: int):
    """The server's trusted benchmark rows and the test split for its own evaluation."""
    data = load(dataset)
    if not 0 <= benchmark < len(data.y_train):
        raise ValueError(f"run config benchmark-size must be in [0, {len(data.y_train)}), got {benchmark}")
    order = torch.randperm(len(data.y_train), generator=torch.Generator().manual_seed(0))[:benchmark]
    return (data.x_train[order], data.y_train[order]), (data.x_test, data.y_test)
