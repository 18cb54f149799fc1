"""A Flower strategy's run directory, in the simulator's layout, so that ``fedtrust report`` reads it.

    manifest.json           the rule and strategy options, status (running: unfinished, with when and why
                            it stopped if the ServerApp raised; finished; failed), final metrics
    rounds.jsonl            one JSON record per finished round: trust per node (by name and node id),
                            drops with reasons, quarantines, the round's metrics, the rule's diagnostics,
                            ``error`` (why a round kept the model) or ``skipped`` (why no node trained)
    checkpoint.safetensors  the global model, the rule's state, the node names, after the newest round

A restarted SuperLink that runs the ServerApp again with the same directory goes on from the checkpoint
(the model, the reputations, the round number), so ``num_rounds`` counts rounds in all. Files are written
atomically and read without running code (:mod:`fedtrust.checkpoint`); a damaged checkpoint is refused
by name, never half-read.
"""

from __future__ import annotations

import json
import time
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.supercore import log

from fedtrust.checkpoint import CorruptFileError
from fedtrust.rules import rule as build_rule
from fedtrust.sim.loop import final_metrics
from fedtrust.sim.store import RunStore, computed_by, describe, interruption, now, this_code, versions

REMEDY = "give the strategy another run_dir, or delete this one to start over"
#: What a run's ``metrics_source`` means.
EVALUATION = {"server": "the server's evaluation", "nodes": "the nodes' evaluation"}


class RunDirectory:
    """The strategy's run directory: what it holds, and what it resumes from."""

    def __init__(self, directory: str | Path, config: dict[str, Any]):
        self.store = RunStore(directory)
        self.config = config
        self._earlier: dict[str, Any] | None = None  # the versions of rounds another code computed
        self.began = time.perf_counter()

    def lock(self):
        return self.store.lock()

    def resume(self, size: int) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The records of the rounds done and the checkpoint after the last of them ((), None for a new
        run). A damaged newest checkpoint gives way to the one before it (logged); a directory of another
        rule or strategy setting, or of a model of another size, is refused."""
        manifest = self.store.manifest()
        if manifest is None:
            return [], None
        had, now = _meaning(manifest.get("config") or {}), _meaning(self.config)
        if had != _plain(now):
            raise ValueError(f"{self.store.dir} holds a run of {had}, not of this strategy ({now}); {REMEDY}")
        records, problem = self.store.read_rounds()
        faults = []
        for path, state, fault in self.store.checkpoints():
            done = state.get("round") if state is not None else None
            if fault is None and (not isinstance(done, int) or len(records) < done):
                fault = (
                    f"{path} is after round {done!r} but {self.store.rounds_path} reads back {len(records)}"
                )
                fault += f" ({problem})" if problem else ""
            elif fault is None and not self.store.follows(state, records[:done]):
                fault = f"{path} does not follow round {done} of {self.store.rounds_path}: another run's?"
            if fault is not None:
                faults.append(fault)
                continue
            if tuple(state["vector"].shape) != (size,):
                raise ValueError(
                    f"{path} holds a model of {state['vector'].numel()} values, this one has {size}; {REMEDY}"
                )
            for fault in faults:
                log(WARNING, "run_dir: %s; resuming from round %d", fault, done)
            return records[:done], state
        if faults:
            raise CorruptFileError(f"{'; '.join(faults)}; {REMEDY}")
        return [], None

    def start(self, rounds: int, records: list[dict[str, Any]], source: str) -> str:
        """Mark the run running for ``rounds`` rounds in all, keeping the records of the rounds done, and
        return the source of its rounds' metrics: ``source`` ("server" or "nodes"), or, resumed, the one
        its first session recorded (a session with another evaluation says so in the log and keeps it)."""
        manifest = self.store.manifest() if records else None
        if manifest is None:
            manifest = {"experiment": "flower", "run": self.store.dir.name, "started": now()}
        if not records:
            manifest["versions"] = versions()  # the code that computes these rounds, for the report
        earlier = manifest.get("versions")
        # the rounds done are that code's: kept beside this session's once it computes one (:meth:`commit`),
        # so the report says the run mixes codes (it read as this code's alone: the versions were overwritten)
        self._earlier = earlier if isinstance(earlier, dict) and computed_by(earlier) != this_code() else None
        if self._earlier is not None:
            log(WARNING, "run_dir: rounds 1-%d were computed by other code (%s); this session's will be this "
                "code's (%s): the report lists the run as computed by both", len(records),
                describe(computed_by(earlier)), describe(this_code()))  # fmt: skip
        stored = manifest.get("metrics_source") if records else None
        if stored is not None and stored != source:
            log(WARNING, "run_dir: this run's metrics are %s (its first session's); this session's %s "
                "is kept beside them in each round's record", EVALUATION[stored],
                EVALUATION[source])  # fmt: skip
        manifest["metrics_source"] = source = stored or source
        self.store.write_rounds(records)
        config = {**self.config, "train": {"mode": "params", "rounds": rounds}}
        manifest.pop("interrupted", None)
        self.store.write_manifest({**manifest, "status": "running", "config": config})
        return source

    def commit(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> None:
        """The round's record, then the checkpoint after it (a crash between them redoes the round),
        holding the record's hash: it is resumed only after this very record."""
        self.store.append_round(record)
        self.store.save_checkpoint(checkpoint, after=record)
        if self._earlier is not None:  # this session's first round: the run now mixes two codes
            manifest = self.store.manifest() or {}
            self.store.update_manifest(
                earlier_versions=[*manifest.get("earlier_versions", []), self._earlier], versions=versions()
            )
            self._earlier = None

    def interrupt(self, records: list[dict[str, Any]], rounds: int, error: BaseException) -> None:
        """The run stopped before its last round (the ServerApp raised, was interrupted): it stays
        unfinished, resumable from its checkpoint, and says when and why it stopped."""
        self.store.update_manifest(
            status="running",
            interrupted=interruption(len(records), rounds, error),
            seconds=self._seconds(),
        )

    def _seconds(self) -> float:
        """The run's time over its sessions: the earlier ones' and this one's so far."""
        return (self.store.manifest() or {}).get("seconds", 0.0) + time.perf_counter() - self.began

    def finish(self, records: list[dict[str, Any]], rounds: int) -> None:
        metrics = final_metrics(records)  # (with its round: the server may not score the last one)
        failed = bool(records) and all(r.get("error") for r in records)
        self.store.update_manifest(
            status="failed" if failed else "finished" if len(records) == rounds else "running",
            error=f"no round could be aggregated ({records[0]['error']})" if failed else None,
            finished=now(),
            final=metrics,
            seconds=self._seconds(),
        )


#: Strategy options that say whom a round samples and waits for, not what its results mean: a resumed run
#: may change them (a node gone for good: the same run with a lower min_available_nodes).
SAMPLING = (
    "fraction_train",
    "fraction_evaluate",
    "min_train_nodes",
    "min_evaluate_nodes",
    "min_available_nodes",
)


def _meaning(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a run's config a resumed run must share: the rule (with every option it resolves to,
    so that ``ivar_vb`` and ``ivar_vb(window=10)``, its default, are one rule), the strategy's other
    options."""
    strategy = {k: v for k, v in (config.get("strategy") or {}).items() if k not in SAMPLING}
    return {"rule": _resolved(config.get("rule")), "strategy": strategy}


def _resolved(rule: Any) -> Any:
    """A recorded rule (``{"name": ..., options as given}``) with every option the registry's rule of that
    name resolves them to; as recorded when it names no rule the registry builds (a user's own object)."""
    if not isinstance(rule, dict) or not isinstance(rule.get("name"), str):
        return rule
    name, options = rule["name"], {k: v for k, v in rule.items() if k != "name"}
    try:
        built = build_rule(name, **options)
    except Exception:  # noqa: BLE001 - a name or options it cannot build (a user's builder): as recorded
        return rule
    return _plain({"name": name, **built.options()})


def _plain(tree: Any) -> Any:
    """``tree`` as it reads back from the manifest's JSON."""
    return json.loads(json.dumps(tree, default=str))
