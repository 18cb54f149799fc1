"""Columns of the floats an order-preserving bit trick can get wrong, and the windows to rank them in:
the select kernel's checks in Triton's interpreter (``test_triton_windows.py``) and on CUDA
(``test_cuda.py``) share them."""

from __future__ import annotations

import torch


def special_columns(dtype: torch.dtype, n: int, d: int = 64, seed: int = 7) -> torch.Tensor:
    """(n, d) of -0.0 and +0.0 (one value to a comparison), an infinity, the largest exponents (a hundred
    of them still sum below the largest float), subnormals, neighbours one unit in the last place apart,
    each sign, drawn at random: many ties across any window's edges."""
    info = torch.finfo(dtype)
    one = torch.tensor(1.0, dtype=dtype)
    big = info.max / 128
    values = torch.tensor(
        [0.0, -0.0, torch.inf, big, -big, info.tiny, -info.tiny, info.smallest_normal / 4,
         -info.smallest_normal / 4, 1.0, -1.0, torch.nextafter(one, 2 * one).item(),
         -torch.nextafter(one, 2 * one).item(), 0.0, -0.0, -big / 2],
        dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + n)
    return values[torch.randint(0, len(values), (n, d), generator=g)]


def windows(n: int) -> set[tuple[int, int]]:
    """Windows (lo, hi) of one and two ranks (the select kernel's one descent) and of three, four and
    more (both edges at once), at both ends and the middle."""
    wanted = {(0, 1), (n - 1, n), (n // 2, n // 2 + 1), (n // 2 - 1, n // 2 + 1), (0, n), (n // 10, n - n // 10),
              (1, n), (0, 3), (n - 3, n), (n // 2 - 1, n // 2 + 3)}  # fmt: skip
    return {(lo, hi) for lo, hi in wanted if 0 <= lo < hi <= n}


def assert_window_agrees(got: tuple, want: tuple, x: torch.Tensor) -> None:
    """A kernel's (values, weights) against the torch path's on the same columns: the weights to the
    dtype's rounding; the means to the sum's, n eps times the column's largest finite magnitude (values
    whose window sums overflow, or hold both infinities, have no mean to agree on), infinities alike."""
    eps = torch.finfo(x.dtype).eps
    values, weights = (t.cpu() for t in got[:2])
    torch.testing.assert_close(weights, want[1], rtol=16 * eps, atol=16 * eps)
    scale = x.nan_to_num(posinf=0.0).abs().amax(0)
    assert ((values - want[0]).abs().nan_to_num() <= 8 * x.shape[0] * eps * scale).all()
    assert torch.equal(values.isinf(), want[0].isinf())
