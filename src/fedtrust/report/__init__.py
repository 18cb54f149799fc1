"""Reports: markdown tables and PNG plots from results on disk (``fedtrust report DIR``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from fedtrust.aggregators.sybils import CORRELATION
from fedtrust.report.figures import calibration, metric_curves, sweep_curves, trust_heatmaps
from fedtrust.report.results import Cell, Run, is_replicate, load_runs, missing, table
from fedtrust.report.style import slug
from fedtrust.sim.store import describe, is_number, this_code

__all__ = ["Run", "load_runs", "missing", "other_code", "write_report"]


def _cell(cell: Cell | None) -> str:
    """``mean ± sd`` over the finished runs' finite values, noting runs that failed or ended non-finite."""
    if cell is None:
        return "-"
    total = cell.count + cell.failed + cell.unfinished
    counted = ((cell.nonfinite, "non-finite"), (cell.failed, "failed"), (cell.unfinished, "unfinished"))
    notes = [f"{k}/{total} {what}" for k, what in counted if k]
    if cell.codes > 1:  # seeds computed by different code, averaged together (see Provenance)
        notes.append(f"{cell.codes} codes")
    finite = cell.count - cell.nonfinite
    if finite == 0:
        return "failed" if cell.failed and not (cell.nonfinite or cell.unfinished) else ", ".join(notes)
    text = f"{cell.mean:.3f} ± {cell.sd:.3f}" if finite > 1 else f"{cell.mean:.3f}"
    return text + (f" ({', '.join(notes)})" if notes else "")


def _markdown_table(rules, settings, cells, first: str) -> list[str]:
    lines = [f"| {first} | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    for rule in rules:
        lines.append(f"| {rule} | " + " | ".join(_cell(cells.get((rule, s))) for s in settings) + " |")
    return lines


def _final_table(runs: list[Run], metric: str) -> list[str]:
    """The final ``metric`` of the runs that score by it (classification: accuracy, regression: rmse)."""
    mine = [r for r in runs if r.manifest and r.metric == metric]
    better = " (higher is better)" if metric == "accuracy" else " (lower is better)"
    return [f"## Final test {metric}{better}", "", *_markdown_table(*table(mine, Run.final), "rule"), ""]


def _other_metrics(runs: list[Run], mains: list[str]) -> list[str]:
    """A table for every other final metric the runs report as a number (loss, NLL, CRPS, coverage, ...);
    a metric given as a list (Flower's MetricRecord allows one: per-class accuracies) has no mean over
    seeds to show, and is named beneath the tables instead of failing the report."""
    finished = [r for r in runs if r.status == "finished"]
    keys = list(dict.fromkeys(k for r in finished for k in r.final_metrics() if k not in mains))
    lines, lists = [], []
    for key in keys:

        def number(r: Run, key: str = key) -> float | None:
            value = r.final_metrics().get(key)
            return value if is_number(value) else None

        if not any(number(r) is not None for r in finished):
            lists.append(key)
            continue
        lines += [f"### Final test {key}", "", *_markdown_table(*table(runs, number), "rule"), ""]
    if lists:
        lines += [f"Metrics reported as lists, not tabulated: {', '.join(lists)}.", ""]
    return lines


def _numeric_sweeps(runs: list[Run]) -> list[str]:
    """Swept paths (other than the seed and the rule's name) whose values are numbers taking several
    values; a rule option (``rule.lam``) counts."""
    keys: dict[str, set] = {}
    for r in runs:
        for path, value in r.manifest.get("swept", {}).items():
            keys.setdefault(path, set()).add(value if is_number(value) else None)
    return [
        k
        for k, values in keys.items()
        if not is_replicate(k) and k != "rule.name" and None not in values and len(values) > 1
    ]


def _unconverged(runs: list[Run]) -> list[str]:
    """A section listing, per rule and setting and then per run, the rounds whose fit stopped at max_iter
    without converging; nothing when there are none."""
    counted = [(r, *r.unconverged()) for r in runs if r.status in ("finished", "failed")]
    if not any(k for _, k, _ in counted):
        return []
    lines = [
        "## Rounds that stopped at max_iter without converging",
        "",
        "In these rounds the rule's iterative fit (an IVAR/ICOV estimator, the geometric median's Weiszfeld "
        "steps) used its whole iteration budget: the aggregate and the trust may still have been moving. "
        "Each such round says so in its `info` in the run's rounds.jsonl (`converged: false`; for IVAR/ICOV "
        "`warning`: how far the weights still moved). Raise the rule's max_iter or loosen its tol (for "
        "fedag, in its base_options).",
        "",
    ]
    cells: dict[tuple[str, str], list] = {}
    for r, k, of in counted:
        cells.setdefault((r.rule, r.setting), []).append((r, k, of))
    for (rule, setting), mine in cells.items():
        k, of = sum(m[1] for m in mine), sum(m[2] for m in mine)
        if k:
            where = (
                f"see {mine[0][0].directory.name}/rounds.jsonl"
                if len(mine) == 1
                else "runs " + ", ".join(f"{r.directory.name}: {n} of {m}" for r, n, m in mine if n)
            )
            lines.append(f"- {rule}, {setting}: {k} of {of} rounds stopped at max_iter ({where})")
    return lines + [""]


#: A run that left out more clients than this is summed up in one line instead of one line per client.
LISTED_CLIENTS = 8


def _spans(rounds: list[int]) -> str:
    """Round numbers as runs of consecutive ones: ``3-7, 9``."""
    spans: list[list[int]] = []
    for t in sorted(set(rounds)):
        if spans and t == spans[-1][1] + 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _left_out(runs: list[Run]) -> list[str]:
    """A section listing, per run, the clients its rounds left out (quarantined by the rule, or dropped
    by a Flower strategy before it) with the rounds and the reasons; nothing when no round left one out."""
    lines = []
    for r in runs:
        left = r.left_out()
        if not left:
            continue
        name = f"{r.directory.name} ({len(r.rounds)} rounds)"
        if len(left) > LISTED_CLIENTS:
            for action in ("quarantined", "dropped"):
                mine = {client: v for (client, what), v in left.items() if what == action}
                if mine:
                    rounds = [t for ts, _ in mine.values() for t in ts]
                    lines.append(
                        f"- {name}: {len(mine)} clients {action} in {len(rounds)} client-rounds (rounds "
                        f"{_spans(rounds)}); the first reason: {next(iter(mine.values()))[1][0]}"
                    )
            continue
        lines.append(f"- {name}:")
        for (client, action), (rounds, reasons) in left.items():
            more = f" (and {len(reasons) - 1} other reasons)" if len(reasons) > 1 else ""
            plural = "s" * (len(rounds) > 1)
            lines.append(f"  - {client}: {action} in round{plural} {_spans(rounds)}: {reasons[0]}{more}")
    if not lines:
        return []
    head = [
        "## Clients left out of rounds",
        "",
        "A round aggregates without a client whose update is malformed (the rule quarantines it: "
        "`quarantined` in the run's rounds.jsonl, with the reason) and, on a Flower federation, without a "
        "reply the strategy cannot read (`dropped`). Their weight is 0 in that round.",
        "",
    ]
    return head + lines + [""]


def _shared_votes(runs: list[Run]) -> list[str]:
    """A section listing the runs in which groups of copies (identical, near-identical or correlated
    updates) shared one vote, or rounds were degenerate (with the first reason); nothing when there are
    none."""
    lines = []
    for r in runs:
        rounds, largest = r.shared_votes()
        reasons = r.degenerate()
        if rounds:
            lines.append(
                f"- {r.directory.name}: in {rounds} of {len(r.rounds)} rounds copies shared one vote "
                f"(largest group: {largest} clients)"
            )
        if reasons:
            lines.append(f"- {r.directory.name}: {len(reasons)} degenerate rounds; the first: {reasons[0]}")
    if not lines:
        return []
    head = [
        "## Copies and degenerate rounds",
        "",
        "Clients whose updates are copies (identical, near-identical, or deviating from the round's robust "
        f"centre in correlation above {CORRELATION:g}: sybils, colluders, clients that share one data "
        "distribution) share one vote in the rules that read agreement as reliability; each round lists its "
        "groups and why in `info.groups` in the run's rounds.jsonl, and a degenerate round its reason in "
        "`info.degenerate`.",
        "",
    ]
    return head + lines + [""]


def write_report(directory: str | Path, out: str | Path | None = None, runs: list[Run] | None = None) -> Path:
    """Write ``report.md`` and its PNGs for every run under ``directory`` (into ``out``, default the same
    folder); ``runs``: those runs when the caller has already loaded them. Returns the markdown path."""
    directory = Path(directory)
    runs = load_runs(directory) if runs is None else runs
    if not runs:
        raise FileNotFoundError(f"no runs (manifest.json) under {directory}")
    out = Path(out) if out else directory
    out.mkdir(parents=True, exist_ok=True)
    done = [r for r in runs if r.status == "finished"]
    # runs on data of different kinds (accuracy, RMSE) get a table and figures of their own
    metrics = list(dict.fromkeys(r.metric for r in runs if r.manifest)) or ["accuracy"]
    lines = [*_tables(directory.name, runs, metrics), *provenance(runs), *_problems(runs, done)]
    for metric in metrics:
        mine = [r for r in done if r.metric == metric]
        lines += _figures(mine, metric, out, suffix="" if len(metrics) == 1 else f"_{metric}")
    lines += _trust(done, out)
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def other_code(runs: list[Run]) -> int:
    """How many of the runs other code computed (another fedtrust source, torch or numpy:
    :func:`~fedtrust.sim.store.computed_by`), or record none."""
    here = this_code()
    return sum(r.code != here for r in runs if r.manifest)


def provenance(runs: list[Run]) -> list[str]:
    """What computed the runs: their fedtrust versions, source hashes (``fedtrust_source``, of every
    source file), torch and numpy versions, against this checkout's, so a table read from old runs says
    it is old."""
    made = Counter(
        ((r.manifest.get("versions") or {}).get("fedtrust", "?"), r.code) for r in runs if r.manifest
    )
    parts = [f"fedtrust {version}, {describe(code)}: {count} run{'s' * (count != 1)}"
             for (version, code), count in sorted(made.items(), key=lambda kv: -kv[1])]  # fmt: skip
    other = other_code(runs)
    verdict = (
        "every run by this code"
        if not other
        else f"{other} run{'s' * (other != 1)} by other code (or code not recorded): their numbers are "
        "that code's, not necessarily this one's"
    )
    mixed = (
        ' A cell whose seeds were computed by different code says so ("2 codes"): its mean mixes them.'
        if len({code for _, code in made}) > 1
        else ""
    )
    return [
        "## Provenance",
        "",
        f"{'; '.join(parts)}. This checkout: {describe(this_code())}; {verdict}.{mixed}",
        "",
    ]


def _tables(name: str, runs: list[Run], metrics: list[str]) -> list[str]:
    """The report's heading and its tables: the final metric, the other metrics, detection AUROC, the
    weight on corrupted clients, the rounds that did not converge, the votes sybils shared."""
    seeds = sorted({r.seed for r in runs if r.manifest})
    counts = Counter(r.status for r in runs)
    statuses = [
        f"{counts[k]} {k}" for k in ("finished", "failed", "running", "unreadable", "copy") if counts[k]
    ]
    unconverged = _unconverged(runs)
    return [
        f"# Report: {name}",
        "",
        f"{len(runs)} runs ({', '.join(statuses)}); "
        f"seeds {seeds}. Cells: mean ± sd over the seeds of finished runs; failed runs are counted, not "
        "averaged in, and never plotted."
        + (" Some rounds stopped at max_iter without converging (listed below)." if unconverged else ""),
        "",
        *(line for metric in metrics for line in _final_table(runs, metric)),
        *_other_metrics(runs, metrics),
        "## Detection: AUROC of trust against the hidden corrupted flags",
        "",
        "Per run, the mean over rounds of the probability that a corrupted client got less weight than an "
        "honest one (0.5 = no better than chance; '-' = no round had both kinds of client).",
        "",
        *_markdown_table(*table(runs, Run.mean_auroc), "rule"),
        "",
        "## Weight on corrupted clients",
        "",
        "Mean over rounds of the total weight the rule gave corrupted clients (their share of the clients "
        "is what a rule that cannot tell them apart would give).",
        "",
        *_markdown_table(*table(runs, Run.corrupted_weight), "rule"),
        "",
        *unconverged,
        *_shared_votes(runs),
        *_left_out(runs),
    ]


def _problems(runs: list[Run], done: list[Run]) -> list[str]:
    """The runs left out of the tables (failed, unfinished, unreadable), each with why, and the finished
    runs with rounds skipped because the rule raised."""
    lines = []
    absent = missing(runs)
    if absent:
        lines += ["## Runs missing from their sweep", ""]
        lines += [
            f"- {name}: {have} of the {planned} runs its sweep planned are on disk; the other "
            f"{planned - have} never started or were removed (`fedtrust run` computes them), and the "
            "cells average what is here"
            for name, (have, planned) in absent.items()
        ]
        lines.append("")
    for status, title in (
        ("failed", "Failed runs"),
        ("running", "Unfinished runs (interrupted or still running; left out)"),
        ("unreadable", "Unreadable runs (left out)"),
        ("copy", "Copies of other runs (the same config and seed; left out, so that no run counts twice)"),
    ):
        listed = [r for r in runs if r.status == status]
        if listed:
            lines += [f"## {title}", "", *(f"- {r.directory.name}: {r.reason}" for r in listed), ""]
    skipped = [(r, r.errors()) for r in done if r.errors()]
    if skipped:
        lines += ["## Rounds not aggregated (the global model stayed; finished runs)", ""]
        for r, n in skipped:
            first = next(x["error"] for x in r.rounds if x.get("error"))
            lines.append(f"- {r.directory.name}: {n} of {len(r.rounds)} rounds; the first: {first}")
        lines.append("")
    return lines


def _figures(done: list[Run], metric: str, out: Path, suffix: str = "") -> list[str]:
    """Draw the figures of the runs scored by ``metric`` into ``out`` (the final metric against each
    numeric sweep key, calibration, the metric over rounds; ``suffix`` on the file names) and return their
    sections."""
    lines = []
    for key in _numeric_sweeps(done):
        png = sweep_curves(done, key, out / f"sweep_{slug(key)}{suffix}.png")
        lines += [f"## Final test {metric} against {key}", "", f"![{key}]({png.name})", ""]
    predictive = [r for r in done if r.predictions() is not None]
    if predictive:
        png = calibration(predictive, out / f"calibration{suffix}.png")
        lines += [
            "## Calibration of the final predictive distributions",
            "",
            f"![calibration]({png.name})",
            "",
        ]
    if not done:
        return lines
    return lines + [
        f"## Test {metric} over rounds",
        "",
        f"![{metric}]({metric_curves(done, out / f'curves{suffix}.png').name})",
        "",
    ]


def _trust(done: list[Run], out: Path) -> list[str]:
    """Trust heatmaps, one per setting."""
    if not done:
        return []
    lines = ["## Trust over rounds", ""]
    for setting in dict.fromkeys(r.setting for r in done):
        runs = [r for r in done if r.setting == setting]
        if not any(rec["clients"] for r in runs for rec in r.rounds):  # an evaluation-only Flower run
            lines += [f"### {setting}", "", "No round trained a client: there is no trust to show.", ""]
            continue
        png = trust_heatmaps(runs, out / f"trust_{slug(setting)}.png", setting)
        lines += [f"### {setting}", "", f"![trust]({png.name})", ""]
    return lines
