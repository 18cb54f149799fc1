"""The ``fedtrust`` command line."""

from __future__ import annotations

import inspect
from pathlib import Path

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Federated learning from untrusted sources.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
#: fedtrust infer's iteration budget for IVAR (10,000 steps of a 200 x 50 table take ~0.1 s here).
IVAR_BUDGET = 10_000
#: Listings fit a terminal this wide at most (and the terminal, when narrower).
LISTING_WIDTH = 100


def _version(value: bool) -> None:
    if value:
        from fedtrust import __version__

        typer.echo(f"fedtrust {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print fedtrust's version and exit."
    ),
) -> None:
    """Federated learning from untrusted sources."""


@app.command()
def demo(
    out: Path = typer.Option(Path("results"), help="Where the demo's runs and report go (results/demo)."),
    rounds: int = typer.Option(30, min=1, help="Training rounds."),
    seeds: int = typer.Option(3, min=1, help="Seeds per rule."),
    device: str = typer.Option("auto", help="Where the runs compute: auto, cpu, cuda, cuda:<i>, xpu."),
    jobs: int = typer.Option(1, min=1, help="Runs at once, each in a process of its own."),
) -> None:
    """The main job: every rule on digits where 30% of 20 clients flip their labels."""
    from pydantic import ValidationError

    from fedtrust import demo as demo_module
    from fedtrust.sim.settings import TrainSettings, resolve_device
    from fedtrust.sim.store import RunLocked
    from fedtrust.sweeps.config import validator_reason

    try:
        resolve_device(TrainSettings(device=device).device)
    except ValidationError as exc:
        raise _fail(f"--device: {validator_reason(exc.errors()[0])}, got {device!r}") from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    _need_folder("--out", out, "the demo's runs")
    try:
        demo_module.main(out=out, rounds=rounds, seeds=seeds, device=device, jobs=jobs)
    except RunLocked as exc:  # another demo is writing this --out
        raise _fail(str(exc), code=1) from None
    except OSError as exc:  # an --out that cannot be written
        raise _fail(str(exc)) from None


def _fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr; raise the returned Exit to stop with ``code``."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _need_folder(option: str, path: Path | None, what: str) -> None:
    """Stop, naming ``option``, when ``path`` (a folder to write ``what`` into; None: not given) is a file."""
    if path is not None and path.exists() and not path.is_dir():
        raise _fail(f"{option} {path} is a file; give a folder for {what}")


def _summary(outcomes, folder: Path) -> None:
    """One line per run: status, final metric, time (the run's own, over its resumptions)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(outcomes)} runs in {folder}", title_justify="left")
    for col in ("run", "status", "final", "time"):
        table.add_column(col, justify="right" if col == "time" else "left", overflow="fold")
    for o in outcomes:
        final = o.final or {}
        metric = next((k for k in ("accuracy", "rmse") if k in final), None)
        shown = f"{metric} {final[metric]:.4g} (round {final.get('round')})" if metric else "-"
        status = {"failed": "[red]failed[/red]"}.get(o.status, o.status)
        if o.not_aggregated and o.status != "failed":
            status += f" [yellow]({o.not_aggregated} rounds not aggregated)[/yellow]"
        seconds = "-" if o.seconds is None else f"{o.seconds:.1f} s"
        error = o.error if o.error is None or len(o.error) <= 200 else o.error[:199] + "…"
        table.add_row(o.label, status, error if o.status == "failed" else shown, seconds)
    Console().print(table)


@app.command()
def run(
    config: Path = typer.Argument(..., help="Experiment YAML."),
    out: Path = typer.Option(Path("results"), help="Runs are written to OUT/<config name>/<run>."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    report: bool = typer.Option(
        False, "--report", help="Write the report (report.md + PNGs) into OUT/<name>."
    ),
    report_dir: Path = typer.Option(
        None, help="Write the report into REPORT_DIR/<name> instead (implies --report)."
    ),
    set_: list[str] = typer.Option([], "--set", help="Override a config value, e.g. --set data.name=digits."),
    force: bool = typer.Option(
        False, "--force", help="Start over the runs on disk that were computed from another config."
    ),
    device: str = typer.Option(
        None, help="Where runs compute: auto, cpu, cuda, cuda:<i>, xpu (sets train.device)."
    ),
    jobs: int = typer.Option(1, min=1, help="Runs at once, each in a process of its own."),
    ray: str = typer.Option(
        None, help="Run the runs as Ray tasks on the Ray cluster at this address ('auto': the local one)."
    ),
) -> None:
    """Run an experiment config (each run of its sweep). Finished runs of the same config are skipped,
    interrupted ones resume; runs on disk from another config are refused unless --force."""
    from fedtrust.sim.settings import resolve_device
    from fedtrust.sim.store import RunLocked
    from fedtrust.sweeps.config import ConfigError, load
    from fedtrust.sweeps.runner import ConfigChanged, run_experiment

    if config.is_dir():
        raise _fail(f"{config} is a folder; give an experiment YAML file (e.g. {config}/<name>.yaml)")
    _need_folder("--out", out, "the runs")
    _need_folder("--report-dir", report_dir, "the report")
    overrides = [*set_, *([f"train.device={device}"] if device is not None else [])]
    try:
        cfg = load(config, overrides)
        resolve_device(cfg.train.device)  # a device this machine lacks: refused before any run starts
    except (ConfigError, OSError, ValueError) as exc:  # ValueError: a device this machine lacks
        raise _fail(str(exc)) from None
    try:
        outcomes = run_experiment(cfg, out, progress=progress, force=force, jobs=jobs, ray=ray)
    except (ConfigError, ConfigChanged, OSError, ValueError) as exc:  # OSError: an --out not writable,
        raise _fail(str(exc)) from None  # ValueError: --ray without Ray, or no cluster at its address
    except RunLocked as exc:
        raise _fail(str(exc), code=1) from None
    _summary(outcomes, out / cfg.name)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("finished", "skipped", "failed")}
    typer.echo(", ".join(f"{v} {k}" for k, v in counts.items()))
    if report or report_dir is not None:
        from fedtrust.report import write_report

        target = None if report_dir is None else report_dir / cfg.name
        try:
            typer.echo(f"wrote {write_report(out / cfg.name, target)}")
        except OSError as exc:  # a report folder that cannot be written: the runs are kept
            raise _fail(
                f"the runs are in {out / cfg.name}, but the report could not be written: {exc}", 1
            ) from None
    if counts["failed"]:
        raise _fail(f"{counts['failed']} of {len(outcomes)} runs failed (see the table)", code=1)


@app.command()
def report(
    directory: Path = typer.Argument(..., help="A folder of runs (e.g. results/<experiment>)."),
    out: Path = typer.Option(None, help="Where report.md and the PNGs go (default: DIRECTORY)."),
) -> None:
    """Markdown tables (final metric, detection AUROC, weight on corrupted) and PNG plots of runs on disk.
    Failed, unfinished and unreadable runs are listed, never averaged in; unreadable ones (damaged files)
    make the exit status non-zero."""
    from fedtrust.report import load_runs, missing, other_code, write_report

    _need_folder("--out", out, "the report")
    try:
        runs = load_runs(directory)
        path = write_report(directory, out, runs)
    except FileNotFoundError as exc:  # no such folder, or no runs in it
        raise _fail(str(exc)) from None
    except OSError as exc:  # a report folder that cannot be written
        raise _fail(f"the report could not be written: {exc}", 1) from None
    typer.echo(f"wrote {path}")
    other = other_code(runs)
    if other:
        typer.echo(f"note: {other} of {len(runs)} runs were computed by other fedtrust code, or record none "
                   f"(the report's provenance section lists them)", err=True)  # fmt: skip
    for name, (have, planned) in missing(runs).items():
        typer.echo(f"note: {name}: {have} of the {planned} runs its sweep planned are on disk (the report "
                   "lists it); the others never started or were removed", err=True)  # fmt: skip
    left_out = [r for r in runs if r.status != "finished"]
    for r in left_out:
        typer.echo(f"{r.status}: {r.directory}: {r.reason}", err=True)
    unreadable = sum(r.status == "unreadable" for r in left_out)
    if unreadable:
        raise _fail(f"{unreadable} run(s) could not be read back (listed in {path}); rerun them", code=1)


@app.command()
def infer(
    estimates: Path = typer.Argument(..., help="CSV: rows = tasks, columns = sources, blank = missing."),
    method: str = typer.Option("ivar_vb", help="ivar_mle, ivar_vb, icov_mle or icov_vb."),
    out: Path = typer.Option(
        Path("consensus.csv"), help="Consensus per task; per-source results go beside it."
    ),
    latent_dim: int | None = typer.Option(None, min=1, help="Latent dimension D (ICOV only; default 2)."),
    max_iter: int | None = typer.Option(
        None,
        "--max-iter",
        min=1,
        help="Most iterations (default: 10000 for IVAR, whose steps are cheap and whose fixed point can "
        "take thousands of them near a boundary, e.g. truths with no spread; 100 for ICOV-MLE, 1000 for "
        "ICOV-VB).",
    ),
    tol: float | None = typer.Option(
        None,
        min=0.0,
        help="Stop when the weights are within this of their fixed point (default: 64 machine "
        "epsilons of the estimates' float64, 1.4e-14).",
    ),
) -> None:
    """Truth inference on a CSV of estimates: the consensus of each task and each source's reliability."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from fedtrust.inference import METHODS
    from fedtrust.inference.csvio import answered, read_estimates, results_paths, write_results
    from fedtrust.registry import UnknownNameError, lookup

    if out.is_dir():
        raise _fail(f"--out {out} is a folder; give the consensus CSV's file name (e.g. {out}/consensus.csv)")
    for path in results_paths(out):  # the consensus, and the per-source file beside it
        if path.exists() and estimates.exists() and path.resolve() == estimates.resolve():
            what = f"--out {out}" if path == out else f"--out {out} writes {path}, which"
            raise _fail(f"{what} is the estimates file itself; writing there would overwrite the input")
    try:
        fn = lookup("method", METHODS, method)
        if latent_dim is not None and not method.startswith("icov"):
            raise ValueError(f"--latent-dim {latent_dim} is ICOV's rank of shared errors; {method} has none")
        tasks, sources, x = read_estimates(estimates)
        if len(sources) < 2:
            named = f"one source ({sources[0]!r})" if sources else "no source columns"
            raise ValueError(
                f"{estimates}: {named}; truth inference needs two or more, since with one nothing tells "
                "its noise from the truths' own spread"
            )
        if len(tasks) < 2:
            raise ValueError(
                f"{estimates}: one task ({tasks[0]!r}); each source's noise would be read from its one "
                "estimate, which cannot tell it from chance; give two or more tasks"
            )
        options = {"source_keys": sources} if method.startswith("icov") else {}
        if latent_dim is not None:
            options["latent_dim"] = latent_dim
        if max_iter is not None or method.startswith("ivar"):
            options["max_iter"] = max_iter or IVAR_BUDGET
        result = fn(x, tol=tol, **options)
    except (UnknownNameError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except (torch.linalg.LinAlgError, ArithmeticError) as exc:  # degenerate estimates (e.g. too few tasks)
        shape = f"{len(tasks)} tasks, {len(sources)} sources"
        raise _fail(f"{method} broke down on {estimates} ({shape}): {exc}") from None
    try:
        consensus_path, sources_path = write_results(out, tasks, sources, result)
    except OSError as exc:
        raise _fail(f"--out {out}: the results could not be written ({exc})") from None
    table = Table(
        title=f"{method}: {len(tasks)} tasks, {len(sources)} sources, {result.iterations} iterations"
    )
    for col in ("source", "noise", "reliability", "mean weight"):
        table.add_column(col, justify="left" if col == "source" else "right")
    per_source = answered(result)
    for j, (source, (_, mean_weight)) in enumerate(zip(sources, per_source, strict=True)):
        table.add_row(
            source,
            f"{float(result.noise[j]):.4g}",
            f"{float(result.reliability[j]):.4g}",
            f"{mean_weight:.3f}",
        )
    Console(width=120).print(table)
    single = [s for s, (count, _) in zip(sources, per_source, strict=True) if count == 1]
    if single:
        named = ", ".join(map(repr, single[:5])) + (f" and {len(single) - 5} more" if len(single) > 5 else "")
        typer.echo(
            f"warning: source{'s' * (len(single) > 1)} {named} gave one estimate; a noise read from one "
            "estimate can be as small as its distance to the consensus, so that reliability says little",
            err=True,
        )
    if not result.converged:
        remedy = f"rerun with --max-iter {2 * result.iterations} or a looser --tol (e.g. 1e-10)"
        typer.echo(f"warning: {result.warning} ({remedy})", err=True)
    typer.echo(f"wrote {consensus_path} and {sources_path}")


def _listing(title: str, table_of) -> None:
    """One registry as a listing: each entry's name and options (with defaults), then what it is (its
    source or its docstring's first line), wrapped to the terminal (at most LISTING_WIDTH columns)."""
    import shutil
    import textwrap

    from fedtrust.registry import options_of

    width = min(shutil.get_terminal_size((LISTING_WIDTH, 24)).columns, LISTING_WIDTH)
    typer.echo(title)
    for name, builder in table_of.items():
        opts = ", ".join(
            f"{k}" if v is inspect.Parameter.empty else f"{k}={v!r}" for k, v in options_of(builder).items()
        )
        about = getattr(builder, "paper", "") or (inspect.getdoc(builder) or "").split("\n\n")[0]
        typer.echo(textwrap.fill(f"{name}({opts})", width, initial_indent="  ", subsequent_indent="      "))
        if about:
            typer.echo(textwrap.fill(" ".join(about.split()), width, initial_indent="      ",
                                     subsequent_indent="      "))  # fmt: skip
    typer.echo("")


@app.command()
def rules() -> None:
    """Every registered rule and pre-aggregator, its options with defaults, and its source."""
    from fedtrust.rules import PRE_AGGREGATORS, RULES

    _listing("Rules (rule: in a config, TrustStrategy(rule=...)):", RULES)
    _listing("Pre-aggregators (before a rule: nnm+median, or the rule's option pre):", PRE_AGGREGATORS)


@app.command()
def attacks() -> None:
    """Every update attack and data corruption, its options with defaults, and what it does."""
    from fedtrust.attacks import ATTACKS
    from fedtrust.data.corruptions import DATA_CORRUPTIONS

    _listing("Update attacks (corruption.attack in a config):", ATTACKS)
    _listing("Data corruptions (corruption.name in a config):", DATA_CORRUPTIONS)


@app.command()
def partitioners() -> None:
    """Every way to split a data set among clients, its options with defaults, and what it does."""
    from fedtrust.data.partition import PARTITIONERS

    _listing("Partitioners (data.partition in a config):", PARTITIONERS)


@app.command("flower-credentials")
def flower_credentials(
    out: Path = typer.Option(Path("credentials"), help="Directory to write into."),
    host: list[str] = typer.Option(
        ["127.0.0.1", "localhost"], help="A name or IP address the SuperLink is reached at (repeat)."
    ),
    nodes: int = typer.Option(
        0, min=0, help="Also write this many SuperNode key pairs (node-1, node-1.pub, ...)."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace what the directory holds: a new CA, which every SuperNode must get."
    ),
) -> None:
    """TLS certificates for a SuperLink (own CA) and SuperNode keys for authentication (Flower).

    What the directory already holds is kept: run it again with more --nodes to add key pairs for new
    sites (the CA and the registered keys stay valid). --force replaces everything."""
    _need_folder("--out", out, "the credentials")
    try:
        _write_credentials(out, host, nodes, force)
    except OSError as exc:  # a folder that cannot be written
        raise _fail(str(exc)) from None
    except ValueError as exc:  # a --host no certificate can hold; a damaged server.pem to keep
        raise _fail(str(exc)) from None


def _write_credentials(out: Path, host: list[str], nodes: int, force: bool) -> None:
    """``flower-credentials``' work: the CA and certificate unless kept, then the SuperNode key pairs."""
    from fedtrust.flower.credentials import certificate_hosts, check_host, supernode_keys, tls_certificates

    for name in host:  # before anything is written
        check_host(name)
    pem = out / "server.pem"
    if pem.exists() and not force:
        try:
            had = certificate_hosts(pem)
        except ValueError as exc:
            raise ValueError(f"{exc}; --force makes a new CA and certificate (every SuperNode then needs the "
                             "new ca.crt)") from None  # fmt: skip
        if sorted(had) != sorted(host):
            raise _fail(f"{pem} is for hosts {', '.join(had)}, not {', '.join(host)}; --force makes a new "
                        "CA and certificate (every SuperNode then needs the new ca.crt)")  # fmt: skip
        typer.echo(f"kept        {out / 'ca.crt'} {pem} {out / 'server.key'}")
    else:
        for name, path in tls_certificates(out, host).items():
            typer.echo(f"{name:11s} {path}")
    for k in range(1, nodes + 1):
        if (out / f"node-{k}").exists() and not force:
            typer.echo(f"node-{k:<6d} kept")
            continue
        private, public = supernode_keys(out, f"node-{k}")
        typer.echo(f"node-{k:<6d} {private} {public}")


@app.command("flower-run")
def flower_run(
    app_dir: Path = typer.Argument(..., help="The Flower app's folder (with its pyproject.toml)."),
    nodes: int = typer.Option(5, min=1, help="SuperNodes in the simulation."),
    run_config: list[str] = typer.Option(
        None,
        help="Flower's --run-config, e.g. 'rule=\"arfl\" num-server-rounds=3'; may be given more than once "
        "(as for flwr run: later values override earlier ones).",
    ),
    logs: Path = typer.Option(None, help="Keep the SuperLink's log here (default: discarded)."),
) -> None:
    """flwr run APP in Flower's simulation engine, on a SuperLink that stops with the run (plain
    `flwr run` leaves its local SuperLink running): nothing it started is left behind."""
    from fedtrust.flower.local import simulate

    try:
        code = simulate(app_dir, nodes, run_config, logs)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
