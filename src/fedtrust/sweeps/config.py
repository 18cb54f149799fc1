"""Experiment configs: YAML validated with pydantic, plus the component registries, so that a wrong key
or value is reported with its path and the valid choices before anything runs.

    name: arfl-table2
    seed: 0
    data: {name: digits, clients: 20, partition: {name: dirichlet, alpha: 0.5}, benchmark: 0}
    model: {name: mlp, hidden: 200}
    train: {rounds: 30, fraction: 0.5, local_epochs: 1, batch_size: 32, lr: 0.1}
    corruption: {name: label_flip, fraction: 0.3}
    rule: {name: geometric_median}
    sweep:                                   # Cartesian product of these lists
      rule: [{name: fedavg}, {name: multi_krum, f: 0.3}]
      corruption.fraction: [0.3, 0.5]
      seed+data.seed: [[0, 0], [1, 1]]       # a "+" key sets several paths together

Component blocks (data, partition, model, corruption, rule) take a ``name`` and that component's own
options inline; ``fedtrust rules`` and the registries list them. A rule may have pre-aggregators in front
(:mod:`fedtrust.rules`): ``rule: {name: nnm+median}`` or ``rule: {name: median, pre: [nnm, {name:
bucketing, s: 3}]}``.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedtrust._checks import SEED_LIMIT, Settings, share_count
from fedtrust.attacks import ATTACKS
from fedtrust.data import DATASETS
from fedtrust.data.corruptions import DATA_CORRUPTIONS
from fedtrust.data.partition import PARTITIONERS
from fedtrust.models import MODELS
from fedtrust.registry import UnknownNameError, build, check_options, lookup, options_of, yaml_value
from fedtrust.rules import rule as build_rule
from fedtrust.sim.settings import TrainSettings

#: Options the runner supplies to a data corruption from the dataset (a backdoor's image shape).
SUPPLIED = ("input_shape",)


def corruptions() -> dict:
    """Every corruption a config may name: 'none', the data corruptions and the update attacks, read at
    call time so attacks registered from user code are included."""
    return {"none": None, **DATA_CORRUPTIONS, **ATTACKS}


class ConfigError(ValueError):
    """A config problem; the message names the path, the value and the valid choices."""


class _Component(Settings):
    """``name`` plus the component's own options, inline."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class PartitionConfig(_Component):
    name: str = "iid"


class DataConfig(_Component):
    """Dataset name and loader options, plus how it is spread over clients."""

    name: str = "digits"
    clients: int = Field(20, ge=1)
    partition: PartitionConfig = PartitionConfig()
    benchmark: int | float = Field(
        0, ge=0, description="rows (int) or share (float < 1) the server keeps clean"
    )

    @field_validator("benchmark")
    @classmethod
    def _share_below_one(cls, v):
        if isinstance(v, float) and v >= 1:
            raise ValueError(f"a share must be < 1 (an int counts rows), got {v}")
        return v


class ModelConfig(_Component):
    name: str = "softmax"


class LieConfig(Settings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    metric: Literal["train_loss"] = Field("train_loss", description="the one metric simulated clients report")
    value: float = Field(
        0.0,
        ge=0.0,
        description="the loss they report; a loss below 0 would be quarantined, so not a lie told",
    )


class AttackConfig(_Component):
    """An update attack the data-corrupted clients also run (model replacement after a backdoor)."""


class CorruptionConfig(_Component):
    """A data corruption or update attack applied by a ``fraction`` of the clients (to ``samples`` of
    their rows, for data corruptions) and by ``added`` extra clients that join with a copy of an honest
    client's data; ``lie`` makes them also misreport a metric; ``attack`` (after a data corruption) makes
    them also replace their update, e.g. ``{name: backdoor, attack: {name: model_replacement}}``."""

    name: str = "none"
    fraction: float = Field(0.0, ge=0.0, le=1.0)
    added: int = Field(0, ge=0)
    samples: float = Field(1.0, gt=0.0, le=1.0)
    lie: LieConfig | None = None
    attack: AttackConfig | None = None


class RuleConfig(_Component):
    name: str = "fedavg"


class ExperimentConfig(Settings):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "experiment"
    seed: int = Field(0, ge=0, lt=SEED_LIMIT, description="a 32-bit seed")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainSettings = TrainSettings()
    corruption: CorruptionConfig = CorruptionConfig()
    rule: RuleConfig = RuleConfig()
    sweep: dict[str, list[Any]] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v):
            raise ValueError(f"use letters, digits, '.', '_' or '-' (it names a folder), got {v!r}")
        return v


# ---------------------------------------------------------------- validation


_SECTIONS: dict[tuple[str, ...], type[BaseModel]] = {
    (): ExperimentConfig,
    ("data",): DataConfig,
    ("data", "partition"): PartitionConfig,
    ("model",): ModelConfig,
    ("train",): TrainSettings,
    ("corruption",): CorruptionConfig,
    ("corruption", "lie"): LieConfig,
    ("corruption", "attack"): AttackConfig,
    ("rule",): RuleConfig,
}


def validator_reason(error: dict) -> str:
    """A pydantic error's message without the prefix pydantic puts before a validator's ValueError."""
    return error["msg"].removeprefix("Value error, ")


#: A value in an error message, cut short: a YAML alias bomb (nine lines of nested aliases) as seed: gave
#: a message of 3.85 MB, and its full repr grows ninefold a level.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, 80, 80, 80  # (3.11 takes no options)


def _format(error: dict, where: str) -> str:
    loc = tuple(str(p) for p in error["loc"])
    path = ".".join(loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        section = _SECTIONS.get(loc[:-1])
        valid = ", ".join(section.model_fields) if section else "?"
        return f"{where}{path}: unknown key {loc[-1]!r}; valid keys here: {valid}"
    reason = validator_reason(error)
    if "got " in reason:  # the validator named the value itself
        return f"{where}{path}: {reason}"
    return f"{where}{path}: {reason} (got {_SHORT.repr(error.get('input'))})"


def _check_components(cfg: ExperimentConfig, where: str) -> None:
    """Names and options of every component, checked against the registries (nothing is loaded)."""

    def guard(path: str, fn):
        try:
            return fn()
        except (UnknownNameError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where}{path}: {exc}") from None

    data_options = {k: v for k, v in cfg.data.options.items()}
    guard(
        "data",
        lambda: check_options(
            "dataset", cfg.data.name, lookup("dataset", DATASETS, cfg.data.name), data_options
        ),
    )
    guard(
        "data.partition",
        lambda: build("partition", PARTITIONERS, cfg.data.partition.name, cfg.data.partition.options),
    )
    guard(
        "model",
        lambda: check_options(
            "model",
            cfg.model.name,
            lookup("model", MODELS, cfg.model.name),
            cfg.model.options,
            fixed=("dataset",),
        ),
    )
    built = guard("rule", lambda: build_rule(cfg.rule.name, **cfg.rule.options))  # "nnm+median", pre: [...]
    if hasattr(built, "check_clients"):  # a Byzantine budget no round of this config can meet
        k = cfg.data.clients + cfg.corruption.added
        n = cfg.train.clients_per_round(k)
        try:
            built.check_clients(n)
        except ValueError as exc:
            added = f" + corruption.added {cfg.corruption.added}" if cfg.corruption.added else ""
            sampled = f" x train.fraction {cfg.train.fraction}" if n != k else ""
            raise ConfigError(
                f"{where}rule: {exc}; this config's rounds have {n} (data.clients {cfg.data.clients}{added}"
                f"{sampled})"
            ) from None
    reads = getattr(built, "reads_reference", ())
    if reads and not cfg.data.benchmark:
        raise ConfigError(
            f"{where}rule: {cfg.rule.name} reads the server's benchmark split (Round.reference: "
            f"{', '.join(reads)}), but data.benchmark is {cfg.data.benchmark!r}; set it to the rows (an int) "
            "or the share (a float < 1) the server keeps clean"
        )
    c = cfg.corruption
    if c.fraction > 0 and share_count(c.fraction, cfg.data.clients) == 0:
        raise ConfigError(
            f"{where}corruption.fraction: {c.fraction} of {cfg.data.clients} clients rounds to no corrupted "
            f"client; give at least {math.ceil(0.5 / cfg.data.clients * 1e4) / 1e4:g} (counts round half "
            "up), or 0 for none"
        )
    corruption = lookup_corruption(c.name, where)
    if corruption is not None:
        supplied = tuple(k for k in SUPPLIED if k in options_of(corruption))
        if supplied:  # built with the dataset's values at run time: the option names are checked here
            guard("corruption", lambda: check_options("corruption", c.name, corruption, c.options, supplied))
        else:
            guard("corruption", lambda: build("corruption", corruptions(), c.name, c.options))
    elif c.options:
        raise ConfigError(f"{where}corruption: 'none' takes no options, got {sorted(c.options)}")
    if c.attack is not None:
        if c.name not in DATA_CORRUPTIONS:
            raise ConfigError(
                f"{where}corruption.attack: an update attack after a data corruption (e.g. {{name: "
                f"backdoor, attack: {{name: model_replacement}}}}); {c.name!r} is not a data corruption"
            )
        guard("corruption.attack", lambda: build("attack", ATTACKS, c.attack.name, c.attack.options))


def lookup_corruption(name: str, where: str = ""):
    try:
        return lookup("corruption", corruptions(), name)
    except UnknownNameError as exc:
        raise ConfigError(f"{where}corruption: {exc}") from None


def validate(raw: dict[str, Any], where: str = "") -> ExperimentConfig:
    """A parsed config from a plain dict; raises :class:`ConfigError` naming every problem's path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}a config must be a mapping of keys, got {type(raw).__name__}")
    try:
        cfg = ExperimentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError("\n".join(_format(e, where) for e in exc.errors())) from None
    _check_components(cfg, where)
    return cfg


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read and validate a YAML config (the sweep runs are validated too, each with its own path).
    ``overrides``: "dotted.path=value" strings (value read as YAML) applied before validation."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give the YAML file")
    try:
        raw = yaml_value(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
        ) from None
    if raw is None:  # an empty file would run the default experiment, which nobody asked for
        raise ConfigError(f"{path} is empty; a config names at least its experiment (name: ...)")
    swept = [p for k in raw.get("sweep") or {} for p in str(k).split("+")] if isinstance(raw, dict) else []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects path=value, got {item!r}")
        key = key.strip()
        clash = next((p for p in swept if _overlap(key, p)), None)
        if clash is not None:  # the sweep would set it again in every run, silently
            raise ConfigError(
                f"--set {item!r}: {path.name} sweeps {clash}, which sets it in every run; change its sweep "
                f"list instead"
            )
        try:
            _set(raw, key, yaml_value(value), f"{path.name}: --set ")
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({exc})") from None
    cfg = validate(raw, f"{path.name}: ")
    expand(cfg, where=f"{path.name}: ")
    return cfg


# ---------------------------------------------------------------- sweeps


def _parents(dotted: str) -> list[str]:
    """The sections above a dotted path: ``a.b.c`` -> ``a``, ``a.b``."""
    keys = dotted.split(".")
    return [".".join(keys[:i]) for i in range(1, len(keys))]


def _overlap(a: str, b: str) -> bool:
    """Whether setting dotted path ``a`` and setting ``b`` touch the same value: one path, or one a
    section above the other."""
    return a == b or a in _parents(b) or b in _parents(a)


def _set(tree: dict, dotted: str, value: Any, where: str) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{where}{dotted}: {key!r} is not a section")
        node = child
    node[keys[-1]] = copy.deepcopy(value)


def _label(path: str, value: Any) -> str:
    """``path=value``; a component with options as ``name,option=value,...``
    (``rule=bulyan,f=0.2``). Only letters, digits and ``. , = _ -``: a run folder's name never needs
    shell quoting."""
    key = path.removesuffix(".name")
    if isinstance(value, dict):
        value = ",".join([value.get("name", ""), *(f"{k}={v}" for k, v in value.items() if k != "name")])
    text = re.sub(r"(?<=\d)e\+(?=\d)", "e", f"{key}={value}")  # 1e+20 -> 1e20, not 1e-20
    return re.sub(r"[^A-Za-z0-9.,=_-]+", "-", text)


def shell_safe(label: str) -> str:
    """A run label as fedtrust names it now from one named the earlier way: ``rule=bulyan(f=0.2)_seed=0`` ->
    ``rule=bulyan,f=0.2_seed=0`` (the only characters older labels had that a shell reads)."""
    return label.replace("(", ",").replace(")", "")


def expand(cfg: ExperimentConfig, where: str = "") -> list[tuple[str, ExperimentConfig]]:
    """The runs of a config: one per combination of the sweep lists, each with a readable label. A key
    joining paths with "+" takes lists of as many values and sets those paths together."""
    if not cfg.sweep:
        return [("run", cfg)]
    base = cfg.model_dump(exclude={"sweep"}, exclude_unset=False)
    keys = list(cfg.sweep)
    for key in keys:
        if not cfg.sweep[key]:
            raise ConfigError(f"{where}sweep.{key}: an empty list would make no runs; give its values")
        parts = key.split("+")
        if len(parts) > 1:
            for n, value in enumerate(cfg.sweep[key]):
                if not isinstance(value, list) or len(value) != len(parts):
                    raise ConfigError(
                        f"{where}sweep.{key}[{n}]: needs {len(parts)} values (one per path), got {value!r}"
                    )
    paths = [p for key in keys for p in key.split("+")]
    for i, path in enumerate(paths):
        if path == "sweep" or path.startswith("sweep."):
            raise ConfigError(f"{where}sweep.{path}: a sweep cannot sweep the sweep; list its paths directly")
        clash = next((p for p in paths[:i] if _overlap(path, p)), None)
        if clash is not None:  # one would set the other again in every run: labels naming what did not run
            raise ConfigError(
                f"{where}sweep: {clash} and {path} are swept both, and one sets the other in every run; "
                "sweep one of them (a section's values can hold the other's)"
            )
    runs = []
    for combo in itertools.product(*(cfg.sweep[k] for k in keys)):
        tree = copy.deepcopy(base)
        labels = []
        for key, value in zip(keys, combo, strict=True):
            parts = key.split("+")
            values = value if len(parts) > 1 else [value]
            for path, v in zip(parts, values, strict=True):
                if isinstance(v, dict) and path.endswith(".name"):
                    raise ConfigError(
                        f"{where}sweep.{path}: values are names; sweep the section ({path[:-5]}) for dicts"
                    )
                _set(tree, path, v, f"{where}sweep.")  # a dict value replaces the whole section
            labels += [
                _label(p, v)
                for p, v in zip(parts, values, strict=True)
                if p == parts[0] or not p.endswith(".seed")
            ]
        label = "_".join(labels)
        runs.append((label, validate(tree, f"{where}sweep run {label}: ")))
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        twice = sorted({label for label in labels if labels.count(label) > 1})
        raise ConfigError(
            f"{where}sweep: runs share the label {twice[0]!r} (a run folder's name keeps only letters, "
            "digits and . , = _ -); make the swept values distinct there"
        )
    return runs
