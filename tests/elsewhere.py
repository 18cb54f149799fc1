"""A device that is not the CPU, emulated on the CPU: what a GPU path sees, testable without a GPU.

``Elsewhere`` tensors hold real CPU data but report ``device("meta")`` (a non-CPU device every torch
build has). Under :func:`elsewhere` every torch operation is checked as a GPU would check it:

- an operation mixing an elsewhere tensor with a CPU tensor of one or more dimensions raises
  torch's "Expected all tensors to be on the same device" (a 0-dim CPU tensor mixes, as on CUDA;
  ``copy_`` crosses devices, as on CUDA);
- factory functions given ``device=x.device`` make elsewhere tensors; ``.to(x.device)`` moves there;
- ``.cpu()`` / ``.to("cpu")`` and ``.item()`` / ``.tolist()`` are host transfers and are counted
  (:attr:`Host.syncs`), so a test can say how often a rule reads a scalar;
- every other operation on the device that computes (not a view, an allocation or a transfer) is a
  kernel a GPU would launch, and is counted (:attr:`Host.launches`): at a small round a GPU's time is
  its launches and syncs, not its reads of memory;
- CPU tensors copied to the device (``.to(x.device)``, ``copy_``, a CPU index tensor indexing a device
  tensor) are counted (:attr:`Host.uploads`): on CUDA such a copy from pageable memory waits for the
  kernels already queued, as a sync does;
- ``.numpy()`` fails, as on CUDA.

Results are computed on the CPU with the same kernels, so a rule's output on this device can be
compared with its CPU output exactly.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

DEVICE = torch.device("meta")
_aten = torch.ops.aten
#: operations that may mix devices (as CUDA allows): copies and the host transfers themselves
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten.copy.default}
#: advanced indexing takes CPU index tensors on any device (its second argument), as CUDA does
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default}  # fmt: skip
#: operations that move data to the host
_SYNCS = {_aten._local_scalar_dense.default}
#: operations on the device that launch no kernel: allocations (views are told by their schema)
_NO_KERNEL = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
              _aten.lift_fresh.default, _aten.detach.default}  # fmt: skip


def _computes(func) -> bool:
    """Whether an operation computes (a kernel on a device), not a view or an allocation."""
    return not func.is_view and func not in _NO_KERNEL


class Elsewhere(torch.Tensor):
    """A CPU tensor presented as living on :data:`DEVICE`."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        assert not isinstance(elem, Elsewhere) and elem.device.type == "cpu"
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=DEVICE,
            requires_grad=elem.requires_grad,
        )
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"Elsewhere({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"an elsewhere tensor reached {func} outside fedtrust's tests' elsewhere() mode")

    def numpy(self, *args, **kwargs):
        raise TypeError(
            f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
            "to host memory first."
        )

    def __array__(self, *args, **kwargs):
        return self.numpy()

    # A list index is made into a tensor on the indexed tensor's device below the dispatcher, which for
    # the emulated device would be a real meta tensor without values: it is made on the CPU instead
    # (CPU index tensors index any device, as on CUDA).
    def __getitem__(self, index):
        return super().__getitem__(_index(index))

    def __setitem__(self, index, value):
        return super().__setitem__(_index(index), value)

    def tolist(self):
        _ACTIVE[-1].syncs += 1
        return self.elem.tolist()


def _index(index):
    if isinstance(index, list):
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(_index(i) for i in index)
    return index


def to_elsewhere(x):
    """``x`` (a tensor or a structure of them) on the emulated device."""
    return tree_map(lambda t: Elsewhere(t) if isinstance(t, torch.Tensor) and not isinstance(t, Elsewhere)
                    else t, x)  # fmt: skip


def on_host(x):
    """The CPU tensors behind elsewhere tensors (anything else unchanged)."""
    return tree_map(lambda t: t.elem if isinstance(t, Elsewhere) else t, x)


@dataclass
class Host:
    """What a block under :func:`elsewhere` asked of the host."""

    syncs: int = 0  # scalars read (.item(), .tolist(), bool(t), float(t), ...)
    transfers: int = 0  # tensors copied to the CPU
    #: CPU tensors copied to the device (``.to(device)``, ``copy_``, a CPU index into a device tensor): on
    #: CUDA a copy from pageable memory waits for the kernels already queued, as a sync does
    uploads: int = 0
    kernels: Counter = field(default_factory=Counter)  # kernels the device ran, by operation name
    host_ops: int = 0  # operations that compute on CPU tensors (a rule's arithmetic on n numbers)

    @property
    def launches(self) -> int:
        """Kernels the device ran (operations that compute there: not views or allocations)."""
        return sum(self.kernels.values())


def _uploads(func, args, wants_here: bool) -> int:
    """CPU tensors an operation copies to the device: the source of a ``.to(device)`` or of a ``copy_``
    into a device tensor, and the CPU index tensors of an indexing operation."""
    if func is _aten._to_copy.default:
        return int(wants_here and not isinstance(args[0], Elsewhere))
    if func is _aten.copy_.default:
        return int(isinstance(args[0], Elsewhere) and not isinstance(args[1], Elsewhere))
    if func in _INDEXING:
        return sum(isinstance(i, torch.Tensor) and not isinstance(i, Elsewhere) for i in _leaves(args[1:2]))
    return 0


class _Mode(TorchDispatchMode):
    def __init__(self, host: Host):
        super().__init__()
        self.host = host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        here = [a for a in flat if isinstance(a, Elsewhere)]
        wants = kwargs.get("device")
        wants_here = wants is not None and torch.device(wants).type == DEVICE.type
        if not here and not wants_here:
            if any(a.device.type == DEVICE.type for a in flat):
                raise RuntimeError(f"{func}: a real meta tensor (no data) reached the elsewhere device")
            self.host.host_ops += _computes(func)
            return func(*args, **kwargs)
        lost = [a for a in flat if not isinstance(a, Elsewhere) and a.device.type == DEVICE.type]
        if lost:  # made on the device below the dispatcher: its values are gone (see Elsewhere.__getitem__)
            raise RuntimeError(f"{func}: a tensor made on the emulated device without its values reached it")
        self.host.uploads += _uploads(func, args, wants_here)
        if func in _SYNCS:
            self.host.syncs += 1
            return func(*on_host(args), **on_host(kwargs))
        if func not in _CROSSING:
            checked = flat
            if func in _INDEXING:
                checked = [a for a in _leaves((args[:1], args[2:], kwargs)) if isinstance(a, torch.Tensor)]
            for a in checked:
                if not isinstance(a, Elsewhere) and a.dim() > 0:
                    raise RuntimeError(
                        f"Expected all tensors to be on the same device, but found at least two devices, "
                        f"{DEVICE} and {a.device}! ({func})"
                    )
        to_host = func is _aten._to_copy.default and wants is not None and not wants_here
        if func is _aten._to_copy.default and wants is None and here:
            to_host = False  # a dtype change stays on the device
        gen = kwargs.get("generator")
        if gen is not None and gen.device.type != DEVICE.type and (wants_here or func not in _CROSSING):
            raise RuntimeError(
                f"Expected a '{DEVICE.type}' device type for generator but found '{gen.device.type}'"
            )
        kw = dict(kwargs)
        if wants_here:
            kw["device"] = torch.device("cpu")
        out = func(*on_host(args), **on_host(kw))
        if to_host:
            self.host.transfers += 1
            return out
        if _computes(func):
            self.host.kernels[func.__name__.split(".")[0]] += 1
        first = args[0] if args else None
        if isinstance(first, Elsewhere) and func._schema.name.endswith("_") and out is first.elem:
            # in place (squeeze_ and the like change the shape): the same wrapper, its metadata refreshed
            if first.shape != out.shape or first.stride() != out.stride():
                with no_dispatch():
                    _aten.as_strided_.default(first, out.size(), out.stride(), out.storage_offset())
            return first
        if func is _aten.copy_.default:
            return args[0]  # in place: the destination keeps its device
        return tree_map(lambda t: Elsewhere(t) if isinstance(t, torch.Tensor) else t, out)


class _Factories(TorchFunctionMode):
    """torch.tensor / as_tensor / asarray build their data below the dispatcher: given the emulated
    device they would make a real meta tensor (no data), so they are built on the CPU and moved."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wants = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor, torch.asarray) and wants is not None:
            if torch.device(wants).type == DEVICE.type:
                data = args[0]
                if isinstance(data, Elsewhere):
                    return func(*args, **kwargs) if func is not torch.tensor else data.clone()
                made = func(on_host(data), *args[1:], **{**kwargs, "device": "cpu"})
                return Elsewhere(made)
        return func(*args, **kwargs)


def _leaves(tree):
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tree)[0]


_ACTIVE: list[Host] = []


@contextlib.contextmanager
def elsewhere():
    """Run a block with every operation checked as on a separate device; yields its :class:`Host`."""
    host = Host()
    _ACTIVE.append(host)
    try:
        with _Factories(), _Mode(host):
            yield host
    finally:
        _ACTIVE.pop()
