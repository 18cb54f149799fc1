"""The one registry of rules: names -> classes, with real imports. It sits above the layers that define
rules (``aggregators``, ``inference``, ``probabilistic``), so none of them imports it; adding a rule is
one file plus one line in ``RULES``.

    from fedtrust import rule
    rule("krum", f=2)
    rule("fedag", base="ivar_vb", base_options={"window": 5})   # a rule over another rule
    rule("nnm+median")                                          # pre-aggregators before a rule
    rule("median", pre=["nnm", {"name": "bucketing", "s": 3}])  # the same, with options

Pre-aggregators (``PRE_AGGREGATORS``: NNM, bucketing, static clipping, ARC;
:mod:`fedtrust.aggregators.pre`) are written before the rule's name, joined by ``+`` and applied left to
right, each with its default options, or listed in the rule's ``pre`` option as names or
``{"name": ..., options}`` dicts. The other options are the rule's; a pre-aggregator whose ``f`` is left
at None (NNM's, ARC's) takes the rule's ``f`` when one is given (``rule("nnm+krum", f=2)``: NNM mixes
n - 2 neighbours), else floor((n - 1) / 2). Where the rule has no ``f`` and a pre-aggregator does, ``f``
is the pre-aggregators' alone (``rule("arc+mean", f=0.2)``: ARC clips for a fifth of the clients).

A rule written outside fedtrust is added with :func:`register` and is then usable by name everywhere:
configs, ``fedtrust run``, FedAG's ``base`` and the Flower strategy (``examples/custom_rule.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedtrust.aggregators.arfl import ARFL
from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.bulyan import Bulyan
from fedtrust.aggregators.centered_clipping import CenteredClipping
from fedtrust.aggregators.cfl import CFL
from fedtrust.aggregators.dnc import DnC
from fedtrust.aggregators.flame import FLAME
from fedtrust.aggregators.fltrust import FLTrust
from fedtrust.aggregators.focus import FOCUS
from fedtrust.aggregators.foolsgold import FoolsGold
from fedtrust.aggregators.geometric_median import GeometricMedian
from fedtrust.aggregators.krum import Krum, MultiKrum
from fedtrust.aggregators.mean import FedAvg, Mean
from fedtrust.aggregators.median import CoordinateMedian
from fedtrust.aggregators.norm_bounding import NormBounding
from fedtrust.aggregators.pre import ARC, NNM, Bucketing, Clipping, PreAggregated, PreAggregator
from fedtrust.aggregators.trimmed_mean import TrimmedMean
from fedtrust.inference.rules import IcovMLE, IcovVB, IvarMLE, IvarVB
from fedtrust.probabilistic.fedag import FedAG
from fedtrust.registry import UnknownNameError, add, build, lookup, options_of

__all__ = [
    "PRE_AGGREGATORS",
    "RULES",
    "UnknownRuleError",
    "available",
    "register",
    "rule",
    "rule_options",
]


def fedag(base: str = "mean", base_options: dict | None = None) -> FedAG:
    """FedAvg-Gaussian over the registered rule ``base`` built with ``base_options``
    (:class:`~fedtrust.probabilistic.fedag.FedAG`)."""
    if base_options is not None and not isinstance(base_options, dict):
        raise TypeError(
            f"fedag: base_options must be a dict of the base rule's options, got {base_options!r}"
        )
    try:
        return FedAG(rule(base, **(base_options or {})))
    except UnknownNameError as exc:
        raise UnknownNameError(f"fedag: base {exc}") from None


fedag.name, fedag.paper = FedAG.name, FedAG.paper  # type: ignore[attr-defined]

#: Rule name -> class (or builder): every rule fedtrust ships.
RULES: dict[str, Callable[..., BaseRule]] = {
    "mean": Mean,
    "fedavg": FedAvg,
    "median": CoordinateMedian,
    "trimmed_mean": TrimmedMean,
    "geometric_median": GeometricMedian,
    "krum": Krum,
    "multi_krum": MultiKrum,
    "bulyan": Bulyan,
    "centered_clipping": CenteredClipping,
    "cfl": CFL,
    "norm_bounding": NormBounding,
    "dnc": DnC,
    "flame": FLAME,
    "foolsgold": FoolsGold,
    "fltrust": FLTrust,
    "arfl": ARFL,
    "focus": FOCUS,
    "ivar_mle": IvarMLE,
    "ivar_vb": IvarVB,
    "icov_mle": IcovMLE,
    "icov_vb": IcovVB,
    "fedag": fedag,
}

UnknownRuleError = UnknownNameError


def available() -> list[str]:
    """Registered rule names."""
    return list(RULES)


def rule_options(name: str) -> dict[str, Any]:
    """Option name -> default of a registered rule."""
    return options_of(lookup("rule", RULES, name))


#: Pre-aggregator name -> class: what may stand before a rule's name (``"nnm+median"``) or in its ``pre``.
PRE_AGGREGATORS: dict[str, Callable[..., PreAggregator]] = {
    "nnm": NNM,
    "bucketing": Bucketing,
    "clipping": Clipping,
    "arc": ARC,
}


def rule(name: str, **options: Any) -> BaseRule:
    """Build a registered rule from its name and keyword options, e.g. ``rule("krum", f=2)``; with
    pre-aggregators in front, ``rule("nnm+krum", f=2)`` or ``rule("krum", f=2, pre=["nnm"])`` (the module
    docstring)."""
    pre = options.pop("pre", None)
    given = name
    if isinstance(name, str) and "+" in name:
        if pre is not None:
            raise ValueError(
                f"rule {name!r}: give the pre-aggregators in the name or in pre=, not both (pre={pre!r})"
            )
        *pre, name = name.split("+")
    if isinstance(name, str) and name in PRE_AGGREGATORS and name not in RULES:
        order = "+".join([name, *(pre or ["median"])])
        raise ValueError(
            f"rule {given!r}: {name!r} is a pre-aggregator, which goes in front of a rule, the rule last "
            f"(e.g. {order!r}); pre-aggregators: {', '.join(PRE_AGGREGATORS)}"
        )
    if pre is None:
        return build("rule", RULES, name, options)
    specs = _pre_specs(pre)
    budget = options  # what the stages read their f from
    if (
        "f" in options
        and "f" not in options_of(lookup("rule", RULES, name))
        and any(_takes_f(n) for n, _ in specs)
    ):
        budget = {"f": options.pop("f")}  # the Byzantine budget is the stages' alone ("arc+mean", f=0.2)
    final = build("rule", RULES, name, options)
    stages = [_pre_aggregator(spec, budget) for spec in specs]
    return PreAggregated(stages, final) if stages else final


def _takes_f(name: str) -> bool:
    return "f" in options_of(lookup("pre-aggregator", PRE_AGGREGATORS, name))


def _pre_specs(pre: Any) -> list[tuple[str, dict[str, Any]]]:
    """``pre`` as (name, options) pairs: a list of names and ``{"name": ..., options}`` dicts."""
    if isinstance(pre, str | Mapping) or not isinstance(pre, Sequence):
        pre = [pre]
    specs = []
    for spec in pre:
        if isinstance(spec, str):
            specs.append((spec, {}))
        elif isinstance(spec, Mapping) and "name" in spec:
            specs.append((spec["name"], {k: v for k, v in spec.items() if k != "name"}))
        else:
            raise TypeError(
                "pre: each pre-aggregator is a name or a {'name': ..., options} dict "
                f"(one of {', '.join(PRE_AGGREGATORS)}), got {spec!r}"
            )
    return specs


def _pre_aggregator(spec: tuple[str, dict[str, Any]], rule_options: dict[str, Any]) -> PreAggregator:
    name, options = spec
    if options.get("f") is None and _takes_f(name) and "f" in rule_options:
        options = {**options, "f": rule_options["f"]}  # the rule's Byzantine budget, when given
    return build("pre-aggregator", PRE_AGGREGATORS, name, options)


def register(name: str, builder: Callable[..., Any], *, replace: bool = False) -> None:
    """Make ``builder`` (a rule class, or a function returning a rule) available as ``name`` everywhere a
    rule is named. A rule should derive from :class:`~fedtrust.aggregators.BaseRule` (its front door
    screens every round) and set ``name`` and ``paper``. Refuses to shadow a registered name unless
    ``replace``."""
    add("rule", RULES, name, builder, replace=replace)
