"""What the CUDA rank-window path does when a Triton kernel cannot serve, checked without Triton or a
GPU: the kernels are replaced by launchers that fail as a GPU's would (``TRITON_INTERPRET`` lets CPU
tensors take the kernel path). ``test_triton_windows.py`` runs the kernels themselves in Triton's
interpreter where Triton is installed; ``test_cuda.py`` on the hardware."""

import pytest
import torch

from fedtrust.aggregators import triton_windows
from fedtrust.aggregators.bulyan import closest_to_median_by_sort
from fedtrust.aggregators.passes import row_norms
from fedtrust.aggregators.rank_windows import rank_window_by_sort


@pytest.fixture(autouse=True)
def kernel_path(monkeypatch):
    """CPU tensors on the kernel path, no failure recorded yet."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_windows, "FAILURES", {})


def test_each_kernel_serves_the_range_of_clients_it_measured_fastest_in():
    """In float32 the sort kernel up to SORT_CLIENTS, the count kernel up to COUNT_CLIENTS, the select
    kernel above; in float64 the select kernel from SELECT_FLOAT64 clients (it measured fastest there at
    10 and 100), the sort kernel below. Once the select kernel has failed, the count kernel takes its
    rounds."""
    sizes = (1, 9, 10, 16, 17, 20, 21, 64, 65, 100)
    assert [triton_windows.method_for(n) for n in sizes] == [
        "sort", "sort", "sort", "sort", "count", "count", "select", "select", "select", "select"
    ]  # fmt: skip
    assert [triton_windows.method_for(n, torch.float64) for n in sizes] == [
        "sort", "sort", "select", "select", "select", "select", "select", "select", "select", "select"
    ]  # fmt: skip
    triton_windows.FAILURES["select"] = "failed"
    assert [triton_windows.method_for(n, torch.float64) for n in (9, 10, 100)] == ["sort", "count", "count"]
    assert [triton_windows.method_for(n) for n in (20, 21, 100)] == ["count", "count", "count"]


def test_a_kernel_that_fails_hands_over_to_the_torch_path_once(monkeypatch):
    """A GPU or toolchain Triton cannot build for: a warning naming the kernel and the failure, the torch
    path's result, and no further attempt at that kernel; the other kernels keep serving."""

    def broken():
        def launch(*args, **kwargs):
            raise RuntimeError("no kernel image is available for execution on the device")

        return {name: {(1,): launch} for name in ("sort", "count", "select", "closest")}

    monkeypatch.setattr(triton_windows, "_kernels", broken)
    x = torch.randn(5, 40)
    with pytest.warns(RuntimeWarning, match="sort kernel failed .*no kernel image"):
        values, weights, norms = triton_windows.rank_window(x, 2, 3)
    want = rank_window_by_sort(x, 2, 3)
    torch.testing.assert_close(values, want[0])
    torch.testing.assert_close(weights, want[1])
    torch.testing.assert_close(norms, row_norms(x))
    assert not triton_windows.suits(x)
    assert triton_windows.suits(x, method="closest")  # Bulyan's kernel is not the one that failed
    with pytest.warns(RuntimeWarning, match="closest kernel failed .* Bulyan's second phase"):
        values, weights = triton_windows.closest_to_median(x, torch.tensor([0, 2, 4]), 1)
    want = closest_to_median_by_sort(x, torch.tensor([0, 2, 4]), 1)
    torch.testing.assert_close(values, want[0])
    torch.testing.assert_close(weights, want[1])
    assert set(triton_windows.FAILURES) == {"sort", "closest"}
    assert triton_windows.suits(torch.randn(20, 40))  # 20 clients: the count kernel, still serving
