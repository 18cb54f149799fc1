"""One chunking policy for every kernel: an (n, d) matrix, or (I, J, K) tasks, is walked in blocks of
whole columns (every client's entries of a coordinate range) whose size in bytes is one of three
budgets (:data:`BUDGETS`), named for what a block must fit:

- ``"stream"`` (16 MiB): a block read once by one vectorised kernel (a GEMM, a sort, a norm);
  temporaries of a few times this stay below glibc's 32 MiB mmap threshold, so they reuse heap pages
  instead of faulting in fresh ones every block (twice as fast as 32 MiB for the pass-based rules).
  Sorting a block holds values + int64 indices (3x this). n = 100 clients x d = 10 million float32
  coordinates (4 GB) aggregate inside 24 GB.
- ``"cached"`` (4 MiB): a block read twice in one fused pass, the second time from cache
  (:class:`~fedtrust.aggregators.passes.CombinationPasses`, the inference estimators' moments).
- ``"select"`` (2 MiB): a block one thread selects ranks in, small enough that it (and on the numpy
  path its transposed copy) stays in L2 (:mod:`~fedtrust.aggregators.rank_windows`).

A block is as many columns as fit the budget, at least one (:func:`column_width`). The budgets are
read when a block list is made, so a test can shrink them all at once to cross block boundaries.
"""

from __future__ import annotations

import torch

#: Bytes of the input per block, by what the block must fit.
BUDGETS = {"stream": 1 << 24, "cached": 1 << 22, "select": 1 << 21}
#: On a device other than the CPU a block is a few kernel launches, not a cache's worth of work: blocks
#: sized for CPU caches would launch thousands of small kernels per pass (n = 100 x d = 1e7 float32 is
#: 239 "stream" blocks), so there every budget is this many times larger (512 MiB "stream").
DEVICE_SCALE = 32


def column_width(x: torch.Tensor, budget: str) -> int:
    """Columns (entries of the last dimension) per block of ``x`` within the ``budget``'s bytes (a key of
    :data:`BUDGETS`, times :data:`DEVICE_SCALE` off the CPU), at least one."""
    scale = 1 if x.device.type == "cpu" else DEVICE_SCALE
    return max(1, BUDGETS[budget] * scale // max(1, x[..., :1].numel() * x.element_size()))


def column_blocks(x: torch.Tensor, budget: str = "stream") -> list[slice]:
    """Slices of the last dimension of ``x`` covering about the ``budget``'s bytes of it each."""
    d, width = x.shape[-1], column_width(x, budget)
    return [slice(start, min(d, start + width)) for start in range(0, d, width)]
