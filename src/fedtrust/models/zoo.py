"""The model zoo: softmax / linear regression, MLP, small CNN, small ResNet (batch norm)."""

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
    if isinstance(hidden, str | bytes):
        raise ValueError(f"model mlp: hidden must be a width or a list of widths, got {hidden!r}")
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


class _BasicBlock(nn.Module):
    """He et al.'s basic residual block: [3x3 conv -> BN -> ReLU -> 3x3 conv -> BN] + shortcut, ReLU. The
    shortcut is the identity, or a strided 1x1 conv -> BN where the shape changes (their option B)."""

    def __init__(self, fan_in: int, out: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(fan_in, out, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out),
            nn.ReLU(),
            nn.Conv2d(out, out, 3, padding=1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or fan_in != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(fan_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        return nn.functional.relu(self.body(x) + self.shortcut(x))


def resnet(dataset: Dataset, width: int = 16, blocks: list[int] = (1, 1, 1)) -> nn.Module:
    """A small CIFAR-style ResNet (He et al. 2016, "Deep residual learning for image recognition",
    Section 4.2): a 3x3 conv -> BN -> ReLU stem of ``width`` channels, then one stage per entry of
    ``blocks`` with that many basic blocks, the channels doubling and the resolution halving (stride 2)
    from stage to stage, global average pooling and a linear layer. Depth 2 + 2 x sum(blocks): the default
    (1, 1, 1) is ResNet-8, (3, 3, 3) the paper's ResNet-20. Batch norm's running statistics travel in the
    flat vector with the weights (see :class:`fedtrust.models.FlatModel`). Needs image-shaped inputs."""
    if len(dataset.input_shape) != 3:
        raise ValueError(f"model resnet needs images; {dataset.name} has input shape {dataset.input_shape}")
    check_int("model resnet: width", width, minimum=1)
    if isinstance(blocks, int) or len(blocks) == 0:
        raise ValueError(f"model resnet: blocks must be a non-empty list of block counts, got {blocks!r}")
    layers: list[nn.Module] = [
        _Fold(dataset.input_shape),
        nn.Conv2d(dataset.input_shape[0], width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
    ]
    fan_in = width
    for stage, count in enumerate(blocks):
        check_int(f"model resnet: blocks[{stage}]", count, minimum=1)
        out = width * 2**stage
        for b in range(count):
            layers.append(_BasicBlock(fan_in, out, 2 if stage > 0 and b == 0 else 1))
            fan_in = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(fan_in, _outputs(dataset))]
    return nn.Sequential(*layers)


MODELS = {"softmax": softmax, "linear": linear, "mlp": mlp, "cnn": cnn, "resnet": resnet}


def build_model(name: str, dataset: Dataset, **options) -> FlatModel:
    """A model for ``dataset`` by name, e.g. ``build_model("mlp", data, hidden=200)``."""
    module = build("model", MODELS, name, options, dataset=dataset)
    return FlatModel(module, dataset.task, name)
