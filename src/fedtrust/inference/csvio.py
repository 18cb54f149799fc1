"""CSV in and out for truth inference: rows = tasks, columns = sources, blank cells = missing."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import torch

from fedtrust.checkpoint import atomic_write_all
from fedtrust.inference.result import InferenceResult

_ID_HEADERS = {"", "task", "id", "item", "task_id"}
_MISSING = {"", "nan", "na", "n/a", "null"}


def read_estimates(path: str | Path) -> tuple[list[str], list[str], torch.Tensor]:
    """(task ids, source names, (tasks, sources) float64 estimates with NaN where blank).

    The header names the sources; a first column headed '', 'task', 'id', 'item' or 'task_id' holds
    task ids (otherwise tasks are numbered from 0). A first row of numbers only is refused (a file without
    a header). A blank (or nan / NA) cell is a missing estimate; text or an infinite value is an error
    naming the line and the source."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"estimates file {path} does not exist")
    if path.is_dir():
        raise ValueError(f"estimates file {path} is a folder; give the CSV file")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # a BOM (Excel) is not a name
            reader = csv.reader(fh)
            numbered = [(reader.line_num, row) for row in reader if any(cell.strip() for cell in row)]
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
        ) from None
    if len(numbered) < 2:
        raise ValueError(f"{path}: needs a header row naming the sources and at least one task row")
    lines, rows = zip(*numbered, strict=True)
    header = [h.strip() for h in rows[0]]
    if all(_number(h) is not None for h in header if h):
        raise ValueError(
            f"{path}, line {lines[0]}: the first row holds numbers, not source names; add a header row "
            "naming the sources (numbered sources: head a first column of task ids 'task')"
        )
    has_ids = header[0].lower() in _ID_HEADERS
    sources = header[1:] if has_ids else header
    first = 2 if has_ids else 1  # the sources' first column, counted from 1 as a spreadsheet does
    seen: dict[str, int] = {}
    for k, source in enumerate(sources, start=first):
        if not source:
            raise ValueError(f"{path}, line {lines[0]}: column {k} has no source name; name every source")
        if source in seen:
            raise ValueError(
                f"{path}, line {lines[0]}: source {source!r} names columns {seen[source]} and {k}; each "
                "source needs its own name (its results are written by name)"
            )
        seen[source] = k
    tasks, values, task_line = [], [], {}
    for k, (n, row) in enumerate(zip(lines[1:], rows[1:], strict=True)):
        cells = row[1:] if has_ids else row
        if len(cells) > len(sources):
            raise ValueError(
                f"{path}, line {n}: {len(cells)} values but {len(sources)} sources in the header"
            )
        cells = cells + [""] * (len(sources) - len(cells))
        parsed = []
        for source, cell in zip(sources, cells, strict=True):
            cell = cell.strip()
            parsed.append(_value(cell, f"{path}, line {n}, source {source!r}"))
        task = row[0].strip() if has_ids else str(k)
        if task in task_line:
            raise ValueError(
                f"{path}, line {n}: task {task!r} is also on line {task_line[task]}; each task needs its own "
                "id (its consensus is written by id)"
            )
        task_line[task] = n
        tasks.append(task)
        values.append(parsed)
    x = torch.tensor(values, dtype=torch.float64)
    empty = [s for s, column in zip(sources, x.isnan().all(0).tolist(), strict=True) if column]
    if empty:
        raise ValueError(
            f"{path}: source {empty[0]!r} has no estimate (every cell of its column is blank); drop its "
            "column, since nothing can be said of its reliability"
        )
    blank = x.isnan().all(1).tolist() if sources else []  # (no sources: the caller says so)
    if any(blank):
        task = tasks[blank.index(True)]
        raise ValueError(f"{path}, line {task_line[task]}: task {task!r} has no estimate (every cell of its "
                         "row is blank); drop the row or give it an estimate")  # fmt: skip
    return tasks, sources, x


def _value(cell: str, where: str) -> float:
    """A cell's estimate: NaN for a blank (or nan / NA) cell, an error for text or an infinite value."""
    if cell.lower() in _MISSING:
        return math.nan
    value = _number(cell)
    if value is None:
        raise ValueError(f"{where}: {cell!r} is not a number")
    if not math.isfinite(value):
        raise ValueError(f"{where}: {cell!r} is not finite; leave the cell blank for a missing estimate")
    return value


def _number(text: str) -> float | None:
    """``text`` as a number a spreadsheet writes, or None: Python's ``float`` also reads ``1_000`` as 1000
    and other scripts' digits (``'１２'``), which no CSV means as numbers."""
    if not text.isascii() or "_" in text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def results_paths(out: str | Path) -> tuple[Path, Path]:
    """Where :func:`write_results` writes: ``out`` and ``<out stem>_sources.csv`` beside it."""
    out = Path(out)
    return out, out.with_name(out.stem + "_sources.csv")


def write_results(
    out: str | Path, tasks: list[str], sources: list[str], result: InferenceResult
) -> tuple[Path, Path]:
    """``out`` (task, consensus) and ``<out stem>_sources.csv`` (source, tasks, noise, reliability,
    mean weight). Both are refused before either is written when one of them is a folder, and both are
    written in full before either replaces what is there (:func:`~fedtrust.checkpoint.atomic_write_all`):
    a write that fails leaves the old results, not a new consensus beside an old per-source file."""
    paths = results_paths(out)
    for path in paths:
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder")
    consensus = result.consensus.reshape(len(tasks), -1)
    names = (
        ["consensus"] if consensus.shape[1] == 1 else [f"consensus_{k}" for k in range(consensus.shape[1])]
    )
    rows = [[task, *(f"{v:.10g}" for v in row)] for task, row in zip(tasks, consensus.tolist(), strict=True)]
    per_source = [
        [source, count, f"{float(result.noise[j]):.6g}", f"{float(result.reliability[j]):.6g}", f"{mean:.6g}"]
        for j, (source, (count, mean)) in enumerate(zip(sources, answered(result), strict=True))
    ]
    texts = [
        _csv(["task", *names], rows),
        _csv(["source", "tasks", "noise", "reliability", "mean_weight"], per_source),
    ]
    atomic_write_all(dict(zip(paths, texts, strict=True)))
    return paths


def _csv(header: list[str], rows: list[list]) -> str:
    buffer = io.StringIO(newline="")
    w = csv.writer(buffer)
    w.writerow(header)
    w.writerows(rows)
    return buffer.getvalue()


def answered(result: InferenceResult) -> list[tuple[int, float]]:
    """Per source: how many tasks it reported on (its weight is 0 where it did not) and its mean weight
    over them (NaN for none)."""
    counts = (result.weights != 0).sum(0).tolist()
    sums = result.weights.sum(0).tolist()
    return [(c, s / c if c else math.nan) for c, s in zip(counts, sums, strict=True)]
