"""Flower ArrayRecords <-> the flat vectors fedtrust rules aggregate.

The vector holds the record's floating-point arrays, in the global record's order (a reply's arrays are
matched by name), in the widest of their dtypes (at least float32: float64 arrays make a float64
vector). For a record built from
``module.state_dict()`` it is :class:`fedtrust.models.FlatModel`'s vector (parameters and batch norm's
running statistics). Other numeric arrays (integer buffers such as batch norm's ``num_batches_tracked``)
are not aggregated: a reply's must have the right shape, and the layout writes back the values of the
record it was built from (the global model's), exactly. Every array goes back in its own dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import Array, ArrayRecord


class MalformedReply(ValueError):
    """A client's reply that cannot be aggregated; the message is the recorded reason."""


class ArrayLayout:
    """The names, shapes and dtypes of a model's arrays, in order (from the global ArrayRecord), and the
    values of its non-floating arrays."""

    def __init__(self, record: ArrayRecord):
        self.names = list(record.keys())
        arrays = {k: record[k].numpy() for k in self.names}
        self.shapes = [tuple(arrays[k].shape) for k in self.names]
        self.dtypes = [np.dtype(arrays[k].dtype) for k in self.names]
        self.floating = [np.issubdtype(d, np.floating) for d in self.dtypes]
        self.sizes = [int(np.prod(s)) if f else 0 for s, f in zip(self.shapes, self.floating, strict=True)]
        self.size = sum(self.sizes)
        widest = np.result_type(
            np.float32, *(d for d, f in zip(self.dtypes, self.floating, strict=True) if f)
        )
        self.dtype = torch.from_numpy(np.zeros(0, widest)).dtype
        #: the non-floating arrays' values (kept, not aggregated)
        self.fixed = {
            k: np.array(arrays[k], copy=True) for k, f in zip(self.names, self.floating, strict=True) if not f
        }

    def check_start(self, record: ArrayRecord, what: str) -> None:
        """Refuse, naming ``what`` and the array, a starting model with nothing to aggregate (no floating
        array) or a non-finite value: every node's update would then be quarantined as its own fault."""
        if self.size == 0:
            raise ValueError(
                f"{what} holds no floating-point values to train (arrays: {self.names or 'none'})"
            )
        for name, floating in zip(self.names, self.floating, strict=True):
            values = record[name].numpy()
            if floating and not bool(np.isfinite(values).all()):
                nan, inf = int(np.isnan(values).sum()), int(np.isinf(values).sum())
                raise ValueError(
                    f"{what}[{name!r}] holds {nan} NaN and {inf} Inf of {values.size} values: every node's "
                    "update would be quarantined as non-finite; start from a finite model"
                )

    def check_model(self, model, what: str) -> None:
        """Refuse, naming ``what`` and the first array that differs, a :class:`fedtrust.models.FlatModel`
        whose vector is not this layout's (a server-side model other than the one the arrays are of)."""
        ours = [(n, s) for n, s, f in zip(self.names, self.shapes, self.floating, strict=True) if f]
        theirs = [(n, tuple(s)) for n, s in zip(model.names, model.shapes, strict=True)]
        if ours != theirs:
            first = next((a, b) for a, b in zip([*ours, None], [*theirs, None], strict=False) if a != b)
            raise ValueError(
                f"{what} is not the model of the global arrays ({model.size} values, the arrays "
                f"{self.size}): the arrays hold {first[0]}, the model {first[1]} (name, shape)"
            )

    def flatten(self, record: ArrayRecord) -> torch.Tensor:
        """The vector of ``record``'s floating arrays; raises :class:`MalformedReply` naming what does not
        fit."""
        if not isinstance(record, ArrayRecord):
            raise MalformedReply(f"expected an ArrayRecord, got {type(record).__name__}")
        keys = set(record.keys())
        missing = [k for k in self.names if k not in keys]
        extra = sorted(keys.difference(self.names))
        if missing or extra:
            raise MalformedReply(f"arrays do not match the model: missing {missing}, unexpected {extra}")
        parts = []
        for name, shape, floating in zip(self.names, self.shapes, self.floating, strict=True):
            try:
                values = record[name].numpy()
            except Exception as exc:  # a corrupt payload
                raise MalformedReply(f"array {name!r} cannot be read ({exc})") from None
            if tuple(values.shape) != shape:
                raise MalformedReply(f"array {name!r} has shape {tuple(values.shape)}, expected {shape}")
            if not np.issubdtype(values.dtype, np.number):
                raise MalformedReply(f"array {name!r} holds {values.dtype}, not numbers")
            if floating:
                parts.append(self._floats(name, values))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype)

    def _floats(self, name: str, values: np.ndarray) -> torch.Tensor:
        """A floating entry's values as a flat tensor of the layout's dtype: float16/32/64 in either byte
        order; integers, complex numbers and extended precision are refused (a cast would truncate or drop
        part of each value)."""
        if values.dtype.kind != "f" or values.dtype.itemsize > 8:
            raise MalformedReply(f"array {name!r} holds {values.dtype}, expected float16, float32 or float64")
        native = values.astype(values.dtype.newbyteorder("="), copy=False)
        return torch.as_tensor(np.ascontiguousarray(native), dtype=self.dtype).reshape(-1)

    def overflow(self, record: ArrayRecord) -> str | None:
        """Where :meth:`flatten` turned finite values of ``record`` into infinities (float64 1e39 read into
        a float32 vector), saying so; None where it did not."""
        over, top, arrays, own = 0, 0.0, [], 0
        for name, floating in zip(self.names, self.floating, strict=True):
            if floating:
                given = record[name].numpy().reshape(-1)
                finite = np.isfinite(given)
                lost = finite & ~np.isfinite(self._floats(name, given).numpy())
                own += int((~finite).sum())
                if lost.any():
                    over, top = over + int(lost.sum()), max(top, float(np.abs(given[lost]).max()))
                    arrays.append(f"{name!r} ({given.dtype})")
        if not over:
            return None
        dtype, most = str(self.dtype).removeprefix("torch."), torch.finfo(self.dtype).max
        also = f"; the reply also holds {own} NaN or Inf" if own else ""
        return (
            f"the reply's finite values overflow {dtype} when converted: {over} of them in "
            f"{', '.join(arrays)}, up to {top:.3g}, exceed {dtype}'s max {most:.3g}{also}"
        )

    def unflatten(self, vector: torch.Tensor) -> ArrayRecord:
        """An ArrayRecord of ``vector`` (each array in its own dtype) and the kept non-floating arrays."""
        if vector.shape != (self.size,):
            raise ValueError(f"expected a vector of {self.size} values, got shape {tuple(vector.shape)}")
        arrays = {}
        pieces = iter(
            vector.detach().cpu().split([s for s, f in zip(self.sizes, self.floating, strict=True) if f])
        )
        for name, shape, dtype, floating in zip(
            self.names, self.shapes, self.dtypes, self.floating, strict=True
        ):
            if floating:
                values = next(pieces).numpy().astype(dtype, copy=False).reshape(shape)
            else:
                values = self.fixed[name].copy()
            arrays[name] = Array(values)
        return ArrayRecord(arrays)
