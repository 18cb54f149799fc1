"""The CUDA rank-window kernel (``triton_windows``) gives the torch path's values and slots, ties
shared the same way, checked in Triton's CPU interpreter where Triton is installed (torch's CUDA builds
ship it; CI's CPU build does not, and skips). ``test_cuda.py`` runs it on the hardware."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from float_specials import assert_window_agrees, special_columns, windows
from hypothesis import given, settings
from hypothesis import strategies as st

from fedtrust.aggregators import triton_windows
from fedtrust.aggregators.bulyan import closest_to_median
from fedtrust.aggregators.passes import row_norms
from fedtrust.aggregators.rank_windows import rank_window, rank_window_by_sort

if torch.cuda.is_available():  # Triton's interpreter would take over its library for the whole process
    pytest.skip("CUDA is present: test_cuda.py runs the kernel on the device", allow_module_level=True)
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed (torch's CPU build lacks it)", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    """Triton's interpreter for this module's tests: set before Triton's first import (its library's
    functions are jitted at import) and for the kernel's lazy jitting; restored after, so other modules'
    CPU tensors keep the CPU path."""
    if "triton" in sys.modules:
        pytest.skip("Triton was imported before its interpreter could be set")
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    triton_windows._kernels.cache_clear()
    yield
    if before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = before
    triton_windows._kernels.cache_clear()


def check(x: torch.Tensor, lo: int, hi: int, method: str) -> None:
    """The kernel's window, slot shares and row norms against the torch path's and row_norms'."""
    triton_windows.FAILURES.clear()  # each check on its own: a failure is this call's
    values, weights, norms = triton_windows.rank_window(x, lo, hi, method)
    assert not triton_windows.FAILURES, triton_windows.FAILURES  # the kernel ran, not the torch fallback
    want_values, want_weights = rank_window_by_sort(x, lo, hi)
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(values, want_values, rtol=8 * x.shape[0] * eps, atol=8 * x.shape[0] * eps)
    torch.testing.assert_close(weights, want_weights, rtol=16 * eps, atol=16 * eps)
    torch.testing.assert_close(norms, row_norms(x), rtol=16 * eps, atol=0.0)


@settings(max_examples=25, deadline=None)  # the interpreter takes ~0.4 ms a padded value
@given(
    method=st.sampled_from(["sort", "count", "select"]),
    n=st.integers(1, 40),
    d=st.integers(1, 60),
    ties=st.sampled_from([0, 2, 5]),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_each_kernel_gives_the_torch_paths_window(method, n, d, ties, data, dtype):
    """Any window, continuous values or a few distinct ones (ties across the edges everywhere)."""
    lo = data.draw(st.integers(0, n - 1))
    hi = data.draw(st.integers(lo + 1, n))
    g = torch.Generator().manual_seed(n * 1009 + d)
    x = (
        torch.randn(n, d, generator=g, dtype=dtype)
        if not ties
        else torch.randint(0, ties, (n, d), generator=g)
    )
    check(x.to(dtype), lo, hi, method)


@pytest.mark.parametrize(
    "method, n",
    [(m, n) for m in ["sort", "count", "select"] for n in [10, triton_windows.SORT_CLIENTS, 40]]
    + [("count", triton_windows.MAX_CLIENTS), ("select", triton_windows.MAX_CLIENTS)],
)
def test_each_kernel_serves_up_to_the_limit_and_copies(n, method):
    """The median and trimmed windows, a group of copies among the clients (one window edge inside it),
    infinite entries, and a transposed (non-contiguous) input (the sort kernel, a minute in the
    interpreter at 100 clients, up to 40)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 200, generator=g)
    x[-n // 5 :] = x[-1]  # sybils: one vector sent by a fifth of the clients
    x[0, :3], x[1, 1:4] = torch.inf, -torch.inf
    for lo, hi in [(n // 2 - 1, n // 2 + 1), (n // 10, n - n // 10), (0, n - n // 5 + 1)]:
        check(x, lo, hi, method)
    check(x.T.contiguous().T, n // 2 - 1, n // 2 + 1, method)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_select_kernel_orders_values_as_comparisons_do(dtype):
    """The select kernel ranks the floats' bits, reordered: -0.0 and +0.0 one value (tied, shares split),
    an infinity, the largest exponents, subnormals, neighbours one unit in the last place apart, any sign
    (:mod:`float_specials`), in columns of 2 to 100 values, windows of one or two ranks (one descent)
    and of three, four and more (both edges found at once)."""
    for n in (2, 5, 16, 33, 100):
        x = special_columns(dtype, n)
        for lo, hi in windows(n):
            triton_windows.FAILURES.clear()
            got = triton_windows.rank_window(x, lo, hi, "select")
            assert not triton_windows.FAILURES, triton_windows.FAILURES
            assert_window_agrees(got, rank_window_by_sort(x, lo, hi), x)


def check_bulyan(x: torch.Tensor, selected: torch.Tensor, beta: int) -> None:
    """Bulyan's second phase by the kernel against the CPU path's numpy: the same values to the bit (the
    same float64 arithmetic in the same order) and the same slot shares to the dtype's rounding."""
    triton_windows.FAILURES.clear()
    values, weights = triton_windows.closest_to_median(x, selected, beta)
    assert not triton_windows.FAILURES, triton_windows.FAILURES
    want_values, slots = closest_to_median(x.numpy(), selected.sort().values.numpy(), beta)
    assert torch.equal(values, torch.from_numpy(want_values))
    eps = torch.finfo(x.dtype).eps
    torch.testing.assert_close(
        weights, torch.from_numpy(slots / slots.sum()).to(x.dtype), rtol=16 * eps, atol=16 * eps
    )


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 24),
    d=st.integers(1, 40),
    ties=st.sampled_from([0, 2, 5]),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_the_bulyan_kernel_gives_the_cpus_values_to_the_bit(n, d, ties, data, dtype):
    """Any selection of rows (in any order) and any beta, continuous values or a few distinct ones."""
    theta = data.draw(st.integers(1, n))
    beta = data.draw(st.integers(1, theta))
    g = torch.Generator().manual_seed(n * 1009 + d)
    x = (
        torch.randn(n, d, generator=g, dtype=dtype)
        if not ties
        else torch.randint(0, ties, (n, d), generator=g)
    )
    check_bulyan(x.to(dtype), torch.randperm(n, generator=g)[:theta], beta)


def test_the_bulyan_kernel_on_copies_and_a_transposed_input():
    """Bulyan's shapes (n = 4f + 3 and more, theta = n - 2f, beta = theta - 2f) with a group of copies
    among the selected clients, and a non-contiguous input."""
    g = torch.Generator().manual_seed(3)
    for n, f in [(7, 1), (11, 2), (40, 9)]:
        x = torch.randn(n, 64, generator=g)
        x[-(f + 1) :] = x[-1]
        theta, selected = n - 2 * f, torch.arange(n)[f:]
        check_bulyan(x, selected[: n - 2 * f], theta - 2 * f)
        check_bulyan(x.T.contiguous().T, selected[: n - 2 * f], theta - 2 * f)


def test_the_count_kernel_packs_its_tallies_up_to_1023_clients():
    """below << 20 | equal << 10 | equal of lower row at the largest n the packing holds: every entry
    tied (each tally at its limit), three distinct values (ties across both edges of every window, each
    value's count in the hundreds) and continuous values."""
    n = 1023
    g = torch.Generator().manual_seed(0)
    check(torch.zeros(n, 2), n // 2, n // 2 + 1, "count")
    few = torch.randint(0, 3, (n, 3), generator=g).float()
    for lo, hi in [(n // 2, n // 2 + 1), (100, n - 100), (0, 341), (682, n)]:
        check(few, lo, hi, "count")
    check(torch.randn(n, 2, generator=g), 100, n - 100, "count")


def test_rank_window_routes_to_the_kernel_and_off_it(monkeypatch):
    calls = []
    kernel = triton_windows.rank_window
    monkeypatch.setattr(triton_windows, "rank_window", lambda *a: calls.append(a) or kernel(*a))
    x = torch.randn(7, 50, dtype=torch.float64)
    values, weights, norms = rank_window(x, 3, 4)  # under the interpreter a CPU tensor takes the kernel
    assert len(calls) == 1
    torch.testing.assert_close(values, x.median(0).values)
    rank_window(torch.randn(triton_windows.MAX_CLIENTS + 1, 4), 3, 4)
    rank_window(torch.randn(3, 4, dtype=torch.float16), 1, 2)
    monkeypatch.setenv("FEDTRUST_TRITON", "0")
    rank_window(x, 3, 4)
    assert len(calls) == 1  # more clients than the kernel serves, float16, turned off: the other paths


def test_every_kernel_builds_for_a_hopper_gpu_without_spilling():
    """Triton compiles each kernel to sm_90 machine code (H100/H200) on this CPU, float32 and float64,
    at the tiles of 2 to 100 clients, with nothing spilled to local memory (``benchmarks/kernel_model.py
    --check``, in a process of its own: the interpreter builds no machine code)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parents[1] / "benchmarks" / "kernel_model.py"
    done = subprocess.run([sys.executable, script, "--check"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("local_bytes': 0") == 24  # 4 kernels x 2 dtypes x 3 sizes


def test_a_failed_select_kernel_hands_its_rounds_to_the_count_kernel(monkeypatch):
    """The select kernel failing to build or launch on a GPU: rounds of 65 or more clients take
    the count kernel (measured), not the torch path, from that call on; the warning says so."""
    real, launched = triton_windows._kernels(), []

    class Launcher:
        def __init__(self, method, fails):
            self.method, self.fails = method, fails

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(self.method)
                if self.fails:
                    raise RuntimeError("no kernel image is available for execution on the device")
                return real[self.method][grid](*args, **kwargs)

            return launch

    kernels = {name: Launcher(name, fails=name == "select") for name in real}
    monkeypatch.setattr(triton_windows, "_kernels", lambda: kernels)
    monkeypatch.setattr(triton_windows, "FAILURES", {})
    x = torch.randn(70, 50, generator=torch.Generator().manual_seed(70))
    with pytest.warns(RuntimeWarning, match="select kernel failed .* take the count kernel"):
        values, weights, norms = triton_windows.rank_window(x, 34, 36)
    assert launched == ["select", "count"]
    want = rank_window_by_sort(x, 34, 36)
    torch.testing.assert_close(values, want[0])
    torch.testing.assert_close(weights, want[1])
    torch.testing.assert_close(norms, row_norms(x), rtol=16 * torch.finfo(x.dtype).eps, atol=0.0)
    assert triton_windows.method_for(70) == "count"
    triton_windows.rank_window(x, 7, 63)
    assert launched == ["select", "count", "count"]
