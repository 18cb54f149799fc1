"""On-disk layout of one run, and the checks that make reading it back honest.

    manifest.json               what the run computes (its resolved config and hash), status, final metrics
    rounds.jsonl                one JSON line per finished round, rounds 1, 2, ... in order
    checkpoint.safetensors      the newest checkpoint (global vector, rule state, round)
    checkpoint.prev.safetensors the one before it, kept in case the newest is damaged
    .lock, .lock.holder.json    one writer at a time, and who it is

The JSON files are strict JSON (:func:`dumps`: a non-finite number as the string proto3's JSON mapping
gives it). Every file is written atomically or appended line by line with a sync; every reader either
returns exactly what was written or raises :class:`~fedtrust.checkpoint.CorruptFileError` naming the
file, the fault and the remedy.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fedtrust
from fedtrust.aggregators import order_stats
from fedtrust.checkpoint import CorruptFileError, atomic_write, load_state, save_state

#: What a user can do about a run whose files cannot be trusted.
START_OVER = "run `fedtrust run` again with --force to start this run over, or write to another --out"


@functools.cache
def source_hash() -> str:
    """A hash of fedtrust's source files (``*.py``, ``*.c``): a result on disk is reused, or a run
    resumed, only by the code that computed it, whatever the version number says."""
    root = Path(fedtrust.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")) + sorted(root.rglob("*.c")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    return {
        "fedtrust": fedtrust.__version__,
        "fedtrust_source": source_hash(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        # whether the median's and trimmed mean's compiled CPU kernel was built (it serves float32 rounds of
        # up to order_stats.MAX_CLIENTS clients on the CPU; numpy the rest): the same windows either way,
        # the means to rounding
        "order_stats_extension": "built" if order_stats.COMPILED else "absent",
    }


#: What computed a result on disk besides its config (keys of :func:`versions`): fedtrust's source and the
#: numerical libraries under it. Another torch or numpy moves float results (another kernel, another
#: order of summation), so a run is reused or resumed, and a report calls it this code's, only when all of
#: them match.
COMPUTED_BY = ("fedtrust_source", "torch", "numpy")


def computed_by(recorded: dict[str, Any] | None) -> tuple[str | None, ...]:
    """The :data:`COMPUTED_BY` entries of a run's recorded ``versions`` (None where one is missing)."""
    return tuple((recorded or {}).get(k) for k in COMPUTED_BY)


def this_code() -> tuple[str | None, ...]:
    """This checkout's :func:`computed_by` tuple."""
    return computed_by(versions())


def describe(code: tuple[str | None, ...]) -> str:
    """``source <hash>, torch <v>, numpy <v>`` for a :func:`computed_by` tuple."""
    return ", ".join(
        f"{k.removeprefix('fedtrust_')} {v or 'not recorded'}" for k, v in zip(COMPUTED_BY, code, strict=True)
    )


class RecoveryWarning(UserWarning):
    """A run resumed from an earlier point than its files claimed, because some of them were damaged."""


class RunLocked(RuntimeError):
    """Another process is writing this run directory; the message says which."""


#: The manifest fields every reader looks into (``a.b``: field b of a), and what each must be (a damaged or
#: hand-edited file with another shape is refused by name, not met as an AttributeError deep in a report).
MANIFEST_FIELDS = {"config": dict, "config.rule": dict, "config.rule.name": str, "config.train": dict,
                   "swept": dict, "versions": dict, "status": str, "experiment": str, "seed": int,
                   "index": int, "final": dict, "final.accuracy": (int, float), "final.rmse": (int, float),
                   "seconds": (int, float), "not_aggregated": int, "recovered": list,
                   "earlier_versions": list}  # fmt: skip
_JSON_KINDS = {dict: "object", str: "string", int: "integer", (int, float): "number", list: "array"}


def field_at(tree: Any, dotted: str) -> Any:
    """The value at ``dotted`` (``a.b``: field b of a) in nested dicts, or None where there is none."""
    node = tree
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def is_number(value: Any) -> bool:
    """A JSON number: an int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list_of(fits: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(map(fits, value))


def _kind(kind: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kind)


#: The fields of a round's record that readers look into (the report, a resume): what each must be, a test
#: of it, and whether it may be null or missing.
ROUND_FIELDS = {
    "clients": ("a list of names", _list_of(_kind(str)), False),
    "corrupted": ("a list of true/false", _list_of(_kind(bool)), False),
    "weights": ("a list of numbers", _list_of(is_number), False),
    "metrics": ("a JSON object", _kind(dict), True),
    "auroc": ("a number", is_number, True),
    "error": ("a string", _kind(str), True),
    "info": ("a JSON object", _kind(dict), True),
    "quarantined": ("a JSON object", _kind(dict), True),
    "dropped": ("a JSON object", _kind(dict), True),
}
_GROUPS = _list_of(lambda group: isinstance(group, dict) and isinstance(group.get("clients"), list))


#: How the run files write a number JSON has no literal for, as proto3's JSON mapping does: strings, so that
#: every JSON reader parses the files and keeps them (JavaScript's JSON.parse refuses Python's NaN and
#: Infinity literals, jq 1.7 reads them as null); the readers here turn them back into numbers where a
#: number belongs (weights, metrics, AUROC, final).
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def strict(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth of its dicts and lists, as its
    :data:`NON_FINITE` string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Strict JSON of ``value`` (:func:`strict`)."""
    return json.dumps(strict(value), allow_nan=False, **options)


def _number(value: Any) -> Any:
    """A number (or a list of numbers) read back: :data:`NON_FINITE`'s strings as their floats."""
    if isinstance(value, list):
        return [_number(v) for v in value]
    return NON_FINITE.get(value, value) if isinstance(value, str) else value


def _numbers(values: Any) -> Any:
    """A dict of metrics read back (:func:`_number` of each)."""
    return {k: _number(v) for k, v in values.items()} if isinstance(values, dict) else values


#: The fields of a round's record that hold numbers (besides its dicts of metrics: ``metrics`` and every
#: ``*_metrics``), and a manifest's dicts of metrics.
ROUND_NUMBERS, MANIFEST_METRICS = ("weights", "auroc", "train_loss"), ("final", "initial_metrics")


def numbers_read_back(record: dict[str, Any]) -> dict[str, Any]:
    """A round's record as written (:func:`strict`) with its numbers back (:data:`ROUND_NUMBERS` and the
    dicts of metrics: a resumed Flower run hands its rounds' ``server_metrics`` to Flower's MetricRecord,
    which takes numbers only); other fields (``info``) keep the strings."""
    for key in record:
        if key in ROUND_NUMBERS:
            record[key] = _number(record[key])
        elif key == "metrics" or key.endswith("_metrics"):
            record[key] = _numbers(record[key])
    return record


def _shown(value: Any) -> str:
    return json.dumps(value)[:80]


def record_fault(record: dict[str, Any]) -> str | None:
    """What in a round's record is not of the kind :data:`ROUND_FIELDS` says, or the kind its metrics
    (numbers, lists of numbers, or null) and ``info.groups`` must be, named with its value; None when
    nothing is."""
    for key, (kind, fits, optional) in ROUND_FIELDS.items():
        value = record.get(key)
        if not (value is None and optional or fits(value)):
            return f"{key} is {_shown(value) if key in record else 'missing'}, not {kind}"
    for key in ("corrupted", "weights"):
        if len(record[key]) != len(record["clients"]):
            return f"{key} has {len(record[key])} entries for {len(record['clients'])} clients"
    for name, value in (record.get("metrics") or {}).items():
        if not (value is None or is_number(value) or _list_of(is_number)(value)):
            return f"metrics.{name} is {_shown(value)}, not a number"
    groups = (record.get("info") or {}).get("groups")
    if not (groups is None or _GROUPS(groups)):
        return f"info.groups is {_shown(groups)}, not a list of groups with their clients"
    return None


class RunStore:
    """A run directory. ``rounds.jsonl`` gains one line per finished round and a checkpoint is written
    every few rounds; on resume the lines after the checkpoint are dropped and redone, so no round is
    lost or written twice."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.manifest_path = self.dir / "manifest.json"
        self.rounds_path = self.dir / "rounds.jsonl"
        self.checkpoint_path = self.dir / "checkpoint.safetensors"
        self.previous_checkpoint_path = self.dir / "checkpoint.prev.safetensors"
        self.lock_path = self.dir / ".lock"
        self.holder_path = self.dir / ".lock.holder.json"

    # ------------------------------------------------------------------ one writer

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the directory's lock (``filelock``) while writing; raises :class:`RunLocked` naming the
        process that holds it. The OS frees the lock when its holder dies, so a crash leaves none behind."""
        from filelock import FileLock, Timeout

        self.dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.lock_path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise RunLocked(
                f"{self.dir} is being written by another fedtrust process ({self._holder()}); wait for it "
                "to finish, or write to another --out"
            ) from None
        try:
            atomic_write(
                self.holder_path,
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "host": socket.gethostname(),
                        "since": now(),
                        "command": " ".join(sys.argv),
                    }
                ),  # fmt: skip
            )
            yield
        finally:
            self.holder_path.unlink(missing_ok=True)
            lock.release()

    def _holder(self) -> str:
        try:
            h = json.loads(self.holder_path.read_text())
            return f"pid {h['pid']} on {h['host']} since {h['since']}: {h['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    # ------------------------------------------------------------------ manifest

    def manifest(self) -> dict[str, Any] | None:
        """The manifest, or None before the run's first write; raises CorruptFileError when unreadable."""
        if not self.manifest_path.exists():
            return None
        try:
            text = self.manifest_path.read_text()
        except (OSError, UnicodeDecodeError) as exc:  # a folder of that name, no permission, binary bytes
            raise CorruptFileError(f"{self.manifest_path} cannot be read ({exc}); {START_OVER}") from None
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError as exc:
            what = "is empty" if not text.strip() else f"is not valid JSON ({exc})"
            raise CorruptFileError(
                f"{self.manifest_path} {what}: cannot tell what this run computed; {START_OVER}"
            ) from None
        if not isinstance(manifest, dict):
            raise CorruptFileError(f"{self.manifest_path} is not a JSON object; {START_OVER}")
        for key in MANIFEST_METRICS:
            if key in manifest:
                manifest[key] = _numbers(manifest[key])
        for key, kind in MANIFEST_FIELDS.items():  # (a field's parent is checked before it)
            value = field_at(manifest, key)
            if value is not None and not isinstance(value, kind):
                raise CorruptFileError(
                    f"{self.manifest_path}: {key} is {_shown(value)}, not a JSON {_JSON_KINDS[kind]}; "
                    f"{START_OVER}"
                )
        return manifest

    def is_finished(self) -> bool:
        m = self.manifest()
        return bool(m and m.get("status") == "finished")

    def finished_rounds(self, rounds: int) -> list[dict[str, Any]] | None:
        """The records of a finished run whose ``rounds`` rounds all read back, else None (a run to do or
        to redo: unfinished, failed, or with damaged records)."""
        if not self.is_finished():
            return None
        records, problem = self.read_rounds()
        return records if problem is None and len(records) == rounds else None

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        atomic_write(self.manifest_path, dumps(manifest, indent=1, default=str))

    def update_manifest(self, **fields: Any) -> None:
        m = self.manifest() or {}
        m.update(fields)
        self.write_manifest(m)

    # ------------------------------------------------------------------ rounds

    def read_rounds(self) -> tuple[list[dict[str, Any]], str | None]:
        """The readable records of rounds 1, 2, ..., k in order, and what is wrong after them (None when
        nothing is). A last line cut short by a crash, a garbled line, a record out of order, or one with
        a field of the wrong kind (:func:`record_fault`) ends the readable part; the problem names the
        file and the line."""
        if not self.rounds_path.exists():
            return [], None
        try:
            lines = self.rounds_path.read_bytes().split(b"\n")
        except OSError as exc:  # a folder of that name, no permission
            return [], f"{self.rounds_path} cannot be read ({exc})"
        torn = lines.pop() != b""  # the text after the last newline: a line a crash cut short
        records: list[dict[str, Any]] = []
        for number, line in enumerate(lines, start=1):
            where = f"{self.rounds_path}, line {number}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return records, f"{where} is not a JSON record (garbled)"
            if isinstance(record, dict):
                record = numbers_read_back(record)
            if not isinstance(record, dict) or record.get("round") != len(records) + 1:
                found = record.get("round") if isinstance(record, dict) else record
                return records, f"{where} holds round {found!r}, expected round {len(records) + 1}"
            fault = record_fault(record)
            if fault:
                return records, f"{where}: {fault}"
            records.append(record)
        if torn:
            return records, f"{self.rounds_path}, line {len(lines) + 1} was cut short (an interrupted write)"
        return records, None

    def rounds(self) -> list[dict[str, Any]]:
        """Every round's record; raises CorruptFileError when any line cannot be read back."""
        records, problem = self.read_rounds()
        if problem:
            raise CorruptFileError(f"{problem}; {START_OVER}")
        return records

    def write_rounds(self, records: list[dict[str, Any]]) -> None:
        """Replace rounds.jsonl by ``records`` (those of rounds 1..k that a resume keeps)."""
        atomic_write(self.rounds_path, "".join(dumps(r) + "\n" for r in records))

    @staticmethod
    def record_digest(record: dict[str, Any]) -> str:
        """A short hash of a round's record as rounds.jsonl holds it: a checkpoint keeps the hash of the
        record of its round, so that it is resumed only after these very records (a checkpoint copied
        from another run's folder is not this run's, whatever its round)."""
        return hashlib.sha256(dumps(record).encode()).hexdigest()[:16]

    def follows(self, state: dict[str, Any], records: list[dict[str, Any]]) -> bool:
        """Whether the checkpoint ``state`` follows ``records``, the readable records up to its round: the
        hash it keeps (``after``) is that of the last of them. A checkpoint without one (written before
        fedtrust kept it) is taken as it is, and so is the hash of a record written with Python's NaN and
        Infinity literals, before the files were strict JSON (a Flower run resumes across fedtrust
        versions)."""
        after = state.get("after")
        if after is None:
            return True
        if not records:
            return False
        legacy = hashlib.sha256(json.dumps(records[-1]).encode()).hexdigest()[:16]
        return after in (self.record_digest(records[-1]), legacy)

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.rounds_path, "a") as fh:
            fh.write(dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, state: dict[str, Any], after: dict[str, Any]) -> None:
        """Write ``state`` (a state tree, see :mod:`fedtrust.checkpoint`) as the newest checkpoint, with the
        hash of ``after``, the record of its round (:meth:`follows`), and keep the one before it."""
        if self.checkpoint_path.exists():
            os.replace(self.checkpoint_path, self.previous_checkpoint_path)
        save_state(self.checkpoint_path, {**state, "after": self.record_digest(after)})

    def checkpoints(self) -> Iterator[tuple[Path, dict[str, Any] | None, str | None]]:
        """(path, state, None) for each checkpoint that reads back, newest first, or (path, None, problem)
        for one that does not."""
        for path in (self.checkpoint_path, self.previous_checkpoint_path):
            if not path.exists():
                continue
            try:
                yield path, load_state(path), None
            except CorruptFileError as exc:
                yield path, None, str(exc)

    def save_predictions(self, y, mu, sigma) -> None:
        """The final predictive distribution on the test set (for calibration plots)."""
        import io

        import numpy as np

        buffer = io.BytesIO()
        np.savez_compressed(buffer, y=np.asarray(y), mu=np.asarray(mu), sigma=np.asarray(sigma))
        atomic_write(self.dir / "predictions.npz", buffer.getvalue())

    def clear(self) -> None:
        """Remove the run's results and checkpoints (``--force``: start over); the lock files stay. The
        manifest goes last: a run killed while clearing never leaves checkpoints without the manifest
        that says what they computed."""
        kept = (self.lock_path, self.holder_path, self.manifest_path)
        for path in self.dir.iterdir() if self.dir.exists() else ():
            if path.is_file() and path not in kept:
                path.unlink()
        self.manifest_path.unlink(missing_ok=True)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def interruption(done: int, rounds: int, error: BaseException) -> str:
    """When and why a run stopped before its last round (a manifest's ``interrupted``; the run stays
    ``running``, resumable)."""
    return f"{now()} after round {done} of {rounds}: {type(error).__name__}: {error}".rstrip(": ")
