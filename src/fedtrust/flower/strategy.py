"""Any fedtrust rule as a Flower strategy on the Message API (``flwr.serverapp.strategy``)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from fedtrust.aggregators import Round
from fedtrust.checkpoint import load_state, save_state
from fedtrust.flower.arrays import ArrayLayout, MalformedReply
from fedtrust.models import FlatModel
from fedtrust.rules import rule as build_rule
from fedtrust.server import server_step

#: Keys of the MetricRecord a fedtrust client sends with its update.
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train_loss"
POSTERIOR_VAR = "posterior-var"


class TrustStrategy(FedAvg):
    """FedAvg's sampling and messaging, with the aggregation done by a fedtrust rule.

    Each round the replies become a :class:`fedtrust.Round`: updates are the clients' models minus the
    global model, client ids are Flower node ids (so rules that learn reputation keep it across rounds),
    ``num_samples`` and ``metrics`` come from each reply's MetricRecord (clients report ``train_loss``,
    the global model's loss on their data before training, which ARFL and FOCUS read). With a
    ``model`` and a ``benchmark`` (x, y) split the server scores updates on it (``Round.reference``,
    for FOCUS and the ARFL defence). A reply that failed, lacks keys, or has arrays of the wrong
    shape is dropped with a logged reason and the round goes on with the rest (Flower's FedAvg raises
    InconsistentMessageReplies instead); the rule quarantines non-finite updates itself. A round the
    rule cannot aggregate (every reply dropped or quarantined, or an aggregate that would make the model
    non-finite) keeps the previous model, returned again so that Flower's result holds it, and logs why.

    The returned MetricRecord carries the clients' averaged train metrics and, aligned lists,
    ``trust-node-ids`` / ``trust``. ``history`` keeps every round's trust, drops and quarantines, and
    the rule's ``warning`` when its estimator stopped before converging (also logged each round);
    ``history_path`` appends it as JSON lines, ``state_path`` saves the rule's state after each round
    and restores it at start (a restarted server keeps the reputations). Rules with an ``observe`` hook
    (ARFL) get every node's train_loss at the initial model through a QUERY round first. For FedAG the
    posterior variance travels to the clients as the ``posterior-var`` ArrayRecord.
    """

    def __init__(
        self,
        rule: str | Any = "fedavg",
        rule_options: dict | None = None,
        *,
        model: torch.nn.Module | FlatModel | None = None,
        benchmark: tuple[torch.Tensor, torch.Tensor] | None = None,
        task: str = "classification",
        initial_report: bool = True,
        history_path: str | Path | None = None,
        state_path: str | Path | None = None,
        query_timeout: float = 600.0,
        **fedavg_options: Any,
    ) -> None:
        super().__init__(**fedavg_options)
        self.rule = build_rule(rule, **(rule_options or {})) if isinstance(rule, str) else rule
        if model is not None and not isinstance(model, FlatModel):
            model = FlatModel(model, task)
        if benchmark is not None and model is None:
            raise ValueError("TrustStrategy: a benchmark split needs the model to score updates on it")
        self.model = model
        self.benchmark = benchmark
        self.initial_report = initial_report
        self.history_path = Path(history_path) if history_path else None
        self.state_path = Path(state_path) if state_path else None
        self.query_timeout = query_timeout
        self.history: list[dict[str, Any]] = []
        self.layout: ArrayLayout | None = None
        self.global_vector: torch.Tensor | None = None
        self.posterior_var: torch.Tensor | None = None
        self._observed = False
        if self.state_path is not None and self.state_path.exists():
            state = load_state(self.state_path, remedy="delete it to start the rule's state afresh")
            self.rule.load_state_dict(state)
            self._observed = True

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> fedtrust rule: %r", self.rule)

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.layout = ArrayLayout(arrays)
        self.global_vector = self.layout.flatten(arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.initial_report and hasattr(self.rule, "observe") and not self._observed:
            self._report_all(arrays, grid)
        if self.posterior_var is not None:
            for message in messages:
                message.content[POSTERIOR_VAR] = self.layout.unflatten(self.posterior_var)
        return messages

    def _report_all(self, arrays: ArrayRecord, grid: Grid) -> None:
        """Every connected node's train_loss at the current model, for the rule's ``observe`` hook."""
        nodes = list(grid.get_node_ids())
        query = RecordDict(
            {self.arrayrecord_key: arrays, self.configrecord_key: ConfigRecord({"query": TRAIN_LOSS})}
        )
        replies = grid.send_and_receive(
            self._construct_messages(query, nodes, MessageType.QUERY), timeout=self.query_timeout
        )
        ids, counts, losses = [], [], []
        for msg in replies:
            try:
                metrics = self._metrics(msg, (TRAIN_LOSS,))
            except MalformedReply as exc:
                log(WARNING, "initial report: dropped node %s: %s", msg.metadata.src_node_id, exc)
                continue
            ids.append(msg.metadata.src_node_id)
            counts.append(metrics[NUM_EXAMPLES])
            losses.append(metrics[TRAIN_LOSS])
        if ids:
            self.rule.observe(ids, counts, {TRAIN_LOSS: torch.tensor(losses)})
            log(INFO, "initial report: train_loss from %d nodes", len(ids))
        self._observed = True

    def _metrics(self, msg: Message, required: Iterable[str]) -> dict[str, float]:
        if msg.has_error():
            raise MalformedReply(f"the client reported an error: {msg.error.reason}")
        records = list(msg.content.metric_records.values())
        if len(records) != 1:
            raise MalformedReply(f"expected one MetricRecord, got {len(records)}")
        record = records[0]
        out = {}
        for key in (NUM_EXAMPLES, *required):
            if key not in record:
                raise MalformedReply(f"metric {key!r} missing (has {sorted(record.keys())})")
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise MalformedReply(f"metric {key!r} must be a number, got {value!r}")
            out[key] = float(value)
        if not (math.isfinite(out[NUM_EXAMPLES]) and out[NUM_EXAMPLES] >= 0):
            raise MalformedReply(f"num-examples must be a non-negative count, got {out[NUM_EXAMPLES]!r}")
        for key, value in record.items():
            if key not in out and isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = float(value)
        return out

    def _screen(
        self, replies: Iterable[Message]
    ) -> tuple[list[tuple[int, torch.Tensor, dict]], dict[int, str]]:
        accepted, dropped = [], {}
        for msg in replies:
            node = msg.metadata.src_node_id
            try:
                metrics = self._metrics(msg, getattr(self.rule, "requires", ()))
                if self.arrayrecord_key not in msg.content.array_records:
                    raise MalformedReply(f"no ArrayRecord {self.arrayrecord_key!r} in the reply")
                vector = self.layout.flatten(msg.content.array_records[self.arrayrecord_key])
            except MalformedReply as exc:
                dropped[node] = str(exc)
                log(WARNING, "aggregate_train: dropped the reply of node %s: %s", node, exc)
                continue
            accepted.append((node, vector, metrics))
        return accepted, dropped

    def _reference(self) -> Callable[[torch.Tensor], float] | None:
        if self.model is None or self.benchmark is None:
            return None
        bx, by = self.benchmark
        start = self.global_vector

        def reference(update: torch.Tensor) -> float:
            with torch.no_grad():
                return float(self.model.loss(start + update, bx, by))

        reference.size = len(by)  # type: ignore[attr-defined]
        return reference

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        accepted, dropped = self._screen(replies)
        record: dict[str, Any] = {
            "round": server_round,
            "received": len(replies),
            "dropped": {str(k): v for k, v in dropped.items()},
        }
        log(INFO, "aggregate_train: %d replies, %d dropped", len(replies), len(dropped))
        if not accepted:
            log(WARNING, "aggregate_train: no usable reply of %d; the global model stays", len(replies))
            return self._finish(record, None, "no usable reply")
        nodes = [a[0] for a in accepted]
        shared = set.intersection(*(set(a[2]) for a in accepted)) - {NUM_EXAMPLES}
        round_ = Round(
            updates=torch.stack([a[1] for a in accepted]) - self.global_vector,
            client_ids=nodes,
            num_samples=[a[2][NUM_EXAMPLES] for a in accepted],
            metrics={k: [a[2][k] for a in accepted] for k in shared},
            reference=self._reference(),
        )
        step = server_step(self.rule, round_, self.global_vector, lambda delta: self.global_vector + delta)
        if not step.applied:
            log(WARNING, "aggregate_train: no update applied, the global model stays: %s", step.error)
            return self._finish(record, None, step.error)
        vector, out = step.vector, step.aggregate
        if "posterior_var" in out.info:
            self.posterior_var = out.info["posterior_var"].detach().float()
        weights = step.weights
        counts = round_.num_samples
        metrics = {k: float((round_.metrics[k] * counts).sum() / counts.sum().clamp_min(1)) for k in shared}
        quarantined = step.quarantined
        metrics.update(
            {
                "trust-node-ids": nodes,
                "trust": weights,
                "dropped": len(dropped),
                "quarantined": len(quarantined),
            }
        )
        record["trust"] = {str(n): w for n, w in zip(nodes, weights, strict=True)}
        record["quarantined"] = quarantined
        warning = step.warning  # the rule's estimator stopped at max_iter before converging
        if warning is not None:
            record["warning"] = warning
            log(WARNING, "aggregate_train: round %d: %s", server_round, warning)
        self._finish(record, metrics, None)
        return self.layout.unflatten(vector), MetricRecord(metrics)

    def _finish(self, record: dict, metrics: dict | None, error: str | None):
        record["error"] = error
        self.history.append(record)
        if self.history_path is not None:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.history_path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if self.state_path is not None:
            save_state(self.state_path, self.rule.state_dict())
        if error is not None:  # the previous model again: Flower's Result would otherwise hold no arrays
            previous = self.layout.unflatten(self.global_vector)
            return previous, MetricRecord({"dropped": len(record["dropped"])})
        return None

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        if self.posterior_var is not None and self.layout is not None:
            for message in messages:
                message.content[POSTERIOR_VAR] = self.layout.unflatten(self.posterior_var)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Sample-weighted means of the numeric metrics, skipping (and logging) unusable replies."""
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        for msg in replies:
            try:
                metrics = self._metrics(msg, ())
            except MalformedReply as exc:
                log(
                    WARNING,
                    "aggregate_evaluate: dropped the reply of node %s: %s",
                    msg.metadata.src_node_id,
                    exc,
                )
                continue
            n = metrics.pop(NUM_EXAMPLES)
            for key, value in metrics.items():
                if math.isfinite(value):
                    totals[key] = totals.get(key, 0.0) + n * value
                    weights[key] = weights.get(key, 0.0) + n
        if not totals:
            return None
        return MetricRecord({k: totals[k] / weights[k] for k in totals if weights[k] > 0})
