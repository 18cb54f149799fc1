"""Helpers for tests that build simulator runs from a config."""

import copy

from fedtrust.sweeps.config import validate


def config(base: dict, **overrides):
    """``base`` with ``section__key=value`` overrides, validated."""
    base = copy.deepcopy(base)
    for key, value in overrides.items():
        node = base
        *path, last = key.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return validate(base)


def strip_times(records):
    """Round records without their timings (which differ between two runs of the same thing)."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "rule_seconds")} for r in records]
