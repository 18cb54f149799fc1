"""One progress bar for every long command: the sweep runner's rounds, the paper experiments' runs,
tables and folds (rich; silent when disabled, so logs and CI stay clean).

    with Progress(total=len(jobs), unit="runs") as bar:
        for job in jobs:
            ...
            bar.advance(1, job.name)
"""

from __future__ import annotations


class Progress:
    """A progress bar over ``total`` steps, each :meth:`advance` naming what just finished."""

    def __init__(self, total: int, enabled: bool = True, unit: str = "rounds"):
        self.enabled = enabled
        self.total = total
        self.unit = unit

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(self.unit),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.unit, total=self.total)
        return self

    def advance(self, n: int = 1, label: str = "") -> None:
        """``n`` more steps done; ``label`` (cut to 60 characters) says which."""
        if self.enabled and n:
            self._bar.update(self._task, advance=n, description=label[:60])

    def __exit__(self, *exc) -> bool:
        if self.enabled:
            self._bar.__exit__(*exc)
        return False
