"""Any fedtrust rule as a Flower strategy on the Message API (``flwr.serverapp.strategy``)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from logging import INFO, WARNING
from numbers import Integral, Real
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore import log

from fedtrust.aggregators import Round, RoundRefused
from fedtrust.flower.arrays import ArrayLayout, MalformedReply
from fedtrust.flower.replies import Reply, display_names, metric_groups, numbers_in_all, screen
from fedtrust.flower.runlog import RunDirectory
from fedtrust.models import FlatModel
from fedtrust.registry import parse_spec
from fedtrust.rules import rule as build_rule
from fedtrust.server import server_step
from fedtrust.sim.detection import detection_auroc
from fedtrust.sim.store import is_number

#: The ArrayRecord with FedAG's posterior variance, sent beside the model.
POSTERIOR_VAR = "posterior-var"
#: What keys the rules' trust: the node ids the SuperLink assigns, or the names the nodes give.
IDENTITIES = ("node-id", "name")
#: A wait for nodes to connect is logged again every this many seconds, with what to do about a node
#: gone for good.
WAIT_LOG_SECONDS = 60

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


class TrustStrategy(FedAvg):
    """Flower's ``FedAvg`` (sampling, messages, options, hooks) with the aggregation done by a fedtrust rule.

    Takes every option of ``FedAvg`` with its name and default (``fraction_train``, ``fraction_evaluate``,
    ``min_train_nodes``, ``min_evaluate_nodes``, ``min_available_nodes``, ``weighted_by_key``,
    ``arrayrecord_key``, ``configrecord_key``, ``train_metrics_aggr_fn``, ``evaluate_metrics_aggr_fn``),
    and ``start`` is ``FedAvg.start`` (``evaluate_fn``, configs, timeout). Each round the replies become a
    :class:`fedtrust.Round`: updates are the nodes' models minus the global model, ``num_samples`` the
    ``weighted_by_key`` counts, ``metrics`` the MetricRecords (``train_loss_key`` is read as the
    ``train_loss`` ARFL and FOCUS need: the global model's loss on the node's data before training). With a
    ``model`` and a ``benchmark`` (x, y) split the server scores updates on it (``Round.reference``: FOCUS,
    the ``"benchmark"`` loss defence); with ``server_update`` (e.g. :func:`~fedtrust.flower.server_training`
    on its root data) it trains its own update each round (FLTrust's g_0). A rule whose reference the
    strategy cannot build is refused when the strategy is made, as is any option of the wrong kind.

    **Bad replies.** A reply that failed, lacks a key, or has arrays that do not fit is dropped with a
    logged reason and the round goes on with the rest (``FedAvg`` raises ``InconsistentMessageReplies``
    instead); the rule quarantines non-finite updates itself. A round the rule cannot aggregate keeps the
    previous model, returned again so that Flower's result holds it, and logs why.

    **Trust per node.** The round's MetricRecord holds the clients' metrics aggregated by
    ``train_metrics_aggr_fn`` (weighted by ``weighted_by_key``, as ``FedAvg``) and ``trust/<name>`` per
    node, plus ``dropped`` and ``quarantined`` counts (a node metric of one of these names comes as
    ``node/<name>``). A node's name is the one it gives
    (:mod:`fedtrust.flower.replies`: its ``partition-id`` or node config ``node-name`` with
    :func:`~fedtrust.flower.trust_client_app`), else its node id. ``identity`` says what keys the rules'
    reputations: ``"node-id"`` (default: assigned by the SuperLink; with SuperNode authentication bound to
    the node's key, so a node that leaves and rejoins keeps its id and its history) or ``"name"`` (history
    follows the name across new node ids; a name is the node's own claim, so use it where names are
    assigned by whoever runs the nodes). ``corrupted`` names nodes known to be corrupted (experiments: the
    report then scores detection); the rules never see it.

    **Run directory.** ``history`` keeps every round's record; with ``run_dir`` they also go to
    ``rounds.jsonl`` there, with a manifest and a checkpoint after every round
    (:mod:`fedtrust.flower.runlog`), in the simulator's layout: ``fedtrust report`` plots it, and a restarted
    SuperLink running the ServerApp again with the same ``run_dir`` goes on from the checkpoint (model,
    reputations, round number; ``num_rounds`` counts rounds in all).

    **Another loop.** A wrapper whose own ``start`` runs the rounds (Flower's ``DifferentialPrivacy...``
    strategies) calls ``configure_train``/``aggregate_train``/``aggregate_evaluate`` itself: each round's
    record then joins ``history`` when the round is aggregated, its ``metrics`` the nodes' evaluation
    (the server's ``evaluate_fn`` is the wrapper's), and its round 1 begins a new run, as ``start``
    does. A ``run_dir`` is refused there at the first round, before any node trains: its resume,
    manifest and checkpoints are ``start``'s (the wrapper left it empty without a word).

    Rules with an ``observe`` hook (ARFL) get every node's train_loss at the initial model through a QUERY
    round first. For FedAG the posterior variance travels to the nodes as the ``posterior-var``
    ArrayRecord.
    """

    def __init__(
        self,
        rule: str | Any = "fedavg",
        rule_options: dict | None = None,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsAggregation | None = None,
        evaluate_metrics_aggr_fn: MetricsAggregation | None = None,
        train_loss_key: str = "train_loss",
        model: torch.nn.Module | FlatModel | None = None,
        benchmark: tuple[torch.Tensor, torch.Tensor] | None = None,
        server_update: Callable[[ArrayRecord, int], ArrayRecord] | None = None,
        task: str = "classification",
        initial_report: bool = True,
        identity: str = "node-id",
        corrupted: Iterable[str] = (),
        run_dir: str | Path | None = None,
        query_timeout: float = 600.0,
    ) -> None:
        _check_options(locals())
        super().__init__(  # (numpy's scalars as Python's: the manifest is JSON)
            fraction_train=float(fraction_train),
            fraction_evaluate=float(fraction_evaluate),
            min_train_nodes=int(min_train_nodes),
            min_evaluate_nodes=int(min_evaluate_nodes),
            min_available_nodes=int(min_available_nodes),
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            train_metrics_aggr_fn=train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        if isinstance(rule, str):  # a name, or a name with options as the run config writes it
            rule, spec_options = parse_spec(rule)  # ("trimmed_mean(f=0.2)": "trimmed_mean", {"f": 0.2})
            twice = sorted(set(spec_options) & set(rule_options or {}))
            if twice:
                raise ValueError(
                    f"TrustStrategy: option {twice[0]!r} is given both in rule= and rule_options="
                )
            rule_options = {**spec_options, **(rule_options or {})}
        self.rule = build_rule(rule, **(rule_options or {})) if isinstance(rule, str) else rule
        if model is not None and not isinstance(model, FlatModel | torch.nn.Module):
            raise ValueError(
                f"TrustStrategy: model must be a torch.nn.Module (the nodes' model), got {model!r}"
            )
        if model is not None and not isinstance(model, FlatModel):
            model = FlatModel(model, task)
        if benchmark is not None and model is None:
            raise ValueError("TrustStrategy: a benchmark split needs the model to score updates on it")
        if benchmark is not None:
            benchmark = _checked_benchmark(model, benchmark)
        reads = getattr(self.rule, "reads_reference", ())
        rule_name = getattr(self.rule, "name", type(self.rule).__name__)
        if "loss" in reads and benchmark is None:
            raise ValueError(
                f"TrustStrategy: rule {rule_name!r} scores each update on the server's benchmark split; "
                "give model= and benchmark=(x, y)"
            )
        if "update" in reads and server_update is None:
            raise ValueError(
                f"TrustStrategy: rule {rule_name!r} reads the server's own update on its root data each "
                "round; give server_update=, a function (arrays, server_round) -> the arrays after the "
                "server trained them on its root data as a node trains"
            )
        self.server_update = server_update
        self.train_loss_key = train_loss_key
        self.model = model
        self.benchmark = benchmark
        self.initial_report = initial_report
        self.identity = identity
        self.corrupted = {str(c) for c in corrupted}
        self.query_timeout = query_timeout
        given = {"name": rule, **(rule_options or {})} if isinstance(rule, str) else None
        self.run = RunDirectory(run_dir, self._describe(given)) if run_dir else None
        self.layout: ArrayLayout | None = None
        self._own_loop = False  # whether this strategy's start() runs the rounds (not a wrapper's)
        self._fresh_rule = copy.deepcopy(self.rule.state_dict())  # what each start() begins from
        self._begin()

    def _begin(self) -> None:
        """A run's starting point: no rounds, no names, no trust history (the rule's state as it was when
        the strategy was made), so a second ``start`` is a new run, not a continuation of the first."""
        self.rule.load_state_dict(copy.deepcopy(self._fresh_rule))
        self.history: list[dict[str, Any]] = []
        self.names: dict[int, str] = {}  # node id -> the name it last gave
        self.global_vector: torch.Tensor | None = None
        self.posterior_var: torch.Tensor | None = None
        self._observed = False
        self._offset = 0  # rounds done before this start (a resumed run)
        self._pending: dict[str, Any] | None = None
        self._sent: dict[str, list[int]] = {"train": [], "evaluate": []}  # the nodes messaged, by stage

    def _describe(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The manifest's config: the rule as given (by name and options, as the simulator's configs
        name it; a rule object by its name and every option) and the strategy's options."""
        options = ("fraction_train", "fraction_evaluate", "min_train_nodes", "min_evaluate_nodes",
                   "min_available_nodes", "weighted_by_key", "train_loss_key", "identity")  # fmt: skip
        return {
            "rule": given
            or {"name": getattr(self.rule, "name", type(self.rule).__name__), **_options(self.rule)},
            "strategy": {k: getattr(self, k) for k in options},
        }

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> fedtrust: rule %r, trust keyed by %s, train loss key '%s'", self.rule,
            self.identity, self.train_loss_key)  # fmt: skip

    def trust(self, round: int = -1) -> dict[str, float]:
        """Node name -> trust in a round of ``history`` (the last by default): NaN for each node of a round
        the rule refused, where there is no trust to give (the record's ``error`` says why)."""
        record = self.history[round]
        return dict(zip(record["clients"], record["weights"], strict=True))

    # ------------------------------------------------------------------ the run

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """``FedAvg.start``; with a ``run_dir`` that holds rounds already, from its checkpoint on, and the
        result then holds every round's metrics."""
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int) or num_rounds < 0:
            raise ValueError(f"num_rounds must be a whole number >= 0, got {num_rounds!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, Real) or not timeout > 0:  # ("60": nodes
            # trained the first round before Flower's timeout arithmetic failed)
            raise ValueError(f"TrustStrategy.start: timeout must be seconds > 0, got {timeout!r}")
        if not isinstance(initial_arrays, ArrayRecord):
            raise TypeError(
                "TrustStrategy.start: initial_arrays must be a flwr.app.ArrayRecord (for a torch model, "
                f"ArrayRecord(model.state_dict())), got {type(initial_arrays).__name__}"
            )
        self.layout = ArrayLayout(initial_arrays)
        self.layout.check_start(initial_arrays, "TrustStrategy.start: initial_arrays")
        if self.model is not None:
            self.layout.check_model(self.model, "TrustStrategy: model=")
        self._begin()
        with self.run.lock() if self.run else nullcontext():
            done: list[dict[str, Any]] = []
            if self.run is not None:
                done, state = self.run.resume(self.layout.size)
                if len(done) > num_rounds:
                    raise ValueError(
                        f"{self.run.store.dir} holds {len(done)} rounds already; ask for num_rounds >= "
                        f"{len(done)} to go on, or give another run_dir"
                    )
                if state is not None:
                    initial_arrays = self._restore(state)
                    log(INFO, "run_dir %s: resuming after round %d of %d (Flower's log numbers this "
                        "submission's rounds: its round 1 is round %d)", self.run.store.dir, len(done),
                        num_rounds, len(done) + 1)  # fmt: skip
            source = "server" if evaluate_fn is not None else "nodes"  # of each round's metrics
            if self.run is not None:
                source = self.run.start(num_rounds, done, source)  # a resumed run keeps its first session's
            self.history, self._offset = list(done), len(done)
            self._own_loop = True
            try:
                result = super().start(grid, initial_arrays, num_rounds - len(done), timeout, train_config,
                                       evaluate_config, self._end_of_round(evaluate_fn, source))  # fmt: skip
            except BaseException as error:  # noqa: BLE001 - recorded, then raised again
                if self.run is not None:
                    self.run.interrupt(self.history, num_rounds, error)
                raise
            finally:
                self._own_loop = False
            self._warn_unseen_corrupted()
            if self.run is not None:
                self.run.finish(self.history, num_rounds)
        return self._whole(result, initial_arrays, done)

    def _warn_unseen_corrupted(self) -> None:
        """A ``corrupted`` name no node of the run's rounds had (a partition id beyond the federation, a
        misspelt node) would leave the detection scores with nothing to score, silently: logged."""
        seen = {name for record in self.history for name in record.get("clients", [])}
        unseen = sorted(self.corrupted - seen)
        if unseen and self.history:
            log(WARNING, "corrupted=: no node of this run's %d rounds was named %s (the nodes were %s): the "
                "detection scores (AUROC) leave them out", len(self.history),
                ", ".join(unseen), ", ".join(sorted(seen)) or "none")  # fmt: skip

    def _restore(self, state: dict[str, Any]) -> ArrayRecord:
        self.rule.load_state_dict(state["rule_state"])
        self.names = dict(state["names"])
        self.posterior_var = state["posterior_var"]
        self._observed = True
        return self.layout.unflatten(state["vector"])

    def _whole(self, result: Result, start: ArrayRecord, done: list[dict[str, Any]]) -> Result:
        """``FedAvg.start``'s result with its rounds numbered from the first round of the run, the rounds
        done before this start read back from their records, and the model it started from when no
        round ran."""
        whole = Result(arrays=result.arrays if len(result.arrays) else start)
        for record in done:
            for key, name in (("train_metrics", "train_metrics_clientapp"),
                              ("evaluate_metrics", "evaluate_metrics_clientapp"),
                              ("server_metrics", "evaluate_metrics_serverapp")):  # fmt: skip
                if record.get(key) is not None:
                    getattr(whole, name)[record["round"]] = MetricRecord(record[key])
        for name in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
            for r, metrics in getattr(result, name).items():
                getattr(whole, name)[r + self._offset if r else 0] = metrics
        return whole

    def _end_of_round(self, evaluate_fn, source: str):
        """Flower calls this after each round's evaluation (and once before the first): the server-side
        evaluation, then the round's record and checkpoint."""

        def end_of_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            t = server_round + self._offset
            metrics = None
            if evaluate_fn is not None and (server_round > 0 or self._offset == 0):
                metrics = evaluate_fn(t, arrays)
            if server_round > 0:
                self._commit(t, metrics, source)
            elif metrics is not None and self.run is not None:
                self.run.store.update_manifest(initial_metrics=dict(metrics))
            return metrics

        return end_of_round

    def _commit(self, t: int, server_metrics: MetricRecord | None, source: str) -> None:
        """Round ``t``'s record and checkpoint. Its ``metrics`` (the report's curve and final number) come
        from one ``source`` for the whole run: the server's evaluation where ``start`` has an
        ``evaluate_fn`` (None in a round it does not score), else the nodes' aggregated evaluation; a
        resumed run keeps its first session's source (:meth:`RunDirectory.start`). Taken round by round, a
        run scored by the server every other round read 0.900 (nodes), 0.922 (server), 0.900 (nodes) as
        one curve. Both stay in the record (``server_metrics``, ``evaluate_metrics``)."""
        record, self._pending = self._pending or _empty_record(t), None
        if server_metrics is not None:
            record["server_metrics"] = dict(server_metrics)
        record["metrics"] = record.get("server_metrics" if source == "server" else "evaluate_metrics")
        record["metrics_source"] = source
        self.history.append(record)
        if self.run is not None:
            self.run.commit(record, {
                "round": t, "vector": self.global_vector, "rule_state": self.rule.state_dict(),
                "names": dict(self.names), "posterior_var": self.posterior_var})  # fmt: skip

    # ------------------------------------------------------------------ training

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self._own_loop and self.run is not None:
            raise ValueError(
                f"TrustStrategy(run_dir={str(self.run.store.dir)!r}): the run directory is written by "
                "TrustStrategy.start, and another loop runs these rounds (a wrapper's start, such as "
                "Flower's DifferentialPrivacy strategies', or calls of one's own): it would stay empty. "
                "Drop run_dir there (the rounds' records stay in the strategy's history), or run "
                "TrustStrategy.start itself"
            )
        if not self._own_loop and server_round == 1:  # another loop's new run (a wrapper's second start
            self._begin()  # appended to the first's history and went on from its reputations)
        t = server_round + self._offset
        self.layout = self.layout or ArrayLayout(arrays)  # start's; one built here for a loop of one's own
        self.global_vector = self.layout.flatten(arrays)
        self._await_nodes(grid, self.fraction_train)
        messages = list(super().configure_train(t, arrays, config, grid))
        self._sent["train"] = [m.metadata.dst_node_id for m in messages]
        if self.initial_report and hasattr(self.rule, "observe") and not self._observed and messages:
            self._report_all(arrays, grid)
        return self._with_posterior(messages)

    def _await_nodes(self, grid: Grid, fraction: float) -> None:
        """Wait until ``min_available_nodes`` are connected, unless ``fraction`` is 0 (FedAvg samples no
        one then, and waits for no one). Flower's FedAvg sizes its sample from the nodes connected
        *before* it waits for them (flwr 1.41 ``configure_train``: ``fraction_train=1.0`` with two of four
        SuperNodes up sampled two, and the other two missed the round); waiting first makes the fraction
        one of the nodes it then samples from."""
        if fraction == 0:
            return
        waited = 0
        while (connected := len(list(grid.get_node_ids()))) < self.min_available_nodes:
            if waited % WAIT_LOG_SECONDS == 0:
                remedy = (
                    f", {waited} s: if a node is gone for good, stop the run and submit it again with "
                    "a lower min_available_nodes and the same run_dir; it goes on from its last round"
                )
                log(INFO if not waited else WARNING, "Waiting for %d nodes to connect (%d so far%s)",
                    self.min_available_nodes, connected, remedy if waited else "")  # fmt: skip
            waited += 1
            time.sleep(1)

    def _with_posterior(self, messages: list[Message]) -> list[Message]:
        if self.posterior_var is not None and self.layout is not None:
            for message in messages:
                message.content[POSTERIOR_VAR] = self.layout.unflatten(self.posterior_var)
        return messages

    def _key(self, reply: Reply) -> int | str:
        return reply.name if self.identity == "name" else reply.node

    def _report_all(self, arrays: ArrayRecord, grid: Grid) -> None:
        """Every connected node's train_loss at the current model, for the rule's ``observe`` hook."""
        nodes = list(grid.get_node_ids())
        query = RecordDict(
            {
                self.arrayrecord_key: arrays,
                self.configrecord_key: ConfigRecord({"query": self.train_loss_key}),
            }
        )
        replies = grid.send_and_receive(
            self._construct_messages(query, nodes, MessageType.QUERY), timeout=self.query_timeout
        )
        accepted, dropped = screen(replies, self.weighted_by_key, (self.train_loss_key,),
                                   by_name=self.identity == "name", known=self.names, sent=nodes)  # fmt: skip
        self.names.update({r.node: r.name for r in accepted})
        for name, reason in dropped.items():
            log(WARNING, "initial report: dropped node %s: %s", name, reason)
        # in the rounds' dtype, so a report the rounds would quarantine (a count or a loss beyond it) is
        # left out here too, rather than recorded once and weighed every round after; named with the value
        # the node sent (read into the dtype, 1e300 would be logged as inf)
        dtype = self._round_dtype
        limit, kind = torch.finfo(dtype).max, str(dtype).removeprefix("torch.")
        left_out = {}
        for r in accepted:
            for key in (self.weighted_by_key, self.train_loss_key):
                if math.isfinite(value := r.number(key)) and abs(value) > limit:
                    left_out.setdefault(self._key(r), f"{key}={value!r} overflows {kind} (max {limit:.3g})")
        accepted = [r for r in accepted if self._key(r) not in left_out]
        if accepted:
            left_out |= (
                self.rule.observe(
                    [self._key(r) for r in accepted],
                    torch.tensor([r.number(self.weighted_by_key) for r in accepted], dtype=dtype),
                    {
                        "train_loss": torch.tensor(
                            [r.number(self.train_loss_key) for r in accepted], dtype=dtype
                        )
                    },
                )
                or {}
            )
        for key, reason in left_out.items():
            log(WARNING, "initial report: left out node %s: %s", key, reason)
        if accepted:
            log(INFO, "initial report: %s from %d nodes", self.train_loss_key, len(accepted))
        self._observed = True

    def _reference(self, t: int) -> ServerReference | None:
        if self.benchmark is None and self.server_update is None:
            return None
        return ServerReference(self, t)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        out = self._aggregate_train(server_round + self._offset, replies)
        if not self._own_loop:  # no end-of-round call will come: the record joins the history now, and
            # stays pending for the round's aggregate_evaluate, whose metrics are then the record's
            record = self._pending
            record["metrics"], record["metrics_source"] = record.get("evaluate_metrics"), "nodes"
            self.history.append(record)
        return out

    def _aggregate_train(self, t: int, replies: Iterable[Message]) -> tuple[ArrayRecord, MetricRecord]:
        replies = list(replies)
        required = [
            self.train_loss_key if k == "train_loss" else k for k in getattr(self.rule, "requires", ())
        ]
        accepted, dropped = screen(replies, self.weighted_by_key, required, self.layout,
                                   self.identity == "name", self.names, self._sent["train"])  # fmt: skip
        log(INFO, "aggregate_train: %d replies, %d dropped", len(replies), len(dropped))
        for name, reason in dropped.items():
            log(WARNING, "aggregate_train: dropped the reply of %s: %s", name, reason)
        self.names.update({r.node: r.name for r in accepted})
        names = display_names(accepted)
        record = self._pending = _empty_record(t)
        record.update(
            received=len(replies), dropped=dropped, clients=names, node_ids=[r.node for r in accepted]
        )
        if not replies and not self._sent["train"]:  # FedAvg asked no one: fraction_train is 0
            record["skipped"] = f"no node was asked to train (fraction_train={self.fraction_train:g})"
            log(INFO, "aggregate_train: round %d: %s", t, record["skipped"])
            return self._unchanged(record)
        if not accepted:
            return self._keep(record, "no usable reply")
        counts = [r.number(self.weighted_by_key) for r in accepted]
        metrics = {
            k: [r.number(k) for r in accepted] for k in numbers_in_all(accepted, but=self.weighted_by_key)
        }
        if self.train_loss_key in metrics:
            metrics["train_loss"] = metrics[self.train_loss_key]
        round_ = Round(
            updates=torch.stack([r.vector for r in accepted]) - self.global_vector,
            client_ids=[self._key(r) for r in accepted],
            num_samples=counts,
            metrics=metrics,
            reference=self._reference(t),
        )
        step = server_step(self.rule, round_, self.global_vector, lambda delta: self.global_vector + delta)
        corrupted = [name in self.corrupted for name in names]
        by_name = {str(self._key(r)): name for r, name in zip(accepted, names, strict=True)}
        sent = {str(self._key(r)): r for r in accepted}
        quarantined = {
            by_name.get(str(k), str(k)): self._overflowed(sent.get(str(k))) or reason
            for k, reason in step.quarantined.items()
        }
        record.update(num_samples=counts, corrupted=corrupted, weights=step.weights,
                      train_loss=metrics.get("train_loss"), quarantined=quarantined, info=step.info,
                      auroc=None if step.error else detection_auroc(step.weights, corrupted))  # fmt: skip
        if not step.applied:
            return self._keep(record, step.error)
        if "posterior_var" in step.aggregate.info:
            self.posterior_var = step.aggregate.info["posterior_var"].detach().float()
        if step.warning is not None:  # the rule's estimator stopped at max_iter before converging
            record["warning"] = step.warning
            log(WARNING, "aggregate_train: round %d: %s", t, step.warning)
        self.global_vector = step.vector
        kept = [r for r in accepted if str(self._key(r)) not in step.quarantined]
        aggregated = self._aggregate_metrics(kept, self.train_metrics_aggr_fn, "aggregate_train")
        trust = {f"trust/{name}": w for name, w in zip(names, step.weights, strict=True)}
        own = {**trust, "dropped": len(dropped), "quarantined": len(step.quarantined)}
        out = {**_beside(aggregated, own, t), **own}
        record["train_metrics"] = out
        return self.layout.unflatten(step.vector), MetricRecord(out)

    @property
    def _round_dtype(self) -> torch.dtype:
        """The dtype the rounds' updates and counts are read into (the model's; float32 before it is
        known): a count or a loss beyond it is quarantined."""
        return self.layout.dtype if self.layout is not None else torch.float32

    def _overflowed(self, reply: Reply | None) -> str | None:
        """Why a quarantined reply's update held infinities its arrays did not (finite values beyond the
        model's dtype, which overflowed when read): the rule's reason ("non-finite entries") would blame
        the client for values it never sent. None where nothing overflowed."""
        if reply is None:
            return None
        (record,) = reply.content.array_records.values()
        return self.layout.overflow(record)

    def _keep(self, record: dict[str, Any], error: str) -> tuple[ArrayRecord, MetricRecord]:
        """A round with nothing to apply: the previous model again (Flower's result would otherwise hold no
        arrays), and why."""
        log(WARNING, "aggregate_train: round %d: the global model stays: %s", record["round"], error)
        record["error"] = error
        return self._unchanged(record)

    def _unchanged(self, record: dict[str, Any]) -> tuple[ArrayRecord, MetricRecord]:
        """The previous model again, for a round that failed (:meth:`_keep`) or trained no one."""
        record["train_metrics"] = {"dropped": len(record["dropped"])}
        return self.layout.unflatten(self.global_vector), MetricRecord(record["train_metrics"])

    def _aggregate_metrics(self, accepted: list[Reply], aggregate: MetricsAggregation, where: str) -> dict:
        """The replies' MetricRecords through Flower's aggregation function (``FedAvg``'s by default), each
        metric over the replies holding it in the form most give (all of them at once when they agree, and
        with a function of the user's, once, on the metrics every reply holds in one form:
        :func:`~fedtrust.flower.replies.metric_groups`); a reply holding a non-finite number is left out
        (one NaN loss would make the round's NaN), and so is one whose count is beyond the rounds' dtype,
        as training quarantines it (two nodes claiming 1e308 examples made the total inf, and every
        weighted metric inf / inf, which Flower's FedAvg reported as 0.0); nothing when the counts sum to
        zero (nothing to weight by)."""
        dtype = self._round_dtype
        limit, kind = float(torch.finfo(dtype).max), str(dtype).removeprefix("torch.")
        finite = [r for r in accepted if _finite_metrics(r.metrics)]
        if len(finite) < len(accepted):
            left = [r.name for r in accepted if r not in finite]
            log(WARNING, "%s: replies with a non-finite metric left out of the metrics: %s", where, left)
        usable = [r for r in finite if r.number(self.weighted_by_key) <= limit]
        if len(usable) < len(finite):
            left = [r.name for r in finite if r not in usable]
            log(WARNING, "%s: replies with %s beyond %s's range (%.3g) left out of the metrics: %s",
                where, self.weighted_by_key, kind, limit, left)  # fmt: skip
        accepted = usable
        if not accepted or sum(r.number(self.weighted_by_key) for r in accepted) <= 0:
            log(WARNING, "%s: every reply has %s = 0; no metrics to aggregate", where, self.weighted_by_key)
            return {}
        groups, left_out = metric_groups(accepted, self.weighted_by_key, aggregate is aggregate_metricrecords)
        # metrics averaged for no reply (one node's extra key), apart from those averaged without some
        gone = sorted(k for k, names in left_out.items() if len(names) == len(accepted))
        if partly := {k: names for k, names in left_out.items() if k not in gone}:
            log(WARNING, "%s: metrics some replies do not hold in the form most give were averaged without "
                "them (metric: the replies left out): %s", where, partly)  # fmt: skip
        if gone:  # (they were listed with every reply as left out, as if the others had failed them)
            log(WARNING, "%s: metrics that no more than half the replies hold in one form are not the "
                "round's: %s", where, gone)  # fmt: skip
        metrics: dict[str, Any] = {}
        for contents in groups:  # (one group unless the replies disagree)
            metrics.update(aggregate(contents, self.weighted_by_key))
        return metrics

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._await_nodes(grid, self.fraction_evaluate)
        messages = list(super().configure_evaluate(server_round + self._offset, arrays, config, grid))
        self._sent["evaluate"] = [m.metadata.dst_node_id for m in messages]
        return self._with_posterior(messages)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """``evaluate_metrics_aggr_fn`` over the usable replies (unusable ones skipped and logged)."""
        accepted, dropped = screen(
            replies, self.weighted_by_key, known=self.names, sent=self._sent["evaluate"]
        )
        for name, reason in dropped.items():
            log(WARNING, "aggregate_evaluate: dropped the reply of %s: %s", name, reason)
        if not accepted:
            return None
        metrics = self._aggregate_metrics(accepted, self.evaluate_metrics_aggr_fn, "aggregate_evaluate")
        if self._pending is not None:
            self._pending["evaluate_metrics"] = metrics
            if not self._own_loop:  # the record is in the history already (aggregate_train)
                self._pending["metrics"] = metrics
        return MetricRecord(metrics)


class ServerReference:
    """``Round.reference`` of a Flower round (:class:`~fedtrust.aggregators.info.Reference`): an update's
    loss on the strategy's benchmark split, and the server's own update (``server_update``, called at most
    once a round, when a rule asks: FLTrust's g_0)."""

    def __init__(self, strategy: TrustStrategy, t: int):
        self.strategy, self.t, self.start = strategy, t, strategy.global_vector
        self.size = 1 if strategy.benchmark is None else len(strategy.benchmark[1])
        self._update: torch.Tensor | None = None

    def __call__(self, update: torch.Tensor) -> torch.Tensor:  # on the model's device, read by the rule
        s = self.strategy
        if s.model is None or s.benchmark is None:
            raise RoundRefused("the strategy holds no benchmark split to score updates on (benchmark=)")
        bx, by = s.benchmark
        with torch.no_grad():
            return s.model.loss(self.start + update, bx, by)

    def update(self) -> torch.Tensor:
        if self._update is None:
            s = self.strategy
            if s.server_update is None:
                raise RoundRefused("the strategy trains no update of its own (server_update=)")
            try:
                trained = s.layout.flatten(s.server_update(s.layout.unflatten(self.start), self.t))
            except MalformedReply as exc:
                raise RoundRefused(
                    f"server_update returned arrays that do not fit the model: {exc}"
                ) from None
            self._update = trained - self.start
        return self._update


def _beside(metrics: dict[str, Any], own: dict[str, Any], t: int) -> dict[str, Any]:
    """The nodes' aggregated ``metrics`` beside the strategy's ``own`` (trust per node, counts): a node
    metric of one of their names is kept as ``node/<name>``, and the round logs it (it was overwritten
    without a word)."""
    clash = sorted(k for k in metrics if k in own)
    if not clash:
        return metrics
    log(WARNING, "aggregate_train: round %d: the nodes' metrics %s are named as the strategy's own; they "
        "are reported as %s", t, clash, [f"node/{k}" for k in clash])  # fmt: skip
    return {(f"node/{k}" if k in own else k): v for k, v in metrics.items()}


def _finite_metrics(metrics: dict[str, Any]) -> bool:
    values = [v for v in metrics.values() if is_number(v)]
    values += [x for v in metrics.values() if isinstance(v, list) for x in v if isinstance(x, int | float)]
    return all(math.isfinite(v) for v in values)


def _empty_record(t: int) -> dict[str, Any]:
    return {"round": t, "received": 0, "dropped": {}, "clients": [], "node_ids": [], "num_samples": [],
            "corrupted": [], "weights": [], "train_loss": None, "auroc": None, "quarantined": {}, "info": {},
            "error": None, "skipped": None, "metrics": None}  # fmt: skip


def _options(rule: Any) -> dict[str, Any]:
    options = getattr(rule, "options", None)
    return dict(options()) if callable(options) else {}


def _checked_benchmark(model: FlatModel, benchmark: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark split as (x, y) tensors the model scores, refused naming what is wrong (before any
    node trains: a malformed split failed inside the model in the first round)."""
    if not isinstance(benchmark, tuple | list) or len(benchmark) != 2:
        raise ValueError(
            f"TrustStrategy: benchmark must be a pair (x, y) of arrays, got {type(benchmark).__name__}"
        )
    try:
        x, y = (torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b) for b in benchmark)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"TrustStrategy: benchmark (x, y) must be arrays ({exc})") from None
    if x.dim() < 1 or y.dim() < 1 or len(x) != len(y) or len(x) == 0:
        raise ValueError(f"TrustStrategy: benchmark needs one label per row of x, got x of shape "
                         f"{tuple(x.shape)} and y of shape {tuple(y.shape)}")  # fmt: skip
    if model.task == "classification" and (y.is_floating_point() or y.dtype == torch.bool):
        raise ValueError(f"TrustStrategy: benchmark labels must be integer classes, got {y.dtype}")
    x = x.float() if not x.is_floating_point() else x
    try:
        with torch.no_grad():
            state = model.module.state_dict()
            vector = torch.cat([state[k].detach().reshape(-1) for k in model.names])
            loss = float(model.loss(vector, x, y))
    except (RuntimeError, IndexError, ValueError) as exc:
        raise ValueError(f"TrustStrategy: the model cannot score the benchmark split (x of shape "
                         f"{tuple(x.shape)}, y {tuple(y.shape)}): {exc}") from None  # fmt: skip
    if not math.isfinite(loss):
        raise ValueError(
            f"TrustStrategy: the model's loss on the benchmark split is {loss} (non-finite data?)"
        )
    return x, y


def _check_options(given: dict[str, Any]) -> None:
    """FedAvg's options as it documents them, and fedtrust's, refused by name when out of range or of the
    wrong kind (before any node trains)."""
    rule = given["rule"]
    if not (isinstance(rule, str) or (callable(rule) and not isinstance(rule, type))):
        raise ValueError(f"TrustStrategy: rule must be a rule name or a fedtrust rule object, got {rule!r} "
                         "(FedAvg's options are keyword arguments here: fraction_train=...)")  # fmt: skip
    if given["rule_options"] is not None and not isinstance(given["rule_options"], dict):
        raise ValueError(
            f"TrustStrategy: rule_options must be a dict of options, got {given['rule_options']!r}"
        )
    if given["rule_options"] and not isinstance(rule, str):
        raise ValueError(
            "TrustStrategy: rule_options go with a rule name; a rule object holds its own options"
        )
    for key in ("train_metrics_aggr_fn", "evaluate_metrics_aggr_fn", "server_update"):
        if given[key] is not None and not callable(given[key]):
            raise ValueError(f"TrustStrategy: {key} must be a function or None, got {given[key]!r}")
    if not isinstance(given["initial_report"], bool):
        raise ValueError(
            f"TrustStrategy: initial_report must be True or False, got {given['initial_report']!r}"
        )
    if not isinstance(given["corrupted"], Iterable):
        raise ValueError(f"TrustStrategy: corrupted must be a list of node names, got {given['corrupted']!r}")
    if isinstance(given["corrupted"], str | bytes):
        raise ValueError(f"TrustStrategy: corrupted must be a list of node names, got the string "
                         f"{given['corrupted']!r}")  # fmt: skip
    run_dir = given["run_dir"]
    if run_dir is not None and not isinstance(run_dir, str | Path):
        raise ValueError(f"TrustStrategy: run_dir must be a path, got {run_dir!r}")
    if run_dir and not Path(run_dir).expanduser().is_absolute():
        raise ValueError(f"TrustStrategy: run_dir must be an absolute path, got {str(run_dir)!r}: the "
                         "ServerApp runs in the SuperLink's working directory, not flwr run's")  # fmt: skip
    for key in ("fraction_train", "fraction_evaluate"):  # numpy's scalars too, as FedAvg takes them
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, Real) or not 0.0 <= value <= 1.0:
            raise ValueError(f"TrustStrategy: {key} must be a fraction in [0, 1], got {value!r} "
                             f"({type(value).__name__})")  # fmt: skip
    for key in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
        value = given[key]
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
            raise ValueError(f"TrustStrategy: {key} must be a whole number >= 0, got {value!r} "
                             f"({type(value).__name__})")  # fmt: skip
    for key in ("weighted_by_key", "arrayrecord_key", "configrecord_key", "train_loss_key"):
        if not isinstance(given[key], str) or not given[key]:
            raise ValueError(f"TrustStrategy: {key} must be a non-empty string, got {given[key]!r}")
    if given["identity"] not in IDENTITIES:
        raise ValueError(f"TrustStrategy: identity must be one of {IDENTITIES}, got {given['identity']!r}")
    timeout = given["query_timeout"]
    if isinstance(timeout, bool) or not (isinstance(timeout, int | float) and math.isfinite(timeout)
            and timeout > 0):  # fmt: skip
        raise ValueError(f"TrustStrategy: query_timeout must be seconds > 0, got {timeout!r}")
