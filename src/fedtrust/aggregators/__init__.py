"""Aggregation rules over the core contract ``Round -> rule -> Aggregate``."""

from fedtrust.aggregators.core import (
    Aggregate,
    BaseRule,
    NoValidUpdates,
    Round,
    Rule,
    StatefulRule,
    leaving_out,
)
from fedtrust.aggregators.registry import RULES, UnknownRuleError, available, rule, rule_options

__all__ = [
    "RULES",
    "Aggregate",
    "leaving_out",
    "BaseRule",
    "NoValidUpdates",
    "Round",
    "Rule",
    "StatefulRule",
    "UnknownRuleError",
    "available",
    "rule",
    "rule_options",
]
