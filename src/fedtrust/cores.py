"""How many CPU cores this process may run on."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may use: its CPU affinity where the system has one (``taskset``, or a
    container's cpuset, may give it fewer than the machine's ``os.cpu_count()``), else the machine's
    count. A CPU quota (``docker --cpus``) limits time, not cores, and is not counted here."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
