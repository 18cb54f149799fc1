"""Aggregation rules over the core contract ``Round -> rule -> Aggregate``. Rules are found by name in
:mod:`fedtrust.rules` (``fedtrust.rule("krum", f=2)``), which sits above this package."""

from fedtrust.aggregators.base import BaseRule
from fedtrust.aggregators.core import (
    Aggregate,
    Info,
    NoValidUpdates,
    Reference,
    Round,
    RoundRefused,
    Rule,
    StatefulRule,
    leaving_out,
)
from fedtrust.aggregators.screening import FirstPass

__all__ = [
    "Aggregate",
    "BaseRule",
    "FirstPass",
    "Info",
    "NoValidUpdates",
    "Reference",
    "Round",
    "RoundRefused",
    "Rule",
    "StatefulRule",
    "leaving_out",
]
