"""A real Flower federation on loopback: a SuperLink and three SuperNodes as processes, the example app
submitted with ``flwr run``. One node trains on random labels; the trust rule must find it."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.usefixtures("alone_with_its_processes")

from fedtrust.flower.credentials import supernode_keys, tls_certificates  # noqa: E402
from fedtrust.flower.local import BIN, Processes, free_port  # noqa: E402
from fedtrust.report import Run, load_runs  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "examples" / "flower"
CORRUPTED = 2  # partition id of the node that trains on random labels


class Federation(Processes):
    """SuperLink + SuperNodes as process groups under ``root``; ``close`` stops every process they started."""

    def __init__(self, root: Path, nodes: int = 3, tls: bool = False, auth: bool = False):
        super().__init__(root / "flwr-home", root)
        self.root = root
        self.node_ids: dict[int, int] = {}
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        security = ["--insecure"]
        if tls:
            certs = tls_certificates(root / "certs")
            security = ["--ssl-ca-certfile", str(certs["ca.crt"]), "--ssl-certfile", str(certs["server.pem"]),
                        "--ssl-keyfile", str(certs["server.key"])]  # fmt: skip
        self.superlink = ["flower-superlink", *security, "--port", str(port),
                          "--disable-runtime-dependency-installation", "--database", str(root / "superlink.db"),
                          *(["--enable-supernode-auth"] if auth else [])]  # fmt: skip
        self.start("superlink", self.superlink)
        connection = f'address = "{self.address}"\n' + (
            f'root-certificates = "{certs["ca.crt"]}"\n' if tls else "insecure = true\n"
        )
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\n{connection}'
        )
        self.wait(
            lambda: self.flwr("supernode", "list", "test").returncode == 0, "the SuperLink's Control API"
        )
        client_security = ["--root-certificates", str(certs["ca.crt"])] if tls else ["--insecure"]
        for k in range(nodes):
            config = f"partition-id={k} num-partitions={nodes}" + (
                ' fedtrust-corruption="random_labels"' if k == CORRUPTED else ""
            )
            extra = []
            if auth:
                private, public = supernode_keys(root / "keys", f"node-{k}")
                done = self.flwr("supernode", "register", str(public), "test")
                assert done.returncode == 0, done.stdout + done.stderr
                extra = ["--auth-supernode-private-key", str(private)]
            log = self.start(f"supernode-{k}", [
                "flower-supernode", *client_security, *extra, "--superlink", self.address,
                "--port", str(free_port()), "--node-config", config])  # fmt: skip
            self.wait(lambda log=log: re.search(r"SuperNode ID: (\d+)", log.read_text()), f"SuperNode {k}")
            self.node_ids[k] = int(re.search(r"SuperNode ID: (\d+)", log.read_text()).group(1))

    def run(self, rule: str, rounds: int = 3) -> Run:
        out = self.root / "runs" / rule
        config = f'rule="{rule}" num-server-rounds={rounds} min-nodes={len(self.node_ids)} run-dir="{out}"'
        done = self.flwr("run", str(APP), "test", "--run-config", config, "--stream", timeout=600)
        self.last_output = done.stdout + done.stderr
        assert done.returncode == 0 and (out / "manifest.json").exists(), (
            f"flwr run failed:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
        )
        (run,) = load_runs(out)
        return run

    def restart_superlink(self) -> None:
        """Stop the SuperLink (SIGTERM, as a service manager does) and start it again on its database."""
        proc, _ = self.started.pop(0)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        self.start("superlink-restarted", self.superlink)
        self.wait(lambda: self.flwr("supernode", "list", "test").returncode == 0, "the restarted SuperLink")

    def close(self) -> None:
        assert not self.stop(), self.alive()


def learned(run: Run, rounds: int) -> None:
    """Every round ran and the model learned despite the bad node."""
    assert run.status == "finished" and [r["round"] for r in run.rounds] == list(range(1, rounds + 1))
    first, last = run.manifest["initial_metrics"]["accuracy"], run.final()
    assert last > first + 0.5 and last > 0.85, run.curve()


def least_trusted(run: Run, federation: Federation) -> None:
    """The bad node got the least trust in the last round, under its partition's name."""
    record = run.rounds[-1]
    trust = dict(zip(record["clients"], record["weights"], strict=True))
    assert sorted(record["node_ids"]) == sorted(federation.node_ids.values())
    bad = f"partition-{CORRUPTED}"
    assert set(trust) == {f"partition-{k}" for k in federation.node_ids}
    assert min(trust, key=trust.get) == bad, trust
    assert trust[bad] < 0.5 * min(w for node, w in trust.items() if node != bad), trust


def test_tls_supernode_authentication_and_a_superlink_restart(tmp_path):
    """The walkthrough of examples/flower/README.md: TLS, registered SuperNode keys (an unregistered
    SuperNode is refused), the SuperLink's state in a database. Two rounds of IVAR-VB (a rule with state:
    its window of past rounds), then the SuperLink is stopped and started again: the SuperNodes come back
    with their node ids, and the run goes on from the server's checkpoint to round 3 with every node's
    history, where the node training on random labels has the least trust. (The strategy is the same
    code whatever carries its messages: tests/test_flower.py runs ARFL and the other rules through it
    in process, ARFL's extra report of every node's loss included.)"""
    fed = Federation(tmp_path, tls=True, auth=True)
    try:
        log = fed.start("intruder", ["flower-supernode", "--root-certificates", str(tmp_path / "certs" / "ca.crt"),
                                     "--superlink", fed.address, "--port", str(free_port()), "--max-retries", "0",
                                     "--node-config", "partition-id=0 num-partitions=3"])  # fmt: skip
        intruder = fed.started.pop()[0]
        intruder.wait(timeout=60)
        assert "must be registered" in log.read_text()
        learned(fed.run("ivar_vb", rounds=2), rounds=2)
        fed.restart_superlink()
        run = fed.run("ivar_vb", rounds=3)
        assert "resuming after round 2" in fed.last_output
        learned(run, rounds=3)
        least_trusted(run, fed)
    finally:
        fed.close()


def test_flower_run_of_the_example_leaves_no_process_behind(tmp_path):
    """`fedtrust flower-run` (the README's simulation command): the example in Flower's simulation engine
    with a CNN with batch norm, and afterwards no Flower process it started is left."""
    before = flower_processes()
    out = tmp_path / "run"
    done = subprocess.run(
        [str(BIN / "fedtrust"), "flower-run", str(APP), "--nodes", "3", "--run-config",
         f'num-server-rounds=2 min-nodes=3 fedtrust-corrupted-partitions="1" run-dir="{out}"'],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run,) = load_runs(out)
    assert run.status == "finished" and run.final() > 0.8 and run.mean_auroc() == 1.0
    assert run.manifest["config"]["rule"]["name"] == "ivar_vb"
    assert flower_processes() <= before, flower_processes() - before


def test_flower_run_interrupted_mid_run_leaves_no_process_behind():
    """A `kill` (systemd, a CI timeout) in the middle of a run: everything the run started is stopped,
    Ray's agents of the simulation included (they run without FLWR_HOME, in process groups of their own;
    a SIGTERM used to end fedtrust before its clean-up). SIGTERM becomes the KeyboardInterrupt that
    Ctrl-C raises (the next test), so this is Ctrl-C's clean-up too."""
    before = flower_processes()
    proc = subprocess.Popen(
        [str(BIN / "fedtrust"), "flower-run", str(APP), "--nodes", "3", "--run-config",
         'num-server-rounds=500 model="softmax" rule="median"'],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "[ROUND 2/500]" in line:
                break
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30  # Ray's agents notice their raylet is gone within seconds
    while not flower_processes() <= before and time.monotonic() < deadline:
        time.sleep(1)
    assert flower_processes() <= before, flower_processes() - before


def test_a_sigterm_is_the_interrupt_ctrl_c_is_and_the_handler_before_comes_back():
    from fedtrust.flower.local import _terminated_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"), _terminated_as_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises at once
    assert signal.getsignal(signal.SIGTERM) is before


def test_flower_run_refuses_an_unknown_run_config_key_and_too_few_nodes_before_starting():
    from fedtrust.flower.local import checked_run_config

    with pytest.raises(ValueError, match="declares no key 'num-server-round'; its keys: num-server-rounds"):
        checked_run_config(APP, 3, "num-server-round=2")
    with pytest.raises(ValueError, match=r"--nodes 2 is below the app's min-nodes \(3\)"):
        checked_run_config(APP, 2, 'rule="median"')
    checked_run_config(APP, 2, "min-nodes=2")


def test_flower_run_reads_every_run_config_it_is_given():
    """`flwr run` takes --run-config more than once, merging them in order; `fedtrust flower-run` kept the
    last value only, so `--run-config 'rule="arfl"' --run-config 'num-server-rounds=3'` ran the default
    rule without a word. Every value now counts (refused here before any process starts)."""
    from typer.testing import CliRunner

    from fedtrust.cli import app
    from fedtrust.flower.local import checked_run_config

    with pytest.raises(ValueError, match="declares no key 'bogus'"):
        checked_run_config(APP, 3, ["bogus=1", "min-nodes=2"])
    with pytest.raises(ValueError, match=r"--nodes 3 is below the app's min-nodes \(99\)"):
        checked_run_config(APP, 3, ["min-nodes=2", "min-nodes=99"])  # the later value wins, as in Flower
    checked_run_config(APP, 3, ["min-nodes=99", "min-nodes=3"])
    # of the kind the app declares: min-nodes=3.0 passed and failed inside the ServerApp (flwr run exits 0)
    with pytest.raises(ValueError, match=r"min-nodes=3.0: .* declares min-nodes = 3; give a whole number"):
        checked_run_config(APP, 3, "min-nodes=3.0")
    with pytest.raises(ValueError, match=r"rule=3: .* declares rule = 'ivar_vb'; give a string, quoted"):
        checked_run_config(APP, 3, "rule=3")
    checked_run_config(APP, 3, "learning-rate=1 fraction-train=1")  # a whole number where a float is declared
    result = CliRunner().invoke(
        app,
        ["flower-run", str(APP), "--nodes", "3", "--run-config", "bogus=1", "--run-config", "min-nodes=2"],
    )
    assert result.exit_code != 0 and "declares no key 'bogus'" in result.output


def flower_processes() -> set[str]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(name in command for name in ("flower-superlink", "flower-superexec", "flwr-serverapp",
                                            "flwr-simulation", "flower-supernode", "ray::", "raylet",
                                            "gcs_server")):  # fmt: skip
            found.add(f"{pid}: {command[:100]}")
    return found
