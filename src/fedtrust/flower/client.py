"""A Flower ClientApp from a torch model and a local dataset, reporting what fedtrust rules read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedtrust._checks import check_float, check_int
from fedtrust.attacks import AttackContext, attack
from fedtrust.data.corruptions import corrupt, data_corruption
from fedtrust.data.datasets import check_labels
from fedtrust.flower.arrays import ArrayLayout
from fedtrust.flower.replies import NAME_LIMIT, NODE_RECORD
from fedtrust.models import FlatModel
from fedtrust.registry import parse_spec
from fedtrust.sim.training import local_sgd, mean_loss


@dataclass
class LocalData:
    """A node's data: training rows, and evaluation rows (its own test split). Arrays may be torch tensors
    or numpy arrays (taken as tensors). Refused naming the field and the value, before any training:
    features that are not floating point, a label count that is not the row count, class labels that are
    not integers in 0..num_classes-1, test rows of another shape than the training rows, no training
    rows. (Test rows may be none: the node then answers an evaluation with an error saying so.)"""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int | None = None
    input_shape: tuple[int, ...] | None = None  # (C, H, W) of image rows: backdoor corruptions need it

    def __post_init__(self) -> None:
        if self.num_classes is not None:
            self.num_classes = check_int("LocalData: num_classes", self.num_classes, minimum=1)
        for split in ("train", "test"):
            x = _tensor(f"LocalData: x_{split}", getattr(self, f"x_{split}"))
            y = _tensor(f"LocalData: y_{split}", getattr(self, f"y_{split}"))
            if split == "test" and x.numel() == 0 and y.numel() == 0:  # no test rows (torch.empty(0) too)
                x, y = self.x_train[:0], self.y_train[:0]
            if y.dim() == 2 and y.shape[1] == 1:  # a column of targets, (rows, 1)
                y = y.reshape(-1)
            if x.dim() < 2 or not x.is_floating_point():
                raise ValueError(f"LocalData: x_{split} must be a floating (rows, features...) array, got "
                                 f"{x.dtype} of shape {tuple(x.shape)}")  # fmt: skip
            if y.dim() != 1 or len(y) != len(x):
                raise ValueError(f"LocalData: y_{split} must hold one label per row of x_{split} ({len(x)}), "
                                 f"got shape {tuple(y.shape)}")  # fmt: skip
            if self.num_classes is not None:
                check_labels(f"LocalData: y_{split}", y, self.num_classes)
                y = y.long()  # (int32 labels, numpy's default on Windows: cross-entropy takes int64)
            setattr(self, f"x_{split}", x)
            setattr(self, f"y_{split}", y)
        if len(self.x_train) == 0:
            raise ValueError("LocalData: x_train has no rows; a node trains on its own rows")
        if self.x_test.shape[1:] != self.x_train.shape[1:]:
            raise ValueError(f"LocalData: x_test rows have shape {tuple(self.x_test.shape[1:])}, x_train "
                             f"rows {tuple(self.x_train.shape[1:])}")  # fmt: skip


def _tensor(field: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.as_tensor(value)
    raise ValueError(f"{field} must be a torch tensor or a numpy array, got {type(value).__name__}")


#: Config keys that make a node corrupted (for demos and tests of robustness):
#:   fedtrust-corruption = "label_flip" (any data corruption; options in parentheses, e.g.
#:   "backdoor(target=3, samples=0.5)": ``samples`` is the share of the node's rows corrupted, default all),
#:   fedtrust-attack = "sign_flip" (any update attack that needs only the node's own update, e.g.
#:   "model_replacement(boost=10)"), fedtrust-lie = 0.0 (report this train_loss instead).
CORRUPTION, ATTACK, LIE = "fedtrust-corruption", "fedtrust-attack", "fedtrust-lie"
#: Run-config key listing the partition ids that take the run config's corruption keys (simulation,
#: where node configs hold only ``partition-id``): e.g. ``fedtrust-corrupted-partitions = "0 3"``.
CORRUPTED_PARTITIONS = "fedtrust-corrupted-partitions"
#: Local training's run-config keys and their defaults (a node's keyword options override the defaults).
TRAINING: dict[str, Any] = {"local-epochs": 1, "batch-size": 32, "learning-rate": 0.05, "weight-decay": 0.0}


def corrupted_partitions(run_config: Mapping[str, Any]) -> list[int]:
    """The partition ids the run config's ``fedtrust-corrupted-partitions`` lists ("0 3" or "0, 3"; none
    when it is absent or empty), in its order (DBA's stripes go by it), or an error naming the key and
    the entry that is not a partition id: a typo ("7 x") left every node honest and the run's detection
    scores with nothing to score, silently."""
    listed = str(run_config.get(CORRUPTED_PARTITIONS, "")).replace(",", " ").split()
    for entry in listed:
        if not (entry.isascii() and entry.isdigit()):
            raise ValueError(
                f"run config {CORRUPTED_PARTITIONS}: {entry!r} is not a partition id (whole numbers >= 0, "
                f'e.g. "0 3"), in {run_config[CORRUPTED_PARTITIONS]!r}'
            )
    return list(dict.fromkeys(int(entry) for entry in listed))


def node_role(context: Context) -> dict[str, str]:
    """The corruption keys that apply to this node: its own node config's, else the run config's when its
    ``partition-id`` is listed in ``fedtrust-corrupted-partitions``. Empty for an honest node."""
    keys = (CORRUPTION, ATTACK, LIE)
    role = {k: str(context.node_config[k]) for k in keys if str(context.node_config.get(k, "")) != ""}
    if _listed_at(context) is not None:
        for key in keys:
            if str(context.run_config.get(key, "")) != "":
                role.setdefault(key, str(context.run_config[key]))
    return role


def trust_client_app(
    model_fn: Callable[[Context], torch.nn.Module],
    data_fn: Callable[[Context], LocalData],
    *,
    task: str = "classification",
    local_epochs: int = TRAINING["local-epochs"],
    batch_size: int = TRAINING["batch-size"],
    lr: float = TRAINING["learning-rate"],
    weight_decay: float = TRAINING["weight-decay"],
    seed: int = 0,
    weighted_by_key: str = "num-examples",
    train_loss_key: str = "train_loss",
    arrayrecord_key: str = "arrays",
    configrecord_key: str = "config",
) -> ClientApp:
    """A ClientApp that, on ``train``, reports ``train_loss_key`` (the received model's loss on its data
    before training, what ARFL and FOCUS read) and ``weighted_by_key`` (its number of training rows) with
    its model after ``local_epochs`` of SGD (the run config's ``local-epochs``, ``batch-size``,
    ``learning-rate`` and ``weight-decay`` override the keyword defaults, so ``flwr run --run-config``
    tunes training without code changes); on ``evaluate`` reports loss (and accuracy) on its test rows;
    on ``query`` reports the train loss alone (the initial report). Every reply names the node
    (:func:`node_name`). The four keys are the strategy's options of the same names, with the same
    defaults (Flower's). A node whose :func:`node_role` sets ``fedtrust-corruption``, ``fedtrust-attack``
    or ``fedtrust-lie`` behaves as that corrupted client."""
    app = ClientApp()
    nodes = _Nodes(model_fn, data_fn, task, seed)
    defaults = {"local-epochs": local_epochs, "batch-size": batch_size, "learning-rate": lr,
                "weight-decay": weight_decay}  # fmt: skip

    def received(msg: Message, model: FlatModel) -> tuple[ArrayLayout, torch.Tensor]:
        record = msg.content.array_records[arrayrecord_key]
        layout = ArrayLayout(record)
        layout.check_model(model, "this node's model (model_fn's)")
        return layout, layout.flatten(record)

    def reply(msg: Message, context: Context, arrays: ArrayRecord | None, metrics: dict) -> Message:
        content = RecordDict(
            {"metrics": MetricRecord(metrics), NODE_RECORD: ConfigRecord({"name": node_name(context)})}
        )
        if arrays is not None:
            content[arrayrecord_key] = arrays
        return Message(content=content, reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model, data = nodes(context)
        layout, start = received(msg, model)
        loss = mean_loss(model, start, data.x_train, data.y_train)
        server_round = int(msg.content[configrecord_key].get("server-round", 0))
        run = {key: context.run_config.get(key, value) for key, value in defaults.items()}
        new, g = _local_training(model, start, data.x_train, data.y_train, run, seed, server_round)
        new = _attacked(context, start, new, g)
        metrics = {weighted_by_key: len(data.y_train), train_loss_key: _reported_loss(context, loss)}
        return reply(msg, context, layout.unflatten(new), metrics)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model, data = nodes(context)
        _, weights = received(msg, model)
        if len(data.y_test) == 0:
            raise ValueError("this node has no test rows (LocalData.x_test is empty): nothing to evaluate on")
        scores = model.evaluate(weights, data.x_test, data.y_test)
        return reply(msg, context, None, {weighted_by_key: len(data.y_test), **scores})

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        model, data = nodes(context)
        _, weights = received(msg, model)
        loss = mean_loss(model, weights, data.x_train, data.y_train)
        metrics = {weighted_by_key: len(data.y_train), train_loss_key: _reported_loss(context, loss)}
        return reply(msg, context, None, metrics)

    return app


def server_training(
    model: torch.nn.Module | FlatModel,
    root_data: tuple[torch.Tensor, torch.Tensor],
    run_config: Mapping[str, Any] | None = None,
    *,
    task: str = "classification",
    seed: int = 0,
) -> Callable[[ArrayRecord, int], ArrayRecord]:
    """A :class:`~fedtrust.flower.TrustStrategy` ``server_update`` (FLTrust's g_0, Cao et al. 2021): each
    round the server trains the global model on its root data ``(x, y)`` as :func:`trust_client_app`'s
    nodes train: the same seeding, and the run config's ``local-epochs``, ``batch-size``,
    ``learning-rate`` and ``weight-decay`` (give the ServerApp's ``context.run_config``; a key it lacks
    takes :data:`TRAINING`'s value, the nodes' default). The strategy takes the change as its own update."""
    flat = model if isinstance(model, FlatModel) else FlatModel(model, task)
    x, y = root_data
    run = {key: (run_config or {}).get(key, value) for key, value in TRAINING.items()}

    def update(arrays: ArrayRecord, server_round: int) -> ArrayRecord:
        layout = ArrayLayout(arrays)
        layout.check_model(flat, "server_training's model")
        new, _ = _local_training(flat, layout.flatten(arrays), x, y, run, seed, server_round)
        return layout.unflatten(new)

    return update


def _local_training(model: FlatModel, start, x, y, run: dict, seed: int, server_round: int):
    """``run``'s epochs of SGD from ``start`` (seeded by the round), and the generator it drew from; a
    setting out of range is refused naming its run-config key."""
    epochs = check_int("local-epochs", run["local-epochs"], minimum=1)
    batch_size = check_int("batch-size", run["batch-size"], minimum=1)
    lr = check_float("learning-rate", run["learning-rate"], minimum=0.0, strict_min=True)
    weight_decay = check_float("weight-decay", run["weight-decay"], minimum=0.0)
    g = torch.Generator().manual_seed(seed * 7919 + server_round)
    return local_sgd(model, start, x, y, epochs, batch_size, lr, weight_decay, g), g


def node_name(context: Context) -> str:
    """What a node calls itself in its replies: its node config's ``node-name`` (e.g. ``hospital-a``), else
    ``partition-<partition-id>``, else its Flower node id."""
    name = str(context.node_config.get("node-name", "")).strip()
    if name:
        if len(name) > NAME_LIMIT or not name.isprintable():
            raise ValueError(f"node config node-name must be printable and at most {NAME_LIMIT} characters, "
                             f"got {name!r}")  # fmt: skip
        return name
    if "partition-id" in context.node_config:
        return f"partition-{context.node_config['partition-id']}"
    return str(context.node_id)


class _Nodes:
    """Each node's model and local data, built once per node id; a node whose role names a data
    corruption gets its training rows corrupted (seeded by ``seed`` and its partition id, else its node
    id), so a run's corrupted data is the same whichever node ids the SuperLink hands out."""

    def __init__(self, model_fn, data_fn, task: str, seed: int):
        self.model_fn, self.data_fn, self.task, self.seed = model_fn, data_fn, task, seed
        self.cache: dict[int, tuple[FlatModel, LocalData]] = {}

    def __call__(self, context: Context) -> tuple[FlatModel, LocalData]:
        key = context.node_id
        if key not in self.cache:
            model = FlatModel(self.model_fn(context), self.task)
            data = self.data_fn(context)
            if not isinstance(data, LocalData):
                raise ValueError(
                    f"data_fn must return a fedtrust.flower.LocalData, got {type(data).__name__}"
                )
            _check_fit(model, data)
            spec = node_role(context).get(CORRUPTION)
            if spec:
                # by partition where there is one: node ids are drawn anew by every SuperLink
                who = context.node_config.get("partition-id", context.node_id)
                g = torch.Generator().manual_seed(self.seed + int(who) % 2**31)
                corruption, samples = _corruption(spec, data)
                x, y = corrupt(corruption, data.x_train, data.y_train, data.num_classes, samples, g,
                               client=_rank(context))  # fmt: skip
                data = LocalData(x, y, data.x_test, data.y_test, data.num_classes, data.input_shape)
            self.cache[key] = (model, data)
        return self.cache[key]


def _check_fit(model: FlatModel, data: LocalData) -> None:
    """Refuse, naming both, a model_fn's model that cannot take the data_fn's rows, or whose outputs
    (classes) are fewer than the labels need: one row through the model, before any training."""
    try:
        with torch.no_grad():
            out = model.forward(torch.zeros(model.size), data.x_train[:1])
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"this node's model (model_fn's) cannot take its rows (data_fn's x_train, of shape "
                         f"{tuple(data.x_train.shape[1:])} each): {exc}") from None  # fmt: skip
    if model.task == "classification":
        labels = int(data.y_train.max()) + 1
        if out.shape[-1] < labels:
            raise ValueError(f"this node's model (model_fn's) gives {out.shape[-1]} class scores, but "
                             f"data_fn's y_train holds label {labels - 1}")  # fmt: skip


def _corruption(spec: str, data: LocalData):
    """The data corruption a node's role names (``name`` or ``name(options)``) and the share of its rows
    it corrupts (the ``samples`` option, default all)."""
    name, options = parse_spec(spec)
    samples = check_float(f"{CORRUPTION} {spec!r}: samples", options.pop("samples", 1.0), minimum=0.0,
                          maximum=1.0)  # fmt: skip
    return data_corruption(name, data.input_shape, **options), samples


def _rank(context: Context) -> int | None:
    """The node's rank among the corrupted partitions the run config lists (DBA's stripe), else its
    partition id."""
    place = _listed_at(context)
    if place is not None:
        return place
    who = str(context.node_config.get("partition-id", ""))
    return int(who) if who.isdigit() else None


def _listed_at(context: Context) -> int | None:
    """Where the node's ``partition-id`` stands in the run config's ``fedtrust-corrupted-partitions``,
    or None where it is not listed."""
    listed = [str(p) for p in corrupted_partitions(context.run_config)]
    who = str(context.node_config.get("partition-id", ""))
    return listed.index(who) if who in listed else None


def _attacked(context: Context, start: torch.Tensor, new: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The model a node sends: ``new``, or what the update attack its role names makes of it (one that
    needs only the node's own update)."""
    spec = node_role(context).get(ATTACK)
    if not spec:
        return new
    name, options = parse_spec(spec)
    adversary = attack(name, **options)
    if getattr(adversary, "colluding", False):
        raise ValueError(
            f"{ATTACK} {spec!r} needs the other clients' updates or their number; a single node cannot run "
            "it (unless an option supplies what it would read, e.g. 'model_replacement(boost=10)')"
        )
    ctx = AttackContext((new - start)[None], torch.tensor([True]), start, "params", g)
    return start + adversary(ctx)[0]


def _reported_loss(context: Context, loss: float) -> float:
    """The train_loss a node reports: its own, or the lie its role sets."""
    lie = node_role(context).get(LIE)
    if lie is None:
        return loss
    try:
        return float(lie)
    except ValueError:
        raise ValueError(f"{LIE} must be a number (the train_loss this node reports), got {lie!r}") from None
