"""The command line and the README's main job."""

import re

import numpy as np
import pytest
import runs
import torch
import yaml
from typer.testing import CliRunner

from fedtrust import available
from fedtrust.cli import app
from fedtrust.demo import main as demo_main
from fedtrust.report.results import Run, table

runner = CliRunner()


def test_rules_command_lists_every_rule_with_options_and_source():
    result = runner.invoke(app, ["rules"])
    assert result.exit_code == 0, result.output
    for name in available():
        assert name in result.output
    assert "Blanchard" in result.output and "max_iter=100" in result.output
    assert "Pre-aggregators" in result.output and "bucketing" in result.output and "s=2" in result.output


def test_demo_runs_every_rule_and_robust_rules_shut_out_label_flippers(tmp_path, capsys):
    runs = demo_main(out=tmp_path, rounds=12, seeds=1, progress=False)
    assert {r.rule.split("(")[0] for r in runs} == set(available())
    assert all(r.status == "finished" and len(r.rounds) == 12 for r in runs)
    rules, settings, weight = table(runs, Run.corrupted_weight)
    assert settings == ["corruption=none", "corruption=label_flip"]  # each rule clean and attacked
    by = {rule.split("(")[0]: weight[(rule, "corruption=label_flip")][0] for rule in rules}
    assert by["mean"] == pytest.approx(0.3)  # six of twenty clients, weighted like everyone else
    for name in ("multi_krum", "krum"):
        assert by[name] < 0.02, name
    assert by["bulyan"] < 0.05
    assert (tmp_path / "demo" / "report.md").exists() and (tmp_path / "demo" / "curves.png").exists()
    # the table puts each rule's clean accuracy beside its attacked one and what the flippers cost
    final = {(r.rule, r.setting): r.final() for r in runs}
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("│ mean "))
    clean, attacked = final[("mean", "corruption=none")], final[("mean", "corruption=label_flip")]
    assert [float(x) for x in re.findall(r"-?\d+\.\d+(?= ±)", row)[:3]] == pytest.approx(
        [clean, attacked, clean - attacked], abs=5e-4
    )


def digits_config(tmp_path, name: str, rounds: int, **rest):
    """A tiny six-client digits experiment config written to ``tmp_path / name.yaml``."""
    config = tmp_path / f"{name}.yaml"
    spec = {"name": name, "data": {"name": "digits", "clients": 6}, "train": {"rounds": rounds, "lr": 0.5}}
    config.write_text(yaml.safe_dump({**spec, **rest}))
    return config


@pytest.mark.parametrize(
    "command, says",
    [
        ("run", "Experiment YAML."),
        ("report", "A folder of runs (e.g. results/<experiment>)."),
        ("infer", "CSV: rows = tasks, columns = sources, blank = missing."),
        ("flower-run", "The Flower app's folder (with its pyproject.toml)."),
    ],
)
def test_every_commands_help_says_what_its_argument_is(command, says):
    """``--help`` shows each positional argument's help. Under typer 0.20 (flwr 1.41 holds typer below
    0.21) with click 8.5 it showed none: ``infer``'s said "estimates PATH [required]" and nothing of the
    CSV's layout (constraints.txt keeps click below 8.5)."""
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert says in result.output, result.output


def test_run_and_report_commands(tmp_path):
    config = digits_config(
        tmp_path,
        "tiny",
        3,
        corruption={"name": "crash", "fraction": 0.34},
        sweep={"rule.name": ["mean", "median"]},
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "2 runs" in result.output and "2 finished" in result.output
    again = runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--no-progress"])
    assert "2 skipped" in again.output
    report = runner.invoke(app, ["report", str(tmp_path / "tiny")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "tiny" / "report.md").read_text()
    assert "| mean |" in text and "| median |" in text and "curves.png" in text


def test_device_option_refuses_a_device_by_name_before_any_run(tmp_path):
    """--device on run and demo: an unknown name or a device this machine lacks stops with the reason,
    before a run starts; a run computed on one device is skipped when asked for on another."""
    config = digits_config(tmp_path, "tiny", 2)
    bad = runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--device", "gpu"])
    assert bad.exit_code == 2 and "train.device: must be auto, cpu, cuda" in bad.output
    demo = runner.invoke(app, ["demo", "--out", str(tmp_path), "--device", "gpu"])
    assert (
        demo.exit_code == 2
        and "--device: must be auto, cpu, cuda, cuda:<i> or xpu[:<i>], got 'gpu'" in demo.output
    )
    if not torch.cuda.is_available():
        missing = runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--device", "cuda:0"])
        assert missing.exit_code == 2 and "sees no CUDA device" in missing.output
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "demo").exists()
    first = runner.invoke(
        app, ["run", str(config), "--out", str(tmp_path), "--device", "cpu", "--no-progress"]
    )
    assert first.exit_code == 0 and "1 finished" in first.output
    again = runner.invoke(
        app, ["run", str(config), "--out", str(tmp_path), "--device", "auto", "--no-progress"]
    )
    assert again.exit_code == 0 and "1 skipped" in again.output


def test_run_command_reports_a_bad_config_with_its_path(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("name: bad\ntrain: {rounds: 0}\n")
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "bad.yaml: train.rounds: Input should be greater than or equal to 1 (got 0)" in result.output


def test_report_command_on_an_empty_folder(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "no runs" in result.output


def test_a_swept_rule_option_is_plotted_against_its_values(tmp_path):
    # ARFL's Fig. 5: accuracy and weights against lambda, one line for the rule across its lambdas
    config = digits_config(
        tmp_path,
        "lam",
        2,
        corruption={"name": "label_shuffle", "fraction": 0.34},
        rule={"name": "arfl"},
        sweep={"rule.lam": [0.5, 5.0, 50.0]},
    )
    assert runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--no-progress"]).exit_code == 0
    assert runner.invoke(app, ["report", str(tmp_path / "lam")]).exit_code == 0
    text = (tmp_path / "lam" / "report.md").read_text()
    assert "against rule.lam" in text and (tmp_path / "lam" / "sweep_rule_lam.png").stat().st_size > 0


def test_run_prints_a_summary_table_and_a_failed_run_exits_non_zero(tmp_path):
    # every client crashing (NaN updates, all quarantined) fails every round of that run, at run time
    config = digits_config(
        tmp_path, "mixed", 2, corruption={"name": "crash"}, sweep={"corruption.fraction": [0.0, 1.0]}
    )
    result = runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--no-progress"])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    clean = next(line for line in lines if "fraction=0.0" in line)
    assert "finished" in clean and "accuracy 0." in clean and " s " in clean + " "
    assert any("fraction=1.0" in line and "failed" in line for line in lines)
    assert "no round could be" in result.output and "1 finished, 0 skipped, 1 failed" in result.output
    assert "error: 1 of 2 runs failed" in result.output


def test_rerunning_a_name_with_another_config_is_refused_with_the_keys_and_the_remedy(tmp_path):
    config = digits_config(tmp_path, "same", 2)
    assert runner.invoke(app, ["run", str(config), "--out", str(tmp_path), "--no-progress"]).exit_code == 0
    changed = ["run", str(config), "--out", str(tmp_path), "--no-progress", "--set", "train.rounds=3"]
    result = runner.invoke(app, changed)
    assert result.exit_code == 2 and "1 skipped" not in result.output and "nothing was run" in result.output
    assert "run: train.rounds: 2 -> 3" in result.output and "--force" in result.output
    result = runner.invoke(app, [*changed, "--force"])
    assert result.exit_code == 0 and "1 finished" in result.output


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def broken_manifest(tmp_path):
    """A folder of runs, one of whose manifest.json is empty."""
    (tmp_path / "runs" / "m").mkdir(parents=True)
    (tmp_path / "runs" / "m" / "manifest.json").write_text("")
    return tmp_path / "runs"


@pytest.mark.parametrize(
    "args, message",
    [
        (lambda t: ["run", str(t)], "is a folder; give an experiment YAML file"),
        (
            lambda t: ["run", str(digits_config(t, "x", 1)), "--out", str(_write(t / "f", ""))],
            "--out .*/f is a file",
        ),
        (
            lambda t: ["run", str(digits_config(t, "x", 1)), "--set", "seed=1180591620717411303424"],
            r"x.yaml: seed: Input should be less than 4294967296 \(got 1180591620717411303424\)",
        ),
        (
            lambda t: ["run", str(digits_config(t, "x", 1)), "--set", "data.seed=-1"],
            r"x.yaml: data: dataset 'digits': seed must be >= 0, got -1",
        ),
        (
            lambda t: ["run", str(digits_config(t, "x", 1)), "--set", "train.lr=.inf"],
            r"x.yaml: train.lr: Input should be a finite number \(got inf\)",
        ),
        (  # (a 675-line traceback from torch's allocator)
            lambda t: [
                "run",
                str(digits_config(t, "x", 1)),
                "--set",
                "model={name: mlp, hidden: 1000000000000}",
            ],
            r"error: run: model: .*can't allocate memory.* \(nothing was run\)",
        ),
        (
            lambda t: ["run", str(digits_config(t, "x", 1)), "--device", "cuda:99999999999999999999"],
            r"train.device: 'cuda:99999999999999999999' is not a device torch can name",
        ),
        (
            lambda t: [
                "run",
                str(digits_config(t, "x", 1)),
                "--set",
                "rule={name: icov_vb, latent_dim: 1000000000000}",
            ],
            r"rule: icov_vb: latent_dim must be <= 4096, got 1000000000000",  # (integer multiplication overflow)
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,b\n1,2\n")), "--out", str(t)],
            "--out .* is a folder",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b\nt0,1,inf\n"))],
            r"e.csv, line 2, source 'b': 'inf' is not finite; leave the cell blank",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "1,2\n3,4\n"))],
            r"e.csv, line 1: the first row holds numbers",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,b\n1,x\n"))],
            r"line 2, source 'b': 'x' is not a number",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b,a\nt0,1,2,3\n"))],
            r"e.csv, line 1: source 'a' names columns 2 and 4; each source needs its own name",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a\nt0,1\nt1,2\n"))],
            r"e.csv: one source \('a'\); truth inference needs two or more",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b,c\nt0,1,2,3\n"))],
            r"e.csv: one task \('t0'\); each source's noise would be read from its one estimate",  # (8.6e7)
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,b\n1_000,2\n"))],
            r"line 2, source 'a': '1_000' is not a number",  # (Python's float read it as 1000)
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task\nt0\nt1\n"))],
            r"e.csv: no source columns; truth inference needs two or more",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,,b\n1,2,3\n"))],
            r"e.csv, line 1: column 2 has no source name; name every source",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,b\n1,2\n")), "--latent-dim", "3"],
            r"--latent-dim 3 is ICOV's rank of shared errors; ivar_vb has none",  # (it was ignored)
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b,c\nt0,1,2,\nt1,2,3,\n"))],
            r"e.csv: source 'c' has no estimate \(every cell of its column is blank\); drop its column",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b\nt0,1,2\nt0,2,3\n"))],
            r"e.csv, line 3: task 't0' is also on line 2; each task needs its own id",
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "task,a,b\nt1,1,2\nt2,,\nt3,2,3\n"))],
            r"e.csv, line 3: task 't2' has no estimate \(every cell of its row is blank\)",  # ("task 1 has no")
        ),
        (
            lambda t: ["infer", str(_write(t / "e.csv", "a,b\n1,2\n")), "--out", str(t / "e.csv")],
            r"--out .*e.csv is the estimates file itself",
        ),
        (
            lambda t: [
                "infer",
                str(_write(t / "e.csv", "a,b\n1,2\n2,2\n")),
                "--out",
                str(t / "e.csv" / "c.csv"),
            ],
            r"--out .*c.csv: the results could not be written",  # (a FileExistsError traceback)
        ),
        (
            lambda t: [
                "infer",
                str(_write(t / "r_sources.csv", "a,b\n1,2\n2,2\n")),
                "--out",
                str(t / "r.csv"),
            ],
            r"--out .*r.csv writes .*r_sources.csv, which is the estimates file itself",  # (it overwrote it)
        ),
        (lambda t: ["report", str(broken_manifest(t))], r"unreadable: .*m/manifest.json is empty"),
        (
            lambda t: ["demo", "--out", str(_write(t / "f", "")), "--rounds", "1", "--seeds", "1"],
            "--out .*/f is a file",  # (a NotADirectoryError traceback from inside the runner)
        ),
        (
            lambda t: ["flower-credentials", "--out", str(_write(t / "f", ""))],
            "--out .*/f is a file",  # (a FileExistsError traceback)
        ),
        (  # (cryptography's "Attribute's length must be >= 1 and <= 64" traceback)
            lambda t: ["flower-credentials", "--out", str(t / "c"), "--host", ""],
            "host '' is neither an IP address nor a DNS name",
        ),
        (
            lambda t: ["flower-credentials", "--out", str(t / "c"), "--host", "999.1.1.1"],
            "host '999.1.1.1' reads as an IP address but is not one",  # (it was taken as a DNS name)
        ),
        (  # (a MalformedFraming traceback)
            lambda t: ["flower-credentials", "--out", str(_write(t / "c" / "server.pem", "junk").parent)],
            r"c/server.pem is not a readable server certificate .*--force makes a new CA",
        ),
    ],
)
def test_cli_errors_name_the_field_or_file_not_a_traceback(tmp_path, args, message):
    result = runner.invoke(app, args(tmp_path))
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit)  # not an uncaught error
    assert re.search(message, result.output), result.output


def test_infer_writes_both_results_or_neither(tmp_path):
    """The per-source file's place was a folder: the consensus CSV was written before the error, a result
    that looked complete. Now neither is written, and each is replaced whole when both can be."""
    estimates = _write(tmp_path / "e.csv", "task,a,b,c\nt1,1,1.1,0.9\nt2,2,2.2,1.8\nt3,3,3.1,2.7\n")
    (tmp_path / "c_sources.csv").mkdir()
    result = runner.invoke(app, ["infer", str(estimates), "--out", str(tmp_path / "c.csv")])
    assert result.exit_code == 2 and "c_sources.csv is a folder" in result.output
    assert not (tmp_path / "c.csv").exists()
    (tmp_path / "c_sources.csv").rmdir()
    assert runner.invoke(app, ["infer", str(estimates), "--out", str(tmp_path / "c.csv")]).exit_code == 0
    assert (tmp_path / "c.csv").read_text().startswith("task,consensus\nt1,")
    assert (
        (tmp_path / "c_sources.csv")
        .read_text()
        .startswith("source,tasks,noise,reliability,mean_weight\na,3,")
    )
    assert not list(tmp_path.glob(".*.tmp"))


def test_infer_that_stops_at_max_iter_warns_with_the_remedy_and_still_writes(tmp_path):
    """An estimator stopped by its iteration limit has not converged: ``infer`` says so on stderr, with
    the iterations, the last weight change against the tolerance and what to change; the results are
    written and the exit code stays 0. With room to converge it says nothing."""
    estimates = _write(tmp_path / "e.csv", "task,a,b,c\nt0,1.0,1.1,3\nt1,2.0,2.2,-1\nt2,0.5,0.4,2\n")
    out = tmp_path / "consensus.csv"
    result = runner.invoke(app, ["infer", str(estimates), "--method", "ivar_mle", "--max-iter", "2",
                                 "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0 and out.exists(), result.output
    assert re.search(
        r"warning: ivar_mle stopped at its iteration limit \(2 iterations\) without converging: the last "
        r"iteration moved a weight by [0-9.e-]+, above tol 1.42e-14\..*raise max_iter or loosen tol\. "
        r"\(rerun with --max-iter 4 or a looser --tol \(e.g. 1e-10\)\)",
        " ".join(result.stderr.split()),
    ), result.stderr
    assert "warning" not in result.stdout
    quiet = runner.invoke(app, ["infer", str(estimates), "--method", "ivar_mle", "--tol", "1e-6",
                                "--out", str(out)])  # fmt: skip
    assert quiet.exit_code == 0 and "warning" not in quiet.output, quiet.output
    # IVAR-VB on pure noise (truths with no spread: tau -> 0) needs 475 steps; the default budget has room
    noise = np.random.default_rng(0).normal(size=(5, 5))  # 475 steps to converge (> 200, the old budget)
    rows = "\n".join(f"t{i}," + ",".join(f"{v:.17g}" for v in row) for i, row in enumerate(noise.tolist()))
    estimates = _write(tmp_path / "noise.csv", "task,s0,s1,s2,s3,s4\n" + rows + "\n")
    done = runner.invoke(app, ["infer", str(estimates), "--method", "ivar_vb", "--out", str(out)])
    assert done.exit_code == 0 and "warning" not in done.output, done.output
    assert int(re.search(r"5 sources, (\d+) iterations", done.output).group(1)) > 200, done.output


def test_infer_warns_of_a_source_with_one_estimate(tmp_path):
    """A source that answered one task has its noise read from that one estimate: b below lies where the
    consensus lands (noise 4e-8, reliability 2.5e7), so ``infer`` names it; a source with two says nothing."""
    estimates = _write(tmp_path / "e.csv", "task,a,b,c\nt0,1,2,3\nt1,1.1,,2.0\nt2,0.9,,2.4\n")
    done = runner.invoke(app, ["infer", str(estimates), "--out", str(tmp_path / "c.csv")])
    assert done.exit_code == 0, done.output
    assert re.search(r"warning: source 'b' gave one estimate; a noise read from one", done.stderr), (
        done.stderr
    )
    assert "'a'" not in done.stderr and "'c'" not in done.stderr


def test_infer_reads_a_header_of_dates_as_source_names(tmp_path):
    """Python's float reads '2024_01' as 202401: the header was refused as a row of numbers."""
    estimates = _write(tmp_path / "e.csv", "task,2024_01,2024_02\nt0,1,2\nt1,2,2\n")
    done = runner.invoke(app, ["infer", str(estimates), "--out", str(tmp_path / "c.csv")])
    assert done.exit_code == 0 and "2024_02" in done.stdout, done.output


def test_a_second_demo_on_one_out_is_refused_and_leaves_the_first_ones_runs(tmp_path):
    """The demo starts afresh by deleting its folder: a second demo started while one ran deleted the
    first one's runs, and their locks, while they were being written (and printed a traceback when it met
    one of them locked). Now one demo at a time holds the --out; another is refused naming it."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "theirs").write_text("a run being written")
    with runs.lock_held_elsewhere(tmp_path / "demo.lock") as holder:
        result = runner.invoke(app, ["demo", "--out", str(tmp_path), "--rounds", "1", "--seeds", "1"])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert f"is being written by another fedtrust process (pid {holder.pid}" in result.output
        assert (tmp_path / "demo" / "theirs").exists()
