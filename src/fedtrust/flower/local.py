"""Flower processes that end with the run that started them.

``flwr run`` on the default local connection starts a SuperLink that it leaves running after the run (by
design: the next ``flwr run`` reuses it). :func:`simulate` (``fedtrust flower-run``) runs an app in
Flower's simulation engine on a SuperLink of its own instead: on free loopback ports, under a private
``FLWR_HOME``, stopped with everything it started (the SuperExec, the simulation, the ServerApp) when the
run ends, fails or is interrupted. :class:`Processes` is the bookkeeping, also used by the loopback
integration test for a SuperLink and SuperNodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
NUL = b"\0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Process groups started with ``FLWR_HOME=home`` (and this interpreter's scripts first on PATH);
    :meth:`stop` ends them and every process that carries that ``FLWR_HOME``."""

    def __init__(self, home: Path, logs: Path):
        self.home, self.logs = Path(home), Path(logs)
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip
        self.started: list[tuple[subprocess.Popen, Path]] = []
        self.tree: set[str] = set()  # every descendant of the started processes, taken when they stop

    def start(self, name: str, command: Sequence[str]) -> Path:
        """Start ``command`` in a session of its own, its output to ``<logs>/<name>.log``; the log's path."""
        log = self.logs / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as fh:
            proc = subprocess.Popen(list(command), stdout=fh, stderr=subprocess.STDOUT, env=self.env,
                                    cwd=self.logs, start_new_session=True)  # fmt: skip
        self.started.append((proc, log))
        return log

    def flwr(
        self, *args: str, timeout: float | None = 60, capture: bool = True
    ) -> subprocess.CompletedProcess:
        """The ``flwr`` CLI with this ``FLWR_HOME`` (its connections are in ``<home>/config.toml``)."""
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, cwd=self.logs, text=True,
                              capture_output=capture, timeout=timeout)  # fmt: skip

    def wait(self, ready: Callable[[], object], what: str, timeout: float = 90) -> None:
        """Until ``ready()`` is true; raises naming the process that exited first (with its log's end)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc, log in self.started:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{log.stem} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                    )
            if ready():
                return
            time.sleep(0.3)
        raise TimeoutError(f"{what} did not come up in {timeout} s")

    def alive(self) -> list[str]:
        """Processes still running with this ``FLWR_HOME`` (SuperExecs and app processes the started ones
        spawned included) or in the tree :meth:`stop` took (Ray's agents, which the simulation starts
        without that environment, in sessions of their own), as ``pid: command``."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                status = Path(f"/proc/{pid}/status").read_text()
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            ours = f"FLWR_HOME={self.home}".encode() in environ.split(b"\0") or pid in self.tree
            if ours and "State:\tZ" not in status:
                found.append(f"{pid}: {command.replace(NUL, b' ').decode(errors='replace')[:120]}")
        return found

    def descendants(self) -> set[str]:
        """The pids of every process descended from the started ones, now (Ray's agents are re-parented
        to init once their raylet is gone, so the tree is taken before anything is stopped)."""
        children: dict[str, list[str]] = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:  # after "pid (comm)": state ppid ...
                ppid = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]
            except OSError:
                continue
            children.setdefault(ppid, []).append(pid)
        found, todo = set(), [str(proc.pid) for proc, _ in self.started]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    def stop(self, grace: float = 10.0) -> list[str]:
        """SIGTERM to every started process group, SIGKILL after ``grace`` seconds to what remains (and to
        any other process with this ``FLWR_HOME`` or descended from a started one when the stop began);
        returns what is still alive after that (nothing, normally)."""
        self.tree |= self.descendants()
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for proc, _ in self.started:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGKILL:
                for line in self.alive():
                    try:
                        os.kill(int(line.split(":")[0]), sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and (
                any(p.poll() is None for p, _ in self.started) or self.alive()
            ):
                time.sleep(0.2)
            if not self.alive():
                break
        return self.alive()


@contextlib.contextmanager
def _terminated_as_interrupt():
    """SIGTERM (``kill``, systemd, a CI timeout) raises KeyboardInterrupt here, as Ctrl-C does, so the
    clean-up below runs instead of leaving the SuperLink and the simulation behind (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def unfinished_runs(procs: Processes) -> list[str]:
    """The runs on this SuperLink that did not finish as completed (``flwr run --stream`` exits 0 when
    the ServerApp raised), as ``run <id>: <status> (<details>)``; one line if the status cannot be read."""
    listed = procs.flwr("list", "local", "--format", "json")
    try:
        runs = json.loads(listed.stdout)["runs"]
    except (ValueError, KeyError, TypeError):
        return [f"cannot read the run's status (flwr list: {(listed.stdout + listed.stderr).strip()[-300:]})"]
    return [f"run {r.get('run-id')}: {r.get('status')} ({r.get('status-details')})" for r in runs
            if r.get("status") != "finished:completed"]  # fmt: skip


def run_configs(run_config: str | Sequence[str] | None) -> list[str]:
    """``flwr run``'s ``--run-config`` values: one string, or several (each given as its own option;
    Flower merges them in order, a later value of a key overriding an earlier one)."""
    if run_config is None:
        return []
    given = [run_config] if isinstance(run_config, str) else list(run_config)
    odd = [c for c in given if not isinstance(c, str)]
    if odd:
        raise ValueError(f"run_config must be strings of key=value pairs, got {odd[0]!r}")
    return [c for c in given if c]


def checked_run_config(app: Path, nodes: int, run_config: str | Sequence[str] | None) -> None:
    """Refuse, before anything starts, a run config naming a key the app does not declare (Flower says
    only "Invalid run configuration") and fewer nodes than the app's ``min-nodes`` (the run would wait
    for the missing nodes for ever). ``run_config``: one ``--run-config`` value or several, merged as
    Flower merges them."""
    import tomllib

    from flwr.common.config import parse_config_args

    try:
        declared = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    except (KeyError, TypeError, tomllib.TOMLDecodeError):
        return  # not our business: Flower reads the app
    configs = run_configs(run_config)
    try:
        given = parse_config_args(configs) if configs else {}
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        shown = " ".join(f"--run-config {c!r}" for c in configs)
        raise ValueError(f"{shown} is not key=value pairs: {exc}") from None
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise ValueError(
            f"--run-config: {app} declares no key {unknown[0]!r}; its keys: {', '.join(declared)}"
        )
    for key, value in given.items():  # the kind the app declares (min-nodes=3.0 failed in the ServerApp)
        if not _same_kind(value, declared[key]):
            raise ValueError(f"--run-config {key}={value!r}: {app} declares {key} = {declared[key]!r}; give "
                             f"{_KINDS.get(type(declared[key]), type(declared[key]).__name__)}")  # fmt: skip
    least = given.get("min-nodes", declared.get("min-nodes"))
    if isinstance(least, int) and not isinstance(least, bool) and nodes < least:
        raise ValueError(f"--nodes {nodes} is below the app's min-nodes ({least}): the run would wait for "
                         f"{least - nodes} more for ever; give --nodes {least} or set "
                         f"min-nodes={nodes}")  # fmt: skip


_KINDS = {bool: "true or false", int: "a whole number (3, not 3.0)", float: "a number",
          str: 'a string, quoted (key="value")'}  # fmt: skip


def _same_kind(value: Any, declared: Any) -> bool:
    """Whether a run-config value is of the kind its declared default is (an int where a float is
    declared too; a bool is no number here)."""
    if isinstance(declared, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(declared, bool)
    if isinstance(declared, float):
        return isinstance(value, int | float)
    return type(value) is type(declared)


def simulate(
    app: str | Path, nodes: int, run_config: str | Sequence[str] | None = None, logs: Path | None = None
) -> int:
    """``flwr run APP --stream`` in Flower's simulation engine with ``nodes`` SuperNodes, on a SuperLink
    started for it and stopped (with everything it started) when the run ends; the exit status of
    ``flwr run``, or 1 when it exited 0 but the run did not finish as completed (a ServerApp that raised).
    The SuperLink's log goes to ``logs`` (default: a temporary folder, removed)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a whole number >= 1, got {nodes!r}")
    if not (Path(app) / "pyproject.toml").is_file():
        raise ValueError(f"app {app}: no pyproject.toml there (give the folder of a Flower app)")
    checked_run_config(Path(app), nodes, run_config)
    with tempfile.TemporaryDirectory(prefix="fedtrust-flower-") as tmp, _terminated_as_interrupt():
        procs = Processes(Path(tmp) / "flwr-home", Path(logs) if logs else Path(tmp))
        port = free_port()
        try:
            procs.start("superlink", ["flower-superlink", "--insecure", "--simulation", "--isolation",
                                      "subprocess", "--host", "127.0.0.1", "--port", str(port),
                                      "--control-api-address", f"127.0.0.1:{free_port()}"])  # fmt: skip
            connection = f'address = "127.0.0.1:{port}"\ninsecure = true\n'
            (procs.home / "config.toml").write_text(
                f'[superlink]\ndefault = "local"\n\n[superlink.local]\n{connection}'
            )
            procs.wait(lambda: procs.flwr("list", "local").returncode == 0, "the SuperLink")
            command = ["run", str(Path(app).resolve()), "local", "--stream",
                       "--federation-config", f"num-supernodes={nodes}"]  # fmt: skip
            for config in run_configs(run_config):
                command += ["--run-config", config]
            code = procs.flwr(*command, timeout=None, capture=False).returncode
            failed = unfinished_runs(procs) if code == 0 else []
            for line in failed:
                print(f"fedtrust flower-run: {line}", file=sys.stderr)
            return 1 if failed else code
        finally:
            left = procs.stop()
            if left:
                print(f"fedtrust flower-run: processes still running: {left}", file=sys.stderr)
