"""A torch module driven functionally by one flat vector (torch.func.functional_call).

The flat vector holds the module's floating-point state: its parameters and its floating buffers (batch
norm's ``running_mean`` / ``running_var``), each entry in ``state_dict`` order (so a layer's running
statistics sit beside its weights, and the vector of ``ArrayRecord(module.state_dict())`` read by
:class:`fedtrust.flower.arrays.ArrayLayout` is exactly this vector). Rules therefore aggregate running
statistics as they aggregate weights (what FedAvg does in most FL libraries). Integer buffers (batch
norm's ``num_batches_tracked``) are not in the vector: they stay at the module's own value, which
training never changes (every training forward gets a copy). They only matter for batch norm with
``momentum=None`` (a cumulative average over that count), which is refused.
"""

from __future__ import annotations

import torch
from torch import nn


class FlatModel:
    """Wraps a module so that its floating-point state lives in one flat vector: rules aggregate flat
    vectors, and local training, evaluation and attacks work on them directly.

    task: "classification" (cross-entropy on logits) or "regression" (mean squared error on a scalar).

    ``forward`` / ``loss`` / ``evaluate`` run the module in eval mode (batch norm normalises with the
    running statistics in the vector: a prediction does not depend on the rest of its batch);
    ``loss(..., train=True)`` and :meth:`training_loss` run it in train mode (batch statistics; the
    running statistics are updated, on copies that :meth:`training_loss` returns).
    """

    def __init__(self, module: nn.Module, task: str, name: str = "model"):
        for where, m in module.named_modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.momentum is None:
                raise ValueError(
                    f"{name}: batch norm layer {where or type(m).__name__!r} has momentum=None (a cumulative "
                    "average over num_batches_tracked, an integer count that is not federated); give it a "
                    "momentum, e.g. 0.1"
                )
        if task not in ("classification", "regression"):
            raise ValueError(f"{name}: task must be 'classification' or 'regression', got {task!r}")
        self.module = module
        self.task = task
        self.name = name
        parameters = {id(p) for p in module.parameters()}
        self.names: list[str] = []  # the vector's entries, in order
        self.shapes: list[torch.Size] = []
        self.numels: list[int] = []
        self.buffer_names: list[str] = []  # the floating buffers among them
        self.fixed: dict[str, torch.Tensor] = {}  # integer buffers: at the module's value
        seen: set[int] = set()
        for key, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied parameter: once
                continue
            seen.add(id(tensor))
            if id(tensor) in parameters or tensor.is_floating_point():
                self.names.append(key)
                self.shapes.append(tensor.shape)
                self.numels.append(tensor.numel())
                if id(tensor) not in parameters:
                    self.buffer_names.append(key)
            else:
                self.fixed[key] = tensor
        self.size = sum(self.numels)  # the flat vector's length
        self.variances = [k for k in self.buffer_names if k.endswith("running_var")]
        buffers = set(self.buffer_names)
        self.num_buffers = sum(n for k, n in zip(self.names, self.numels, strict=True) if k in buffers)
        self.num_params = self.size - self.num_buffers
        #: True at the vector's parameter entries, False at its buffers' (None when it has no buffers)
        self.param_mask: torch.Tensor | None = None
        if buffers:
            self.param_mask = torch.cat(
                [torch.full((n,), k not in buffers) for k, n in zip(self.names, self.numels, strict=True)]
            )

    def init(self, seed: int) -> torch.Tensor:
        """Freshly initialised state (the module's own init scheme; batch norm's running statistics at
        mean 0, variance 1) as a flat vector, from ``seed``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for m in self.module.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
            state = self.module.state_dict()
            return torch.cat([state[k].detach().reshape(-1) for k in self.names]).clone()

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> a view of ``flat`` shaped as that parameter or floating buffer."""
        return {
            n: v.view(s) for n, v, s in zip(self.names, flat.split(self.numels), self.shapes, strict=True)
        }

    def state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's full state (``load_state_dict`` takes it) for ``flat``: its entries, and the
        integer buffers at the module's values."""
        tensors = {
            **self.unflatten(flat),
            **{k: v.detach().to(flat.device, copy=True) for k, v in self.fixed.items()},
        }
        return {k: tensors[k] for k in self.module.state_dict() if k in tensors}

    def _call(self, flat: torch.Tensor, x: torch.Tensor, train: bool) -> tuple[torch.Tensor, dict]:
        tensors = self.unflatten(flat)
        if train and (self.buffer_names or self.fixed):  # updated in place by batch norm: copies
            tensors.update({k: tensors[k].detach().clone() for k in self.buffer_names})
            tensors.update({k: v.detach().to(flat.device, copy=True) for k, v in self.fixed.items()})
        elif not train:  # an aggregate of running variances can be negative (attacked, a non-robust rule):
            for k in self.variances:  # read it as 0, where batch norm's eps keeps the division defined
                tensors[k] = tensors[k].clamp_min(0)
        if x.is_floating_point() and x.dtype != flat.dtype:  # inputs follow the vector (float64 models)
            x = x.to(flat.dtype)
        if self.module.training != train:
            self.module.train(train)
        return torch.func.functional_call(self.module, tensors, (x,)), tensors

    def forward(self, flat: torch.Tensor, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        return self._call(flat, x, train)[0]

    def _criterion(self, out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        if self.task == "classification":
            return nn.functional.cross_entropy(out, y, reduction=reduction)
        return nn.functional.mse_loss(out.reshape(-1), y.to(out.dtype), reduction=reduction)

    def loss(
        self,
        flat: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        reduction: str = "mean",
        train: bool = False,
    ) -> torch.Tensor:
        return self._criterion(self.forward(flat, x, train), y, reduction)

    def training_loss(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mean loss in train mode, and the floating buffers this batch leaves (as a vector of
        ``num_buffers`` values in the vector's order; None without buffers). The gradient of the loss
        with respect to ``flat`` is zero at the buffers' entries (train mode normalises with batch
        statistics; the running statistics are copies)."""
        out, tensors = self._call(flat, x, True)
        buffers = None
        if self.buffer_names:
            buffers = torch.cat([tensors[k].detach().reshape(-1) for k in self.buffer_names])
        return self._criterion(out, y, "mean"), buffers

    def with_buffers(self, flat: torch.Tensor, buffers: torch.Tensor | None) -> torch.Tensor:
        """``flat`` with its buffer entries replaced by ``buffers`` (from :meth:`training_loss`)."""
        if buffers is None:
            return flat
        out = flat.clone()
        out[~self.param_mask.to(out.device)] = buffers.to(out.dtype)
        return out

    def parameters_only(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` with its buffer entries zeroed (weight decay acts on parameters only)."""
        return flat if self.param_mask is None else flat * self.param_mask.to(flat)

    @torch.no_grad()
    def evaluate(
        self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch: int = 4096
    ) -> dict[str, float]:
        """accuracy + loss (classification) or rmse + mse (regression) over (x, y), in eval mode. The
        batches' sums are added in float64 where they are computed and read once (on a GPU a read is a
        sync: two a batch before)."""
        sums = torch.zeros(2, dtype=torch.float64, device=flat.device)  # loss, correct
        count = 0
        for xb, yb in zip(x.split(batch), y.split(batch), strict=True):
            out = self.forward(flat, xb)
            if self.task == "classification":
                sums[0] += nn.functional.cross_entropy(out, yb, reduction="sum").double()
                sums[1] += (out.argmax(1) == yb).sum()
            else:
                sums[0] += ((out.reshape(-1) - yb) ** 2).sum().double()
            count += len(yb)
        total, correct = sums.tolist()
        if self.task == "classification":
            return {"accuracy": correct / count, "loss": total / count}
        return {"rmse": (total / count) ** 0.5, "mse": total / count}
