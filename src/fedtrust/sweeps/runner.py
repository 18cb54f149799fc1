"""Run an experiment config: every run of its sweep, each in its own folder under ``out/<name>/``."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import fedtrust
from fedtrust.attacks import ATTACKS
from fedtrust.checkpoint import CorruptFileError, digest
from fedtrust.cores import usable_cores
from fedtrust.data import DATASETS
from fedtrust.data.corruptions import DATA_CORRUPTIONS, corrupt, data_corruption
from fedtrust.data.partition import PARTITIONERS
from fedtrust.models import build_model
from fedtrust.progress import Progress
from fedtrust.registry import build
from fedtrust.rules import rule as build_rule
from fedtrust.sim.evaluation import default_evaluation
from fedtrust.sim.federation import benchmark_rows, build_federation
from fedtrust.sim.loop import Lie, Simulation
from fedtrust.sim.settings import resolve_device
from fedtrust.sim.store import RunLocked, RunStore, computed_by, describe, field_at, this_code, versions
from fedtrust.sim.store import source_hash as source_hash  # (scripts read the code's hash here)
from fedtrust.sweeps.config import ConfigError, ExperimentConfig, expand, shell_safe


@dataclass
class RunOutcome:
    label: str
    directory: Path
    status: str  # "finished", "skipped" (already finished), "failed"
    final: dict | None = None
    error: str | None = None
    seconds: float | None = None
    not_aggregated: int = 0  # rounds the rule could not aggregate (the global model stayed)


class ConfigChanged(ValueError):
    """Runs on disk were computed from another config (or fedtrust version); the message names the runs
    and the differing keys."""


class StaleRunsWarning(UserWarning):
    """Runs on disk were computed by other fedtrust code (the same version and config, another source):
    they are computed again, not skipped or resumed."""


class _DatasetCache:
    """Sweeps reuse one loaded dataset across runs."""

    def __init__(self):
        self._cache: dict[str, Any] = {}
        self._digests: dict[str, str] = {}

    @staticmethod
    def _key(name: str, options: dict) -> str:
        return repr((name, sorted(options.items())))

    def get(self, name: str, options: dict):
        key = self._key(name, options)
        if key not in self._cache:
            self._cache[key] = build("dataset", DATASETS, name, options)
        return self._cache[key]

    def digest(self, name: str, options: dict) -> str:
        """A hash of the dataset's contents: a run on disk came from these very data (a CSV relabelled, a
        data folder swapped under the same path) only if its manifest holds the same."""
        key = self._key(name, options)
        if key not in self._digests:
            d = self.get(name, options)
            tensors = {"x_train": d.x_train, "y_train": d.y_train, "x_test": d.x_test, "y_test": d.y_test}
            tensors.update({f"group{i}": g for i, g in enumerate(d.groups or ())})
            self._digests[key] = digest(tensors)[:16]
        return self._digests[key]


def check_with_data(runs: list[tuple[str, ExperimentConfig]], datasets: _DatasetCache) -> None:
    """The option values that only a dataset can check (a model's sizes, a data corruption's trigger in the
    images or its target among the classes, the data's own values such as a test split too small to
    stratify or synthetic_linear's noise levels), once per distinct (data, model, corruption) of the sweep,
    before any run starts: the config check knows their names, not whether -5 hidden units or a 100-part
    trigger fit, or whether a benchmark share leaves the server a row. A ConfigError names the first run
    and the field. A data file that is there but cannot be read as the data (a CSV cut to its header) is
    refused the same way, since every run on it would fail alike; data that is not there
    (:class:`~fedtrust.data.datasets.DatasetNotFound`, any other OS error) is left to the runs, which fail
    saying why, so that a sweep over several data sets runs those that are present."""
    seen = set()
    for label, c in runs:
        parts = (c.data, c.model, c.corruption)
        key = repr([(b.name, sorted(b.options.items())) for b in parts] + [c.data.benchmark])
        if key in seen:
            continue
        seen.add(key)
        try:
            dataset = datasets.get(c.data.name, c.data.options)
        except REFUSED as exc:
            raise _refused(label, "data", exc) from None
        except Exception:  # noqa: BLE001 - not there (an OSError), or the data set's own failure: the runs
            continue  # say why
        field = "data.benchmark"
        try:
            benchmark_rows(c.data.benchmark, len(dataset))
            field = "model"
            build_model(c.model.name, dataset, **c.model.options)
            if c.corruption.name in DATA_CORRUPTIONS:
                field = "corruption"
                made = data_corruption(c.corruption.name, dataset.input_shape, **c.corruption.options)
                # on two rows: what only the labels can refuse (label_flip's target 99 of 10 classes,
                # target_noise on class labels)
                corrupt(made, dataset.x_train[:2], dataset.y_train[:2], dataset.num_classes, 1.0,
                        torch.Generator().manual_seed(0), client=0)  # fmt: skip
        except REFUSED as exc:
            raise _refused(label, field, exc) from None


#: What a component's option values raise when they cannot hold (RuntimeError: torch's, as for 1e12 hidden
#: units, "can't allocate memory: you tried to allocate 256000000000000 bytes").
REFUSED = (ValueError, TypeError, RuntimeError, MemoryError)


def _refused(label: str, field: str, exc: BaseException) -> ConfigError:
    said = str(exc) if str(exc).startswith(f"{field}:") else f"{field}: {exc}"  # (not "data: data:")
    return ConfigError(f"{label}: {said} (nothing was run)")


def build_simulation(
    cfg: ExperimentConfig, datasets: _DatasetCache | None = None, device: torch.device | None = None
) -> Simulation:
    """Every component of one run, built from its (validated) config, on ``train.device`` (or
    ``device``)."""
    device = resolve_device(cfg.train.device) if device is None else torch.device(device)
    datasets = datasets or _DatasetCache()
    dataset = datasets.get(cfg.data.name, cfg.data.options)
    partition = build("partition", PARTITIONERS, cfg.data.partition.name, cfg.data.partition.options)
    c = cfg.corruption
    corruption = attack = None
    if c.name in DATA_CORRUPTIONS:
        corruption = data_corruption(c.name, dataset.input_shape, **c.options)
        if c.attack is not None:
            attack = build("attack", ATTACKS, c.attack.name, c.attack.options)
    elif c.name in ATTACKS:
        attack = build("attack", ATTACKS, c.name, c.options)
    federation = build_federation(
        dataset,
        cfg.data.clients,
        partition,
        cfg.seed,
        corruption=corruption,
        corrupted_fraction=c.fraction,
        corrupted_samples=c.samples,
        benchmark=cfg.data.benchmark,
        added=c.added,
    ).to(device)
    model = build_model(cfg.model.name, dataset, **cfg.model.options)
    rule = build_rule(cfg.rule.name, **cfg.rule.options)
    lie = Lie(c.lie.metric, c.lie.value) if c.lie is not None else None
    evaluation = default_evaluation(model, federation, cfg.train, cfg.seed, corruption)
    return Simulation(
        federation,
        model,
        rule,
        cfg.train,
        cfg.seed,
        attack=attack,
        lie=lie,
        evaluation=evaluation,
        device=device,
    )


def resolved(cfg: ExperimentConfig) -> dict[str, Any]:
    """A run's fully resolved config as JSON data (defaults filled in, overrides and sweep applied), less
    ``train.device``: where a run computes does not change what it computes (to float rounding), so a
    run started on a GPU resumes on a CPU and the other way round."""
    return cfg.model_dump(mode="json", exclude={"sweep": True, "train": {"device"}})


def user_code(cfg: ExperimentConfig) -> dict[str, str | None]:
    """Registered name -> a hash of the source file (or, where there is none, the source) of each
    component the run names that is not fedtrust's own: a rule, attack, model, dataset, partition or
    data corruption the user registered. A config names such code but not what it does: an edited rule
    under the same name computes something else (None: its source cannot be read, so it is never
    trusted to be the same)."""
    from fedtrust.models.zoo import MODELS
    from fedtrust.rules import PRE_AGGREGATORS, RULES

    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, str):
            names.update(node.split("+"))  # "nnm+median"
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list | tuple):
            for value in node:
                walk(value)

    walk(resolved(cfg))
    tables = (RULES, PRE_AGGREGATORS, ATTACKS, MODELS, DATASETS, PARTITIONERS, DATA_CORRUPTIONS)
    return {
        name: _source_digest(table[name])
        for table in tables
        for name in sorted(names & table.keys())
        if not getattr(table[name], "__module__", "fedtrust").startswith("fedtrust")
    }


def _source_digest(builder: Any) -> str | None:
    """A hash of the file that defines ``builder`` and of the user modules it imports, at any depth (a rule
    that reads a constant from a helper module computes something else once the helper changes: it was
    skipped with its old number). User modules are those whose files lie outside Python's own, the
    installed packages' and fedtrust's (:func:`_user_files`); their contents are hashed, not their paths,
    and a file that imports none is hashed as before they were (its stored runs stay its). Without a file
    (code typed at a prompt), its source; None where neither can be read."""
    import inspect

    try:
        path = Path(inspect.getsourcefile(builder) or "")
        if not path.is_file():
            return hashlib.sha256(inspect.getsource(builder).encode()).hexdigest()[:16]
        files = _user_files(sys.modules.get(getattr(builder, "__module__", "")), path)
        if len(files) == 1:
            return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        digests = sorted(hashlib.sha256(f.read_bytes()).hexdigest() for f in files)
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16]


@functools.cache
def _installed_roots() -> frozenset[Path]:
    """The folders whose modules are not the user's: Python's own, the installed packages' (the site's
    and the user's site), fedtrust's."""
    import site
    import sysconfig

    roots = {Path(p).resolve() for k, p in sysconfig.get_paths().items() if k.endswith(("lib", "stdlib"))}
    roots |= {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    return frozenset({*roots, Path(fedtrust.__file__).resolve().parent})


def _user_files(module: Any, own: Path) -> set[Path]:
    """``own`` (the defining file) and the files of the user modules that ``module``'s source imports
    (``import a.b``, ``from a import b``, ``from . import c``, at any depth and in functions too), as
    loaded in ``sys.modules``. A user module's file lies outside Python's own, the installed packages'
    (site-packages, dist-packages, the user's site) and fedtrust's."""
    import ast
    import importlib.util

    others = _installed_roots()

    def user_file(m: Any) -> Path | None:
        where = getattr(m, "__file__", None)
        if not isinstance(where, str) or not where.endswith(".py"):
            return None
        path = Path(where).resolve()
        installed = {"site-packages", "dist-packages"} & set(path.parts)
        return None if installed or any(path.is_relative_to(o) for o in others) else path

    files, seen, stack = {own.resolve()}, set(), [module]
    while stack:
        m = stack.pop()
        name = getattr(m, "__name__", None)
        path = user_file(m)
        if path is None or name in seen:
            continue
        seen.add(name)
        files.add(path)
        package = m.__package__ if m.__spec__ is None or m.__spec__.parent is None else m.__spec__.parent
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package or "")
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for full in names:  # a.b.c imports a and a.b too
                parts = full.split(".")
                stack += [sys.modules.get(".".join(parts[:k])) for k in range(1, len(parts) + 1)]
    return files


def config_hash(cfg: ExperimentConfig) -> str:
    """SHA-256 of :func:`resolved`."""
    return hashlib.sha256(json.dumps(resolved(cfg), sort_keys=True, default=str).encode()).hexdigest()


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): tree}


def differences(manifest: dict, cfg: ExperimentConfig) -> list[str]:
    """How the run a manifest describes differs from ``cfg`` under this fedtrust ("path: old -> new");
    empty when it computes the same thing."""
    stored = (manifest.get("versions") or {}).get("fedtrust")
    out = [] if stored == fedtrust.__version__ else [f"fedtrust version: {stored} -> {fedtrust.__version__}"]
    if manifest.get("config_hash") == config_hash(cfg):
        return out
    old, new = _flat(manifest.get("config") or {}), _flat(resolved(cfg))
    changed = [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
               for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]  # fmt: skip
    return out + (changed or ["its config hash differs (written by a fedtrust without one)"])


def _preflight(runs, root: Path, force: bool) -> tuple[set[str], dict[str, str]]:
    """Runs to start over (config changed or files unreadable, with ``force``) and runs that cannot go
    on (unreadable manifest, without ``force``: label -> why). Raises :class:`ConfigChanged` before
    anything runs when a run on disk computed something else and ``force`` is not set."""
    redo, broken, changed, stale = set(), {}, [], []
    here = this_code()
    for label, run_cfg in runs:
        store = RunStore(root / label)
        try:
            manifest = store.manifest()
        except CorruptFileError as exc:
            if force:
                redo.add(label)
            else:
                broken[label] = str(exc)
            continue
        diff = differences(manifest, run_cfg) if manifest is not None else []
        if diff:
            redo.add(label)
            changed.append(f"  {label}: " + "; ".join(diff))
        elif manifest is not None and (
            computed_by(manifest.get("versions")) != here
            or (manifest.get("user_code") or {}) != (mine := user_code(run_cfg))
            or None in mine.values()
        ):
            redo.add(label)
            stale.append(label)
    if changed and not force:
        raise ConfigChanged(
            f"{len(changed)} run(s) in {root} were computed from another config, so they are neither "
            "skipped nor resumed (nothing was run):\n" + "\n".join(changed) + "\n"
            "Use --force to start those runs over, or write to another --out."
        )
    if stale:
        warnings.warn(
            f"{len(stale)} run(s) in {root} were computed by other code (fedtrust "
            f"{describe(here)} here, or a component you registered has changed or has no "
            "readable source); they are computed "
            f"again, not skipped or resumed: {', '.join(stale[:5])}" + (" ..." if len(stale) > 5 else ""),
            StaleRunsWarning,
            stacklevel=3,
        )
    return redo, broken


def run_experiment(
    cfg: ExperimentConfig,
    out: str | Path,
    progress: bool = True,
    force: bool = False,
    jobs: int = 1,
    ray: str | None = None,
) -> list[RunOutcome]:
    """Run every run of ``cfg``'s sweep under ``out/<cfg.name>/<label>``. A run is identified by what it
    computes (the hash of its resolved config, the fedtrust version, :func:`source_hash` and the torch
    and numpy versions: :func:`~fedtrust.sim.store.computed_by`): a finished run with the same identity is
    skipped, an interrupted one resumes from its last good checkpoint, one computed from another config is
    refused (:class:`ConfigChanged`) unless ``force`` starts it over, and one computed by other code of
    the same version (an edited source, another torch or numpy) is computed again
    (:class:`StaleRunsWarning`).
    Each run is written under its directory's lock (:class:`~fedtrust.sim.store.RunLocked` when another
    process holds it). A run that fails is recorded and the rest go on.

    ``jobs`` > 1 runs that many runs at once in processes of their own (each with its share of the
    CPU's threads); ``ray`` (a Ray cluster's address, or ``"auto"``) runs them as Ray tasks on an
    existing cluster (``ray.init`` already called in this process counts). Each run still writes its
    own directory under its lock, so skip and resume work as in one process; outcomes come back in the
    sweep's order."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    runs = expand(cfg)
    named = {c.corruption.name for _, c in runs if c.corruption.name != "none"}
    if named and not any(c.corruption.fraction > 0 or c.corruption.added > 0 for _, c in runs):
        warnings.warn(
            f"corruption {', '.join(sorted(named))}: corruption.fraction is 0 (and no clients are added) in "
            "every run, so no client is corrupted; set corruption.fraction",
            stacklevel=2,
        )
    root = Path(out) / cfg.name
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"{root} is a file; --out must be a folder")
    check_with_data(runs, datasets := _DatasetCache())
    _adopt_legacy_folders(root, [label for label, _ in runs])
    redo, broken = _preflight(runs, root, force)
    bar = Progress(enabled=progress, total=sum(c.train.rounds_run for _, c in runs))
    outcomes: dict[int, RunOutcome] = {}  # by index in the sweep
    todo = []
    for index, (label, run_cfg) in enumerate(runs):
        if label in broken:
            outcomes[index] = RunOutcome(label, root / label, "failed", error=broken[label])
        else:
            todo.append((cfg, index, label, run_cfg, root, label in redo))
    parallel = jobs > 1 or ray is not None
    with (
        _pool(jobs, ray) if parallel else contextlib.nullcontext() as pool,
        bar,
    ):  # the pool first: --ray fails fast
        bar.advance(sum(runs[i][1].train.rounds_run for i in outcomes), "")
        if not parallel:  # the datasets the check above loaded serve the runs
            for task in todo:
                index, outcome = _run_locked(*task, datasets, bar)
                outcomes[index] = outcome
        else:
            threads = max(1, usable_cores() // jobs)
            for index, outcome in pool.imap_unordered(_run_task, [(*t, threads) for t in todo]):
                outcomes[index] = outcome
                bar.advance(runs[index][1].train.rounds_run, outcome.label)
    return [outcomes[i] for i in sorted(outcomes)]


def _adopt_legacy_folders(root: Path, labels: list[str]) -> None:
    """Give run folders named the earlier way (``rule=bulyan(f=0.2)_seed=0``, which needs shell quoting) this
    version's name (``rule=bulyan,f=0.2_seed=0``), so their runs are skipped or resumed, not redone. A
    folder another process is writing is left where it is (its run is then refused by that lock)."""
    if not root.is_dir():
        return
    wanted = set(labels)
    for path in sorted(root.iterdir()):
        new = shell_safe(path.name)
        if new == path.name or new not in wanted or (root / new).exists() or not path.is_dir():
            continue
        store = RunStore(path)
        try:
            with store.lock():
                path.rename(root / new)
        except RunLocked:
            continue
        moved = RunStore(root / new)
        with contextlib.suppress(CorruptFileError):
            if moved.manifest():
                moved.update_manifest(run=new)


def _run_locked(cfg, index, label, run_cfg, root, redo: bool, datasets, bar) -> tuple[int, RunOutcome]:
    """One run under its directory's lock, started over first when ``redo``."""
    store = RunStore(Path(root) / label)
    with store.lock():
        if redo:
            store.clear()
        else:  # checked again under the lock: another sweep on this --out may have written it meanwhile
            try:
                manifest = store.manifest()
            except CorruptFileError:
                manifest = None  # (the run says so below)
            diff = differences(manifest, run_cfg) if manifest is not None else []
            if diff:
                error = (
                    "another process wrote this run from another config while this sweep ran ("
                    + "; ".join(diff)
                    + "); left as it is: use another --out for a sweep of another config"
                )
                bar.advance(run_cfg.train.rounds_run, label)
                return index, RunOutcome(label, store.dir, "failed", error=error)
        return index, _run_one(cfg, index, label, run_cfg, store, datasets, bar, run_cfg.train.rounds_run)


def _pool(jobs: int, ray: str | None):
    if ray is None:
        import multiprocessing

        return multiprocessing.get_context("spawn").Pool(jobs)  # a fresh interpreter: no forked torch state
    try:
        import ray as ray_module
        from ray.util.multiprocessing import Pool
    except ImportError:
        raise ValueError(
            "--ray needs Ray: pip install 'fedtrust[flower]' (flwr[simulation] brings it)"
        ) from None
    if not ray_module.is_initialized():
        host, _, port = ray.rpartition(":")
        if ray != "auto" and port.isdigit():  # an unreachable address: Ray itself retries for minutes
            import socket

            try:
                socket.create_connection(
                    (host.removeprefix("ray://") or "127.0.0.1", int(port)), timeout=5
                ).close()
            except OSError as exc:
                raise ValueError(f"--ray {ray}: no Ray cluster to join there ({exc})") from None
        try:
            ray_module.init(address=ray, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ValueError(f"--ray {ray}: no Ray cluster to join there ({exc})") from None
    return Pool(processes=jobs if jobs > 1 else None)


def _run_task(task) -> tuple[int, RunOutcome]:
    """One run in a worker (a pool process or a Ray task), with its share of the CPU's threads; the
    progress bar is the parent's (it advances when the run ends)."""
    import torch

    *run, threads = task
    torch.set_num_threads(threads)
    return _run_locked(*run, _DatasetCache(), Progress(0, enabled=False))


def _run_one(cfg, index, label, run_cfg, store: RunStore, datasets, bar, rounds: int) -> RunOutcome:
    try:
        data = datasets.digest(run_cfg.data.name, run_cfg.data.options)
    except Exception:  # noqa: BLE001 - data that cannot be read: the run below fails saying why
        data = None
    stored = store.manifest()
    if data is not None and stored is not None and stored.get("data_digest") != data:
        if stored.get("data_digest") is not None:
            warnings.warn(
                f"{store.dir} was computed from other data ({run_cfg.data.name}: digest "
                f"{stored['data_digest']} -> {data}); it is computed again, not skipped or resumed",
                StaleRunsWarning,
                stacklevel=2,
            )
        store.clear()
    # data that cannot be read now cannot vouch for a stored result: the run is attempted (and fails
    # saying why) instead of printing the number computed from data that are gone
    if data is not None and store.finished_rounds(rounds) is not None:  # not cleared above: ``stored``
        manifest = stored
        bar.advance(rounds, label)
        return RunOutcome(label, store.dir, "skipped", manifest.get("final"), seconds=manifest.get("seconds"),
                          not_aggregated=manifest.get("not_aggregated", 0))  # fmt: skip
    swept = {p: field_at(run_cfg.model_dump(), p) for key in cfg.sweep for p in key.split("+")}
    identity = {
        "experiment": cfg.name,
        "run": label,
        "index": index,
        "sweep_size": math.prod(len(values) for values in cfg.sweep.values()),  # runs planned (1: none)
        "swept": swept,
        "seed": run_cfg.seed,
        "config": resolved(run_cfg),
        "config_hash": config_hash(run_cfg),
        "versions": versions(),
        "user_code": user_code(run_cfg),
        "data_digest": data,
        "threads": torch.get_num_threads(),  # BLAS splits its sums by thread: the last digits may move
    }
    bar.advance(len(store.read_rounds()[0]), label)
    try:
        sim = build_simulation(run_cfg, datasets)
        identity["device"] = str(sim.device)  # where this (part of the) run computed
        sim.run(store, identity, on_round=lambda r: bar.advance(1, label))
    except Exception as exc:  # noqa: BLE001 - a broken run must not take the sweep down
        error = f"{type(exc).__name__}: {exc}"
        store.update_manifest(  # (a result an earlier session wrote is not this run's: not kept beside it)
            **identity,
            status="failed",
            error=error,
            traceback=traceback.format_exc(),
            final=None,
            finished=None,
            not_aggregated=None,
        )
        return RunOutcome(label, store.dir, "failed", error=error)
    m = store.manifest() or {}
    status = "failed" if sim.failure else "finished"
    return RunOutcome(label, store.dir, status, m.get("final"), sim.failure, m.get("seconds"),
                      m.get("not_aggregated", 0))  # fmt: skip
