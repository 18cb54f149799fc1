"""Backdoor data poisoning: a pixel-pattern trigger stamped on a corrupted client's images, relabelled to
a target class, so a model that learns the pairing classifies any image carrying the trigger as the
target while its clean accuracy stays intact.

- :class:`Backdoor`: BadNets (Gu, Dolan-Gavitt, Garg, "BadNets: Evaluating Backdooring Attacks on Deep
  Neural Networks", IEEE Access 2019): one square trigger in the bottom-right corner of every channel,
  set to ``value`` (default 1.0: white on fedtrust's [0, 1]-scaled images; on CIFAR-10 loaded with
  ``normalize=True`` the trigger is stamped on standardised pixels, where white is about 2).
- :class:`DistributedBackdoor`: DBA (Xie, Huang, Chen, Li, "DBA: Distributed Backdoor Attacks against
  Federated Learning", ICLR 2020): the same global trigger cut into ``parts`` horizontal stripes; the
  i-th corrupted client stamps only stripe i mod ``parts`` (their Section 3: attacker i embeds local
  pattern i, so together they cover the global trigger), and the model is tested with the whole trigger.

Both are data corruptions (``corruption: {name: backdoor, fraction: 0.2, samples: 0.5}``): ``samples`` is
the share of a corrupted client's rows that are poisoned. Both papers keep the rest clean, so the update
also keeps the main task: set it (0.5 in the README and the robustness table). Its default is every data
corruption's, 1: every row stamped and relabelled, much like a label flip. Pair either with an update
attack (``corruption.attack``, e.g. ``model_replacement``, Bagdasaryan et al. 2020) to boost what the
poisoned clients send. The runner supplies ``input_shape`` (C, H, W) from the dataset; the simulator
reports ``backdoor_asr`` beside the test accuracy (:class:`fedtrust.sim.evaluation.BackdoorSuccess`).
"""

from __future__ import annotations

import torch

from fedtrust._checks import check_float, check_int


class Backdoor:
    """BadNets: stamp the trigger, set the label to ``target``.

    size: the square's side in pixels (default max(2, H // 7): 2 on 8x8 digits, 4 on 28x28
    Fashion-MNIST, 4 on 32x32 CIFAR-10); value: the trigger's pixel value (default 1.0).
    """

    name = "backdoor"

    def __init__(self, input_shape: tuple, target: int = 0, size: int | None = None, value: float = 1.0):
        if not isinstance(input_shape, list | tuple) or len(input_shape) != 3:
            raise ValueError(
                f"corruption {self.name}: needs images of shape (C, H, W), the dataset's input shape is "
                f"{input_shape!r}"
            )
        self.input_shape = tuple(int(s) for s in input_shape)
        c, h, w = self.input_shape
        self.target = check_int(f"corruption {self.name}: target", target, minimum=0)
        default = max(2, h // 7)
        self.size = check_int(f"corruption {self.name}: size", default if size is None else size, minimum=1)
        if self.size > min(h, w):
            raise ValueError(f"corruption {self.name}: size {self.size} does not fit in {h}x{w} images")
        self.value = check_float(f"corruption {self.name}: value", value)

    def rows(self) -> range:
        """The image rows the global trigger covers."""
        h = self.input_shape[1]
        return range(h - self.size, h)

    def mask(self, rows=None) -> torch.Tensor:
        """(C*H*W,) bool: the flattened pixels the trigger (or its ``rows``) covers, in every channel."""
        c, h, w = self.input_shape
        m = torch.zeros(c, h, w, dtype=torch.bool)
        for r in self.rows() if rows is None else rows:
            m[:, r, w - self.size :] = True
        return m.reshape(-1)

    def stamp(self, x: torch.Tensor, rows=None) -> torch.Tensor:
        """A copy of the flattened images ``x`` with the trigger (or its ``rows``) stamped on."""
        if x.shape[-1] != self.mask().numel():
            raise ValueError(
                f"corruption {self.name}: images of shape {self.input_shape} have {self.mask().numel()} "
                f"features, the data has {x.shape[-1]}"
            )
        out = x.clone()
        out[:, self.mask(rows)] = self.value
        return out

    def check_target(self, num_classes: int | None) -> None:
        if num_classes is None:
            raise ValueError(f"corruption {self.name}: a backdoor relabels images; this is a regression task")
        if self.target >= num_classes:
            raise ValueError(
                f"corruption {self.name}: target {self.target} is not a class (0..{num_classes - 1})"
            )

    def __call__(self, x, y, num_classes, g):
        self.check_target(num_classes)
        return self.stamp(x), torch.full_like(y, self.target)


class DistributedBackdoor(Backdoor):
    """DBA: the global trigger's rows cut into ``parts`` stripes (default 4, the paper's four local
    triggers; here contiguous stripes of the corner square); corrupted client ``client`` (its rank
    among the corrupted clients, which the simulator and the Flower client pass) stamps stripe ``client
    mod parts``, and evaluation stamps the whole trigger. Called without ``client`` it draws a stripe
    from ``g``.
    ``size`` defaults to max(parts, H // 7) so every stripe holds at least one row."""

    name = "dba"

    def __init__(self, input_shape: tuple, target: int = 0, size: int | None = None, value: float = 1.0,
                 parts: int = 4):  # fmt: skip
        self.parts = check_int("corruption dba: parts", parts, minimum=1)
        if size is None and isinstance(input_shape, list | tuple) and len(input_shape) == 3:
            h, w = int(input_shape[1]), int(input_shape[2])
            if self.parts > min(h, w):
                raise ValueError(
                    f"corruption dba: parts {self.parts} need a trigger of at least {self.parts} rows, which "
                    f"does not fit in {h}x{w} images; give parts <= {min(h, w)}"
                )
            size = max(self.parts, 2, h // 7)
        super().__init__(input_shape, target, size, value)
        if self.parts > self.size:
            raise ValueError(
                f"corruption dba: {self.parts} parts need a trigger of at least {self.parts} rows"
            )

    def stripe(self, part: int) -> list[int]:
        """The image rows of local trigger ``part`` (0-based): the global rows split as evenly as possible."""
        rows = list(self.rows())
        return [r for i, r in enumerate(rows) if i * self.parts // len(rows) == part]

    def __call__(self, x, y, num_classes, g, client: int | None = None):
        self.check_target(num_classes)
        part = int(torch.randint(self.parts, (1,), generator=g)) if client is None else client % self.parts
        return self.stamp(x, self.stripe(part)), torch.full_like(y, self.target)
