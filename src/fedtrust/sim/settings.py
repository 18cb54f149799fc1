"""Training settings of a simulated federation (the ``train:`` block of an experiment config)."""

from __future__ import annotations

import re
from typing import Literal

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from fedtrust._checks import Settings, share_count

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?|mps|xpu(:\d+)?")


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a torch device: ``auto`` is CUDA where torch sees a CUDA device, else the CPU.
    A named device torch cannot use here is refused with the reason."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:  # an index past what torch reads (cuda:99999999999999999999)
        raise ValueError(f"train.device: {name!r} is not a device torch can name ({exc})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"train.device: {name!r}, but this torch ({torch.__version__}) sees no CUDA device; use "
                "'auto' or 'cpu'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"train.device: {name!r}, but torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
    if device.type == "mps":  # (named, to say why, rather than refused as an unknown device)
        raise ValueError(
            f"train.device: {name!r} is not supported: MPS has no float64, which fedtrust's sums over a "
            "device's data need (norms, distances, evaluation); use 'cpu'"
        )
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise ValueError(f"train.device: {name!r}, but this torch sees no XPU device; use 'auto' or 'cpu'")
    return device


class TrainSettings(Settings):
    """How the federation trains.

    mode: ``params`` — FedAvg-style: clients run local SGD from the global model and send the change
          (new - global); the server adds server_lr x the aggregate.
          ``gradient`` — distributed SGD: clients send one mini-batch gradient at the global model; the
          server steps by lr x server_lr x the aggregate.
          ``one_round`` — one-round parameter estimation: clients train from the initial model for
          local_epochs and send the change once; the aggregate is the final model.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["params", "gradient", "one_round"] = "params"
    rounds: int = Field(30, ge=1)
    fraction: float = Field(1.0, gt=0.0, le=1.0, description="clients sampled per round")
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.1, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    server_lr: float = Field(1.0, gt=0.0)
    eval_every: int = Field(1, ge=1, description="evaluate the global model every k rounds (and at the end)")
    executor: Literal["auto", "batched", "loop"] = Field(
        "auto",
        description="batched: all clients' local steps as one vmapped computation; loop: one at a time; "
        "auto: batched unless the model has convolutions (vmapped convolutions are slower on a CPU) or "
        "running statistics (batch norm: only the loop updates them)",
    )
    report_loss: Literal["auto", "always"] = Field(
        "auto",
        description="clients report train_loss (their data's loss at the received model, one forward pass "
        "over it) always, or (auto) only when the rule reads it (ARFL, FOCUS) or liars misreport a loss",
    )
    device: str = Field(
        "auto",
        description="where models, client data and the batched executor live: auto (CUDA when torch sees "
        "one, else the CPU), cpu, cuda, cuda:<i> or xpu[:<i>] (not mps: it has no float64). Results agree "
        "across devices to float rounding; it is not part of a run's config hash, so a run resumes on "
        "another device",
    )
    checkpoint_every: int = Field(5, ge=1)
    predictive: Literal["bootstrap", "omc", "linear"] = Field(
        "bootstrap",
        description="with a probabilistic rule (fedag): predictive distribution from the client models "
        "(bootstrap, eqs 3-5), from draws of the posterior (omc) or the linear model's closed form (eq 6)",
    )
    predictive_samples: int = Field(100, ge=2, description="weight sets drawn for omc")
    predictive_noise: bool = Field(False, description="add the data noise 1/beta to bootstrap/omc variances")

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not _DEVICE.fullmatch(v):
            raise ValueError("must be auto, cpu, cuda, cuda:<i> or xpu[:<i>]")
        return v

    @model_validator(mode="after")
    def _server_lr_has_an_effect(self) -> TrainSettings:
        """In one_round mode the aggregate is the final model: a server step would be silently ignored by
        the server and read by model replacement's boost (n / eta), so it is refused."""
        if self.mode == "one_round" and self.server_lr != 1.0:
            raise ValueError(
                f"server_lr {self.server_lr} has no effect in one_round mode (the aggregate is the final "
                "model); leave it at 1"
            )
        return self

    @property
    def rounds_run(self) -> int:
        """How many rounds a run has: ``rounds``, or one in one_round mode."""
        return 1 if self.mode == "one_round" else self.rounds

    def clients_per_round(self, k: int) -> int:
        """How many of ``k`` clients a round samples: ``fraction`` of them (rounded half up:
        :func:`~fedtrust._checks.share_count`), at least one."""
        return max(1, share_count(self.fraction, k))
