"""Helpers for tests that build simulator runs from a config."""

import copy
import subprocess
import sys
import textwrap
from contextlib import contextmanager

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


@contextmanager
def lock_held_elsewhere(folder):
    """Another process holding ``folder``'s run lock (``RunStore(folder).lock()``) while the block runs;
    yields that process (its ``pid`` is what a refusal names)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys
            from fedtrust.sim.store import RunStore
            with RunStore({str(folder)!r}).lock():
                print("locked", flush=True)
                sys.stdin.read()
        """),
        ],  # fmt: skip
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.communicate("")
