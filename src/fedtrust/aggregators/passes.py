"""Passes over an (n, d) matrix that combine its rows: norms, a weighted sum, and the fused "combine,
then every row's distance to the combination" pass of the Weiszfeld-type rules. Work on the tensor's
own device and dtype, in column blocks (:mod:`~fedtrust.aggregators.chunks`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fedtrust.aggregators.chunks import column_blocks


def row_norms(x: torch.Tensor, each_block: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """float64 Euclidean norms over the last dimension of ``x`` ((n, d) -> (n,), (I, J, K) -> (I, J)):
    float32 norms per column chunk (one vectorised kernel, no temporary) summed in float64; one float32
    norm over 1e7 entries at once is off by up to 4e-4. A chunk whose norm overflows the dtype gives inf.
    ``each_block``: called with every chunk too, while it is in cache (:func:`norms_and_sketch`)."""
    sq = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    for cols in column_blocks(x, "stream"):
        sq += torch.linalg.vector_norm(x[..., cols], dim=-1).to(torch.float64).square()
        if each_block is not None:
            each_block(x[..., cols])
    return sq.sqrt()


def norms_and_sketch(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (n,) norms of the rows of an (n, d) ``x`` (:func:`row_norms` itself takes them), and in the
    same pass (each column block still in cache) their (n, k) float64 sketch: each row's sum over
    consecutive runs of ``width`` coordinates (a block's last run may be shorter), divided by the square
    root of the run's length. The runs are disjoint, so the sketch is an orthonormal projection of the rows:
    two sketches are never further apart than the rows they sketch (up to the sums' float rounding, about
    eps times the row's norm)."""
    parts: list[torch.Tensor] = []

    def sketch(block: torch.Tensor) -> None:
        runs = block.shape[1] // width
        if runs:
            parts.append(block[:, : runs * width].unflatten(1, (runs, width)).sum(-1).to(torch.float64))
            parts[-1] /= math.sqrt(width)
        if (rest := block.shape[1] - runs * width) > 0:
            parts.append(block[:, runs * width :].sum(-1, keepdim=True).to(torch.float64) / math.sqrt(rest))

    norms = row_norms(x, sketch)
    return norms, torch.cat(parts, 1) if parts else x.new_zeros(x.shape[0], 0, dtype=torch.float64)


#: Column runs handed to the threads of one batched product start at multiples of this many columns, so
#: a matrix-vector product's vector loops meet every column as they would in one call (the same sums, to
#: the bit; the run boundaries are at most ALIGN * threads columns from the end).
ALIGN = 4096


def batch_size(x: torch.Tensor) -> int:
    """How many column blocks of ``x`` one batched product takes: torch's thread count on the CPU, whose
    matrix-vector products (BLAS gemv) may run on one core (MKL's on an AMD EPYC do: a pass of them ran at
    half a 2-core machine's bandwidth), while a batch of them is shared among torch's threads; 1 on a
    device, whose single product already fills it."""
    return torch.get_num_threads() if x.device.type == "cpu" else 1


def columns(x: torch.Tensor, start: int, count: int, width: int) -> torch.Tensor:
    """(count, n, width) view of ``count`` consecutive runs of ``width`` columns of (n, d) ``x``."""
    return x[:, start : start + count * width].unflatten(1, (count, width)).transpose(0, 1)


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i x_i``, a single pass over ``x``: one matrix-vector product per thread over its run of
    columns (:func:`batch_size`, as one batched product), the columns left over in one more. ``w`` (m, n)
    gives the m weighted sums (m, d), one matrix product."""
    w, (n, d) = w.to(device=x.device, dtype=x.dtype), x.shape
    if w.dim() != 1 or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return w @ x  # (products with out= do not differentiate)
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    k = batch_size(x)
    width = ALIGN * (d // (ALIGN * k))
    if k > 1 and width:
        torch.bmm(w.expand(k, 1, n), columns(x, 0, k, width), out=out[: k * width].view(k, 1, width))
    else:
        k = width = 0
    torch.mv(x[:, k * width :].T, w, out=out[k * width :])
    return out


def moved(device: torch.device, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` (None kept) on ``device``, in one transfer when they are elsewhere: flattened into one
    buffer of their common dtype, moved, and split back, each in its own dtype (exactly for floating
    tensors: their common dtype holds every value of each)."""
    present = [t for t in tensors if t is not None]
    if all(t.device == device for t in present):
        return tensors
    buffer = torch.cat([t.reshape(-1) for t in present]).to(device)
    parts = iter(buffer.split([t.numel() for t in present]))
    return tuple(None if t is None else next(parts).view(t.shape).to(t.dtype) for t in tensors)


class CombinationPasses:
    """Repeated "combine, then every point's distance to the combination" passes over one data set: the
    Weiszfeld steps of the geometric median, centred clipping, IVAR-MLE's iterations. On the CPU the
    blocks' matrix-vector products go as batched products of one block per thread (:func:`batch_size`).

    x: (n, d), or (I, J, K) for I independent groups of J points (tasks of the inference module). Each
    call is one fused pass: per cache-sized chunk of coordinates, z = offset + sum_j w_j x_j (one
    matrix-vector product) and, while the chunk is in cache, each x_j . z (another); the squared
    distances follow from ||x_j||^2 - 2 x_j . z + ||z||^2, with the norms taken in the first pass and
    kept. Per-chunk float32 partial sums are added in float64. Where the expansion cancels (a distance
    below ``EXPANSION_FLOOR`` of ||x_j||^2 + ||z||^2, as when the points share a large common component)
    those distances are redone by explicit differences.

    With ``host`` the per-point results (norms, squared distances, the step, ``z_norm``) are returned on
    the CPU whatever x's device, and the weights may be given there: on a GPU a call then moves them in
    one transfer, and the caller's arithmetic on n numbers costs neither kernel launches nor a sync each
    (at a small round, launches and syncs are most of a GPU rule's time). On the CPU it changes nothing.
    """

    #: Squared distances below this fraction of ||x_j||^2 + ||z||^2 are recomputed by differences.
    EXPANSION_FLOOR = 1e-2

    def __init__(self, x: torch.Tensor, norms: torch.Tensor | None = None, host: bool = False):
        """``norms``: the points' norms if already known, else the first pass takes them
        (:meth:`norms` returns them, which makes that pass a rule's first pass: the front door screens
        on them). ``host``: the per-point results on the CPU (the class docstring)."""
        self.flat = x.dim() == 2
        self.x = x if x.dim() == 3 else x[None]
        self.small = torch.device("cpu") if host else x.device  # where the per-point results live
        i, j, k = self.x.shape
        # (I, J) float64 squared norms, given or from the first pass
        self.sq_norms = None if norms is None else norms.to(self.small, torch.float64).square().reshape(i, j)
        #: ||z|| of the last call's combination (float64, (I,) for tasks), from the pass's partial sums
        self.z_norm: torch.Tensor | None = None
        self.blocks = column_blocks(self.x, "cached")  # read twice: the second time from cache

    def _batches(self) -> list[tuple[int, int]]:
        """(first block, count) of the groups of blocks one pass takes at once: runs of up to
        :func:`batch_size` blocks of equal width for points (n, d) or one task (IVAR-MLE's round), in
        blocks of at least ``ALIGN`` columns; otherwise one block at a time."""
        if not self.blocks:
            return []
        width = self.blocks[0].stop - self.blocks[0].start
        full = [b.stop - b.start for b in self.blocks].count(width)
        k = batch_size(self.x) if self.x.shape[0] == 1 and width >= ALIGN else 1
        out = [(b, min(k, full - b)) for b in range(0, full, k)]
        return out + [(b, 1) for b in range(full, len(self.blocks))]

    def norms(self) -> torch.Tensor:
        """(n,) or (I, J) float64 norms of the points (:func:`row_norms`): one pass the first time unless
        they were given or a call took them, then kept."""
        if self.sq_norms is None:
            self.sq_norms = row_norms(self.x).square().to(self.small)
        out = self.sq_norms.sqrt()
        return out[0] if self.flat else out

    def __call__(
        self,
        w: torch.Tensor | None,
        offset: torch.Tensor | None = None,
        previous: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """z = offset + sum_j w_j x_j, the float64 squared distances ||x_j - z||^2 and ||z - previous||
        (0 without ``previous``; a float64 0-dim tensor, so it costs no sync unless read), in one pass.
        Shapes follow x: w (n,) or (I, J), or None for z = offset (distances to a given point); offset,
        previous and ``out`` (a buffer for z, which must not be ``previous``) (d,) or (I, K)."""
        x = self.x
        i, j, k = x.shape
        like = dict(dtype=x.dtype, device=x.device)
        w = None if w is None else w.reshape(i, j).to(device=x.device, dtype=x.dtype)
        offset = None if offset is None else offset.reshape(i, k)
        previous = None if previous is None else previous.reshape(i, k)
        z = torch.empty(i, k, **like) if out is None else out.reshape(i, k)
        parts = len(self.blocks)
        # every per-block result is written into one buffer, moved to ``small`` in one transfer
        sizes = [parts * i * j, parts * i, parts, parts * i * j if self.sq_norms is None else 0]

        def carve(buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:  # dots, z_sq, steps, norms
            dots, z_sq, steps, norms = buffer.split(sizes)
            return dots.view(parts, i, j), z_sq.view(parts, i), steps, norms.view(-1, i, j)

        buffer = torch.empty(sum(sizes), **like)
        dots, z_sq, steps, norms = carve(buffer)
        if previous is None:
            steps.zero_()
        for first, count in self._batches():
            group = self.blocks[first : first + count]
            if count > 1:  # the group's matrix-vector products as one batched product each (batch_size)
                lo, width = group[0].start, group[0].stop - group[0].start
                cb = columns(x[0], lo, count, width)
                zb = z[0, lo : lo + count * width].view(count, 1, width)
                if w is not None:
                    torch.bmm(w[0].expand(count, 1, j), cb, out=zb)
            for cols in group:
                c, zc = x[:, :, cols], z[:, cols]
                if w is None:
                    zc.copy_(offset[:, cols])
                elif i > 1:
                    zc.copy_(torch.einsum("ijk,ij->ik", c, w))
                elif count == 1:
                    torch.mv(c[0].T, w[0], out=zc[0])
                if w is not None and offset is not None:
                    zc += offset[:, cols]
            if count > 1:
                torch.bmm(zb, cb.transpose(1, 2), out=dots[first : first + count])
            for b, cols in enumerate(group, first):
                c, zc = x[:, :, cols], z[:, cols]
                if i == 1:
                    if count == 1:
                        torch.mv(c[0], zc[0], out=dots[b, 0])
                    torch.dot(zc[0], zc[0], out=z_sq[b, 0])
                else:
                    torch.bmm(c, zc[:, :, None], out=dots[b, :, :, None])
                    torch.linalg.vector_norm(zc, dim=1, out=z_sq[b]).square_()
                if self.sq_norms is None:
                    torch.linalg.vector_norm(c, dim=-1, out=norms[b])
                if previous is not None:
                    torch.linalg.vector_norm(zc - previous[:, cols], out=steps[b])
        if buffer.device != self.small:
            dots, z_sq, steps, norms = carve(buffer.to(self.small))
        if self.sq_norms is None:
            self.sq_norms = norms.to(torch.float64).square().sum(0)
        dots, z_sq = dots.to(torch.float64).sum(0), z_sq.to(torch.float64).sum(0)[:, None]
        self.z_norm = z_sq[:, 0].sqrt() if not self.flat else z_sq[0, 0].sqrt()
        sq = (self.sq_norms - 2 * dots + z_sq).clamp_min(0)
        unresolved = sq < self.EXPANSION_FLOOR * (self.sq_norms + z_sq)
        if unresolved.any():
            exact = torch.zeros(i, j, dtype=torch.float64, device=x.device)
            for cols in self.blocks:
                diff = x[:, :, cols] - z[:, None, cols]
                exact += torch.linalg.vector_norm(diff, dim=-1).to(torch.float64).square()
            sq = torch.where(unresolved, exact.to(self.small), sq)
        step = steps.to(torch.float64).square().sum().sqrt()  # a tensor: read it only if you need it
        if self.flat:
            return z[0], sq[0], step
        return z, sq, step
