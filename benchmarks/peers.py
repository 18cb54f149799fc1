"""The same rules in the peer libraries, for ``benchmarks/aggregation.py``.

* ByzFL (PyPI ``byzfl``, ``make bench`` installs it without dependencies): its aggregator classes, called
  on a torch tensor and on a numpy array (it has a code path for each; the faster one counts). Its
  top-level package imports torchvision, so only ``byzfl.aggregators`` is loaded.
* Flower (``flwr``): the Message-API strategies' ``aggregate_train`` on reply Messages, exactly as a
  ServerApp runs them (FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan). Their numpy work is
  what is timed; building the Messages (which the strategies consume) is set-up, not timed.

Each peer names the fedtrust options that give the same definition (``ours``), so results can be
compared, and a note where the definitions differ.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Peer:
    name: str
    run: Callable[[Any], np.ndarray]  # called on what ``prepare`` returned; returns the aggregate
    prepare: Callable[[], Any]  # untimed set-up for one call
    ours: dict = field(default_factory=dict)  # fedtrust options that compute the same thing
    note: str = ""
    memory: float = 3.0  # peak extra memory, in copies of the n x d input


def byzfl_aggregators():
    """``byzfl.aggregators`` without ``byzfl/__init__`` (which pulls torchvision); None if missing."""
    if "byzfl.aggregators" in sys.modules:
        return sys.modules["byzfl.aggregators"]
    spec = importlib.util.find_spec("byzfl")
    if spec is None:
        return None
    package = types.ModuleType("byzfl")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("byzfl", package)
    return importlib.import_module("byzfl.aggregators")


def _byzfl(
    x: torch.Tensor, make: Callable[[Any], Callable], name: str, ours: dict, note: str = ""
) -> list[Peer]:
    module = byzfl_aggregators()
    if module is None:
        return []
    xn = x.numpy()

    def as_numpy(out):
        return out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)

    return [
        Peer(f"ByzFL {name} (torch)", lambda agg: as_numpy(agg(x)), lambda: make(module), ours, note),
        Peer(f"ByzFL {name} (numpy)", lambda agg: as_numpy(agg(xn)), lambda: make(module), ours, note),
    ]


_TASKS = itertools.count(1)


def flower_replies(x: np.ndarray, counts: np.ndarray) -> list:
    """One train reply Message per row of ``x`` (one array, ``num-examples``), as a ServerApp receives."""
    from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    replies = []
    for node, (row, count) in enumerate(zip(x, counts, strict=True), start=1):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, next(_TASKS)
        instruction = Message(RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
        TaskIdentity.node_id, TaskIdentity.task_id = node, next(_TASKS)
        content = RecordDict(
            {"arrays": ArrayRecord({"w": Array(row)}), "metrics": MetricRecord({"num-examples": int(count)})}
        )
        replies.append(Message(content, reply_to=instruction))
    TaskIdentity.node_id, TaskIdentity.task_id = 0, next(_TASKS)
    return replies


def _flower(
    x: torch.Tensor, counts: np.ndarray, strategy: Callable[[], Any], name: str, ours: dict, note: str = ""
) -> list[Peer]:
    try:
        import flwr.serverapp.strategy  # noqa: F401
    except ImportError:
        return []
    xn = x.numpy()

    def run(prepared):
        agg, replies = prepared
        arrays, _ = agg.aggregate_train(1, replies)
        return arrays["w"].numpy()

    # the reply Messages, their arrays as numpy, and (distance strategies) a stacked copy and its square
    memory = 5.0 if name in ("Krum", "MultiKrum", "Bulyan") else 3.0
    return [Peer(f"Flower {name}", run, lambda: (strategy(), flower_replies(xn, counts)), ours, note, memory)]


def peers_for(rule: str, x: torch.Tensor, f: int, counts: np.ndarray) -> list[Peer]:
    """Every peer implementation of ``rule`` on the round ``x`` (n x d) with ``f`` assumed attackers."""
    from flwr.serverapp import strategy as fl

    n = x.shape[0]
    quiet = {"fraction_train": 1.0}
    if rule == "mean":
        return _byzfl(x, lambda m: m.Average(), "Average", {})
    if rule == "fedavg":
        return _flower(x, counts, lambda: fl.FedAvg(**quiet), "FedAvg", {})
    if rule == "median":
        return _byzfl(x, lambda m: m.Median(), "Median", {}) + _flower(
            x, counts, lambda: fl.FedMedian(**quiet), "FedMedian", {}
        )
    if rule == "trimmed_mean":
        return _byzfl(x, lambda m: m.TrMean(f=f), "TrMean", {"f": f}) + _flower(
            x, counts, lambda: fl.FedTrimmedAvg(beta=f / n, **quiet), "FedTrimmedAvg", {"f": f}
        )
    if rule == "geometric_median":
        return _byzfl(
            x,
            lambda m: m.GeometricMedian(nu=0.1, T=3),
            "GeometricMedian",
            {"nu": 0.1, "max_iter": 3, "tol": 0.0},
            "ByzFL runs T=3 smoothed Weiszfeld steps from 0; fedtrust from the mean",
        )
    if rule == "krum":
        return _byzfl(
            x, lambda m: m.Krum(f=f), "Krum", {"f": f}, "ByzFL scores n-f-1 neighbours (the paper: n-f-2)"
        ) + _flower(x, counts, lambda: fl.Krum(num_malicious_nodes=f, **quiet), "Krum", {"f": f})
    if rule == "multi_krum":
        return _byzfl(
            x, lambda m: m.MultiKrum(f=f), "MultiKrum", {"f": f, "m": n - f}, "ByzFL scores n-f-1 neighbours"
        ) + _flower(
            x,
            counts,
            lambda: fl.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=n - f, **quiet),
            "MultiKrum",
            {"f": f, "m": n - f},
            "Flower averages the selected updates by num-examples",
        )
    if rule == "bulyan":
        fb = min(f, (n - 3) // 4)
        return _flower(
            x,
            counts,
            lambda: fl.Bulyan(num_malicious_nodes=fb, **quiet),
            "Bulyan",
            {"f": fb},
            "Flower selects theta by one Multi-Krum pass (the paper: Krum applied recursively)",
        )
    if rule == "centered_clipping":
        return _byzfl(
            x, lambda m: m.CenteredClipping(tau=10.0, L=1), "CenteredClipping", {"tau": 10.0, "n_iter": 1}
        )
    return []
