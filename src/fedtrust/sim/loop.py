"""The federated loop: sample clients, train locally, attack, aggregate by a rule, step, evaluate, record."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedtrust.aggregators import Round
from fedtrust.attacks import AttackContext, sent_by
from fedtrust.models import FlatModel
from fedtrust.seeding import stream
from fedtrust.server import server_step
from fedtrust.sim.batched import Stacked, batched_local_sgd, batched_minibatch_gradients, mean_losses
from fedtrust.sim.detection import detection_auroc
from fedtrust.sim.evaluation import Evaluation, default_evaluation
from fedtrust.sim.federation import Federation
from fedtrust.sim.settings import TrainSettings, resolve_device
from fedtrust.sim.store import RecoveryWarning, RunStore, interruption, now
from fedtrust.sim.training import local_sgd, mean_loss, minibatch_gradient


@dataclass(frozen=True)
class Lie:
    """Corrupted clients report ``value`` for ``metric`` instead of the truth (e.g. a tiny training loss)."""

    metric: str = "train_loss"
    value: float = 0.0


class BenchmarkReference:
    """``Round.reference`` in the simulator: the server's benchmark split (``data.benchmark``). Called
    with an update, the mean loss on the split of the model that update gives (FOCUS's eq 4);
    :meth:`update` is the server's own update this round, trained on the split exactly as a client
    trains (FLTrust's root-data update g_0), from the stream (seed, "server", round), computed on first
    use and kept for the round."""

    def __init__(self, sim: Simulation, t: int):
        self.sim, self.t = sim, t
        self.x, self.y = sim.fed.benchmark
        self.size = len(self.y)
        self._update: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, update: torch.Tensor) -> torch.Tensor:  # on the model's device, read by the rule
        return self.sim.model.loss(self.sim._after(update), self.x, self.y)

    def update(self) -> torch.Tensor:
        if self._update is None:
            self._update = self.sim.train(self.x, self.y, stream(self.sim.seed, "server", self.t))
        return self._update


class Simulation:
    """One simulated run. Clients report ``train_loss``: the mean loss of the global model they received
    on their local training data, measured before local training (ARFL's L_i, FOCUS's LL^k), when the
    rule reads it, liars misreport a loss, or ``train.report_loss`` is ``always`` (a forward pass over
    every client's data; otherwise the round records None). The round's
    ``reference`` (when the server holds a benchmark split) maps an update to the benchmark loss of the
    model that update would produce.

    Every random choice comes from a stream keyed by (seed, purpose, round, client), so a resumed run is
    identical to an uninterrupted one. ``evaluation`` scores the global model (see
    :mod:`fedtrust.sim.evaluation`; by default the test-set metrics, or FedAG's predictive scores).
    """

    def __init__(
        self,
        federation: Federation,
        model: FlatModel,
        rule,
        settings: TrainSettings,
        seed: int = 0,
        attack=None,
        lie: Lie | None = None,
        evaluation: Evaluation | None = None,
        device: torch.device | None = None,
    ):
        #: where the models, the clients' data and the rounds live (``train.device``, or ``device``)
        self.device = resolve_device(settings.device) if device is None else torch.device(device)
        federation = federation.to(self.device)
        self.fed = federation
        self.model = model
        self.rule = rule
        self.settings = settings
        self.seed = seed
        self.attack = attack
        self.lie = lie
        self.initial = model.init(seed).to(self.device)  # drawn on the CPU: the same start everywhere
        self.vector = self.initial.clone()
        self.evaluation = evaluation or default_evaluation(model, federation, settings, seed)
        self.failure: str | None = None  # why the last run failed (see run), None when it did not
        # how the last round's global model diverged ("went non-finite", or its outputs did), or None
        self.diverged: str | None = None
        convolutional = any(isinstance(m, torch.nn.Conv2d) for m in model.module.modules())
        if settings.executor == "batched" and model.num_buffers:
            raise ValueError(
                f"train.executor: 'batched' cannot train model {model.name!r}: it has running statistics "
                "(batch norm) that a vmapped forward cannot update; use 'loop' or 'auto'"
            )
        self.batched = settings.executor == "batched" or (
            settings.executor == "auto" and not convolutional and not model.num_buffers
        )
        self._stacked = Stacked(federation.data) if self.batched else None
        self.report_loss = (
            settings.report_loss == "always"
            or "train_loss" in getattr(rule, "requires", ())
            or lie is not None  # liars misreport a loss: honest clients report theirs
        )

    @property
    def rounds(self) -> int:
        return self.settings.rounds_run

    # ------------------------------------------------------------------ one round

    def _after(self, update: torch.Tensor) -> torch.Tensor:
        """The global vector this update (or aggregate) leads to."""
        s = self.settings
        if s.mode == "gradient":
            return self.vector - s.lr * s.server_lr * update
        if s.mode == "one_round":
            return self.initial + update
        return self.vector + s.server_lr * update

    def sample(self, t: int) -> list[int]:
        k = self.fed.num_clients
        m = self.settings.clients_per_round(k)
        return sorted(torch.randperm(k, generator=stream(self.seed, "sample", t))[:m].tolist())

    def local_updates(self, t: int, chosen: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each chosen client's honest update and its reported train_loss (None unless ``report_loss``;
        corrupted clients whose attack ignores their own update skip the training, unless every chosen
        client is corrupted: an attack that reads the benign updates then reads theirs, as
        :class:`~fedtrust.attacks.AttackContext` falls back to every client's, and they must be real)."""
        s = self.settings
        start = self.initial if s.mode == "one_round" else self.vector
        updates = torch.zeros(len(chosen), self.model.size, device=self.device)
        some_benign = not bool(self.fed.corrupted[chosen].all())
        idle = self.attack is not None and not getattr(self.attack, "uses_own_update", True) and some_benign
        train = [i for i, k in enumerate(chosen) if not (idle and bool(self.fed.corrupted[k]))]
        if self.batched:
            losses = None
            if self.report_loss:
                losses = mean_losses(self.model, self.vector, self._stacked.select(chosen))
            if train:
                data = self._stacked.select([chosen[i] for i in train])
                gens = [stream(self.seed, "train", t, chosen[i]) for i in train]
                if s.mode == "gradient":
                    updates[train] = batched_minibatch_gradients(
                        self.model, self.vector, data, s.batch_size, gens
                    )
                else:
                    new = batched_local_sgd(
                        self.model, start, data, s.local_epochs, s.batch_size, s.lr, s.weight_decay, gens
                    )
                    updates[train] = new - start
            return updates, losses
        losses = torch.empty(len(chosen), device=self.device) if self.report_loss else None
        for i, k in enumerate(chosen):
            x, y = self.fed.data[k]
            if losses is not None:
                with torch.no_grad():  # written where it is computed: no read (a GPU sync) a client
                    losses[i] = self.model.loss(self.vector, x, y)
            if i not in train:
                continue
            updates[i] = self.train(x, y, stream(self.seed, "train", t, k))
        return updates, losses

    def train(self, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """One party's honest update on (x, y) this round, as a client computes it (the per-client
        executor): a minibatch gradient, or the local SGD delta from the global model."""
        s = self.settings
        if s.mode == "gradient":
            return minibatch_gradient(self.model, self.vector, x, y, s.batch_size, g, step=s.lr * s.server_lr)
        start = self.initial if s.mode == "one_round" else self.vector
        new = local_sgd(self.model, start, x, y, s.local_epochs, s.batch_size, s.lr, s.weight_decay, g)
        return new - start

    def initial_report(self) -> None:
        """Every client reports its train_loss at the initial model (liars lie here too), for rules
        with an ``observe`` hook (ARFL's Algorithm 1, line 1)."""
        losses = torch.tensor([mean_loss(self.model, self.vector, x, y) for x, y in self.fed.data])
        if self.lie is not None and self.lie.metric == "train_loss":
            losses[self.fed.corrupted] = self.lie.value
        self.rule.observe(list(self.fed.ids), self.fed.sizes(), {"train_loss": losses})

    def client_round(self, t: int, chosen: list[int]) -> Round:
        """What the server receives in round ``t`` from the ``chosen`` clients: their updates (the
        corrupted clients' replaced by the attack's), reported metrics (liars' misreported) and, when the
        server holds a benchmark split, the round's ``reference``."""
        updates, losses = self.local_updates(t, chosen)
        bad = self.fed.corrupted[chosen]
        metrics = {} if losses is None else {"train_loss": losses.clone()}
        if self.lie is not None and bool(bad.any()):
            metrics.setdefault(self.lie.metric, losses.clone())[bad] = self.lie.value
        reference = self.reference(t)
        sizes = self.fed.sizes()
        ids, counts = [self.fed.ids[k] for k in chosen], [sizes[k] for k in chosen]
        if self.attack is not None and bool(bad.any()):

            def aggregate(sent: torch.Tensor) -> torch.Tensor:
                """The server's rule (a copy: its state is not touched) on what it would receive."""
                round_ = Round(updates=sent, client_ids=ids, num_samples=counts, metrics=metrics,
                               reference=reference)  # fmt: skip
                return copy.deepcopy(self.rule)(round_).vector

            ctx = AttackContext(
                updates,
                bad.to(self.device),
                self.vector,
                self.settings.mode,
                stream(self.seed, "attack", t),
                t,
                aggregate,
                self.settings.server_lr,
            )
            updates[bad] = sent_by(self.attack, ctx).to(updates.dtype)
        return Round(
            updates=updates, client_ids=ids, num_samples=counts, metrics=metrics, reference=reference
        )

    def reference(self, t: int) -> BenchmarkReference | None:
        """Round ``t``'s reference (the server's benchmark split), or None when the server holds none."""
        return None if self.fed.benchmark is None else BenchmarkReference(self, t)

    def step(self, t: int) -> dict[str, Any]:
        """One round: sample, the clients' round, the server step (:func:`fedtrust.server.server_step`),
        the evaluation; returns the round's record."""
        began = time.perf_counter()
        chosen = self.sample(t)
        round_ = self.client_round(t, chosen)
        rule_began = time.perf_counter()
        before = self.initial if self.settings.mode == "one_round" else self.vector
        result = server_step(self.rule, round_, self.vector, self._after)
        self.vector = result.vector
        self.diverged = "went non-finite" if result.diverged else None
        if result.applied:
            self.evaluation.observe(t, self.vector, result.aggregate, before + round_.updates, chosen)
        rule_seconds = time.perf_counter() - rule_began
        evaluated = None
        if t == self.rounds or t % self.settings.eval_every == 0:
            evaluated = self.evaluation(t, self.vector)
            overflow = [k for k in ("loss", "rmse") if not math.isfinite((evaluated or {}).get(k, 0.0))]
            if overflow and self.diverged is None:  # finite weights whose outputs overflow: no usable model
                self.diverged = f"gave a non-finite test {overflow[0]} (its outputs overflow)"
        corrupted = self.fed.corrupted[chosen].tolist()
        losses = round_.metrics.get("train_loss")
        sizes = self.fed.sizes()
        return {
            "round": t,
            "metrics": evaluated,
            "clients": list(round_.client_ids),
            "num_samples": [sizes[k] for k in chosen],
            "corrupted": corrupted,
            "weights": result.weights,
            "train_loss": None if losses is None else losses.tolist(),
            "auroc": None if result.error else detection_auroc(result.weights, corrupted),
            "quarantined": result.quarantined,
            "info": result.info,
            "error": result.error,
            "rule_seconds": rule_seconds,
            "seconds": time.perf_counter() - began,
        }

    # ------------------------------------------------------------------ the whole run

    def run(
        self,
        store: RunStore | None = None,
        manifest: dict | None = None,
        on_round: Callable[[dict], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run every round; with a ``store``, write results as they come, checkpoint, and resume where an
        interrupted run stopped (a finished run whose files read back is not run again). Damaged files
        are not trusted: the run resumes from the newest checkpoint that reads back and that its round
        records reach (or from the start), and says so in the manifest (``recovered``) and a warning.

        The run *fails* (``failure`` says why, the manifest's status is ``failed``) when no round could
        be aggregated, or when the global model went non-finite (it stops there)."""
        began = time.perf_counter()
        self.failure = None
        records: list[dict[str, Any]] = []
        first = 1
        stored: dict[str, Any] = {}
        if store is not None:
            finished = store.finished_rounds(self.rounds)
            if finished is not None:
                return finished
            # what an earlier session ended with is not this one's: a session killed hard must not leave a
            # running manifest with a failed session's final metrics
            stale = ("error", "traceback", "interrupted", "final", "finished", "not_aggregated")
            stored = {k: v for k, v in (store.manifest() or {}).items() if k not in stale}
            if not stored and any(p.exists() for p in (store.rounds_path, store.checkpoint_path)):
                warnings.warn(
                    f"{store.dir} holds rounds or checkpoints but no manifest: nothing says what they "
                    "computed, so the run starts over",
                    RecoveryWarning,
                    stacklevel=2,
                )
                store.clear()
            records, problem = store.read_rounds()
            records, notes = self._resume(store, records, [problem] if problem else [])
            first = len(records) + 1
            for note in notes:
                warnings.warn(f"{note}; resuming from round {first}", RecoveryWarning, stacklevel=2)
            fields = {"status": "running", "recovered": stored.get("recovered", []) + notes}
            if first == 1:
                fields["started"] = now()
            store.write_manifest({**stored, **(manifest or {}), **fields})
        spent = stored.get("seconds") or 0.0  # earlier sessions', up to their last checkpoint
        if first == 1 and hasattr(self.rule, "observe"):
            self.initial_report()
        try:
            self._rounds(first, records, store, spent, began, on_round)
        except BaseException as error:  # noqa: BLE001 - said in the manifest, then raised again
            if store is not None:
                store.update_manifest(interrupted=interruption(len(records), self.rounds, error))
            raise
        if self.failure is None and not any(r["error"] is None for r in records):
            self.failure = f"no round could be aggregated: all {len(records)} failed ({records[0]['error']})"
        if store is not None:
            store.update_manifest(
                status="failed" if self.failure else "finished",
                error=self.failure,
                finished=now(),
                final=final_metrics(records),
                not_aggregated=sum(r["error"] is not None for r in records),
                seconds=spent + time.perf_counter() - began,
            )
        return records

    def _rounds(self, first: int, records: list, store: RunStore | None, spent: float, began: float,
                on_round: Callable[[dict], None] | None) -> None:  # fmt: skip
        """Rounds ``first``, ..., the last (or the one the model diverged in), appended to ``records`` and
        written to ``store`` as they finish."""
        for t in range(first, self.rounds + 1):
            record = self.step(t)
            records.append(record)
            diverged = self.diverged
            if store is not None:
                store.append_round(record)
                if not diverged and t == self.rounds:  # before the last checkpoint: a resume cannot redo it
                    self._save_predictions(store)
                if not diverged and (t % self.settings.checkpoint_every == 0 or t == self.rounds):
                    state = {"round": t, "vector": self.vector, "rule_state": self.rule.state_dict()}
                    if hasattr(self.evaluation, "state_dict"):  # what it scores the next rounds with
                        state["evaluation"] = self.evaluation.state_dict()
                    store.save_checkpoint(state, after=record)
                    # the time up to a checkpoint survives a kill: a resume adds its own to it
                    store.update_manifest(seconds=spent + time.perf_counter() - began)
            if on_round is not None:
                on_round(record)
            if diverged:
                self.failure = f"the global model {diverged} in round {t} (diverged); the run stopped"
                return

    def _save_predictions(self, store: RunStore) -> None:
        """The final predictive distribution on the test set, where the evaluation has one."""
        predictions = self.evaluation.predictions(self.rounds, self.vector)
        if predictions is not None:
            store.save_predictions(*predictions)

    def _resume(
        self, store: RunStore, records: list[dict[str, Any]], notes: list[str]
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Restore the global vector and the rule's state from the newest checkpoint that reads back, fits
        this run, and is reached by the readable ``records``; keep the records up to it. Returns them and
        what had to be skipped (a damaged file, a checkpoint past the readable records)."""
        done = 0
        for path, state, fault in store.checkpoints():
            if fault is None:
                fault = self._restore(store, path, state, records)
            if fault is None:
                done = state["round"]
                break
            notes.append(fault)
        if store.rounds_path.exists():  # also drops a damaged tail the records stopped at
            store.write_rounds(records[:done])
        return records[:done], notes

    def _restore(
        self, store: RunStore, path, state: dict[str, Any], records: list[dict[str, Any]]
    ) -> str | None:
        """Load a checkpoint's vector, rule state and evaluation state (FedAG's posterior); None on success,
        else why it cannot be used (each ``load_state_dict`` checks its state before changing anything; the
        rule's is put back when the evaluation's is refused). The checkpoint must follow the readable
        ``records`` (:meth:`RunStore.follows`). A checkpoint written before fedtrust kept the evaluation's
        state resumes with none (FedAG scores the test set until its next posterior)."""
        keys = {"round", "vector", "rule_state"}
        if not isinstance(state, dict) or not keys <= set(state) <= keys | {"after", "evaluation"}:
            return f"{path} is not a checkpoint of a simulated run"
        t, vector = state["round"], state["vector"]
        if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= self.rounds:
            return f"{path} is for round {t!r}, not one of this run's rounds 1..{self.rounds}"
        if t > len(records):
            return f"{path} is for round {t}, past the {len(records)} readable rounds of rounds.jsonl"
        if not store.follows(state, records[:t]):
            return f"{path} does not follow round {t} of {store.rounds_path}: another run's?"
        fits = isinstance(vector, torch.Tensor) and vector.shape == self.vector.shape
        if not (fits and vector.is_floating_point() and bool(torch.isfinite(vector).all())):
            return f"{path}: its global vector is not {self.model.size} finite numbers"
        evaluation = "evaluation" in state and hasattr(self.evaluation, "load_state_dict")
        before = self.rule.state_dict() if evaluation else None  # to put back if the evaluation refuses
        try:
            self.rule.load_state_dict(state["rule_state"])
        except (ValueError, TypeError) as exc:
            return f"{path}: the rule refuses its state ({exc})"
        if evaluation:
            try:
                self.evaluation.load_state_dict(state["evaluation"])
            except (ValueError, TypeError) as exc:
                self.rule.load_state_dict(before)
                return f"{path}: the evaluation refuses its state ({exc})"
        self.vector = vector.to(self.vector)  # a checkpoint holds CPU tensors: back to this run's device
        return None


def final_metrics(records: list[dict]) -> dict | None:
    """The last evaluated metrics of a run."""
    for r in reversed(records):
        if r.get("metrics"):
            return {"round": r["round"], **r["metrics"]}
    return None
