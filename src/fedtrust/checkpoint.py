"""Files fedtrust writes and reads back: written atomically, read without running code.

A *state tree* is what ``Simulation`` checkpoints and what a rule's ``state_dict()`` returns: dicts,
lists, tuples, torch tensors and Python ``None``/bool/int/float/str; dict keys are str or int (client ids).
:func:`save_state` writes one to a safetensors file: the tensors as its tensors, the structure as JSON in
its metadata, with a SHA-256 of the tensor bytes, so :func:`load_state` gives back the same tree (tuples
stay tuples, int keys stay ints, tensors keep dtype and shape, on the CPU) and a truncated or altered
file is refused instead of read. Nothing is unpickled: a planted file can fail to load, never execute.

Every write goes to a temporary file in the same folder, is flushed to disk, then renamed over the
target (and the folder entry synced), so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CorruptFileError", "atomic_write", "atomic_write_all", "load_state", "save_state"]

FORMAT = "fedtrust-state/1"


class CorruptFileError(ValueError):
    """A file fedtrust wrote cannot be read back as it was written (empty, truncated, altered, another
    format). The message names the file, what is wrong and what to do."""


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Replace ``path`` by ``data`` so that readers, and a crash at any point, see the old or the new
    content, never a part."""
    atomic_write_all({path: data})


def atomic_write_all(files: dict[str | Path, bytes | str]) -> None:
    """Replace each path of ``files`` by its data, every one written in full (to a temporary file beside
    it) before any is replaced: a write that fails (a full disk) leaves every old file, not a new one
    beside an old one. A crash between the replacements can still leave some replaced."""
    temporary = {}
    try:
        for path, data in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = temporary[path] = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                fh.write(data.encode() if isinstance(data, str) else data)
                fh.flush()
                os.fsync(fh.fileno())
        for path, tmp in temporary.items():
            os.replace(tmp, path)
            sync_folder(path.parent)
    finally:
        for tmp in temporary.values():
            tmp.unlink(missing_ok=True)


def sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the tree <-> (JSON, tensors)


def _encode(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if node is None or isinstance(node, bool | int | str):
        return node
    if isinstance(node, float):
        return node if math.isfinite(node) else {"$float": repr(node)}
    if isinstance(node, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = node.detach().to("cpu").contiguous().clone()
        return {"$tensor": key}
    if isinstance(node, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return {"$tuple": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(node)]}
    if isinstance(node, dict):
        for k in node:
            if isinstance(k, bool) or not isinstance(k, int | str):
                raise TypeError(f"{where}: dict keys must be str or int (client ids), got {k!r}")
        if all(isinstance(k, str) and not k.startswith("$") for k in node):
            return {k: _encode(v, tensors, f"{where}[{k!r}]") for k, v in node.items()}
        return {"$dict": [[k, _encode(v, tensors, f"{where}[{k!r}]")] for k, v in node.items()]}
    raise TypeError(
        f"{where}: a state holds dicts, lists, tuples, tensors, None, bool, int, float and str; "
        f"got {type(node).__name__}"
    )


def _decode(node: Any, tensors: dict[str, torch.Tensor], fail: Callable[[str], Exception]) -> Any:
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, fail) for v in node]
    if not isinstance(node, dict):
        raise fail(f"unexpected JSON value {node!r}")
    special = [k for k in node if k.startswith("$")]
    if not special:
        return {k: _decode(v, tensors, fail) for k, v in node.items()}
    if len(node) != 1:
        raise fail(f"malformed entry {node!r}")
    ((kind, value),) = node.items()
    if kind == "$tensor" and value in tensors:
        return tensors[value]
    if kind == "$tuple" and isinstance(value, list):
        return tuple(_decode(v, tensors, fail) for v in value)
    if kind == "$float" and value in ("nan", "inf", "-inf"):
        return float(value)
    if kind == "$dict" and isinstance(value, list):
        out = {}
        for pair in value:
            if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (int, str)):
                raise fail(f"malformed dict entry {pair!r}")
            out[pair[0]] = _decode(pair[1], tensors, fail)
        return out
    raise fail(f"malformed entry {node!r}")


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of named tensors: their names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def save_state(path: str | Path, tree: Any) -> None:
    """Write a state tree to ``path`` (a safetensors file), atomically."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    structure = json.dumps(_encode(tree, tensors, "state"), allow_nan=False)
    metadata = {"format": FORMAT, "structure": structure, "sha256": digest(tensors)}
    atomic_write(path, save(tensors, metadata=metadata))


def load_state(path: str | Path, remedy: str = "") -> Any:
    """The state tree :func:`save_state` wrote to ``path``. Raises :class:`CorruptFileError` naming the file,
    the fault and ``remedy`` when the file is empty, truncated, altered or not a fedtrust state file;
    ``FileNotFoundError`` when there is none."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)

    def fail(what: str) -> CorruptFileError:
        return CorruptFileError(f"{path}: {what}" + (f"; {remedy}" if remedy else ""))

    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    if path.stat().st_size == 0:
        raise fail("the file is empty")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            metadata = fh.metadata() or {}
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise fail(f"not a readable fedtrust state file ({exc})") from None
    if metadata.get("format") != FORMAT:
        raise fail(f"not a fedtrust state file (format {metadata.get('format')!r}, expected {FORMAT!r})")
    if metadata.get("sha256") != digest(tensors):
        raise fail("the tensor data does not match its checksum (the file was altered or damaged)")
    try:
        structure = json.loads(metadata.get("structure", ""))
    except json.JSONDecodeError as exc:
        raise fail(f"its structure is not valid JSON ({exc})") from None
    return _decode(structure, tensors, fail)
