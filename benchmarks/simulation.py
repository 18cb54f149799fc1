"""Rounds per second of a 100-client federation: fedtrust's simulator against Flower's simulation engine.

    python benchmarks/simulation.py                            # digits and Fashion-MNIST x softmax and MLP
    python benchmarks/simulation.py --data digits --models mlp --rounds 4
    python benchmarks/simulation.py --data fashion_mnist --models softmax mlp cnn --device cuda \
        --flower-devices cpu cuda --out benchmarks/results/simulation_gpu     # issue 20's GPU round

The same federation on both sides: data set, IID partition over 100 clients (all of them train every
round), model (fedtrust's model zoo), plain SGD with E = 1 local epoch, B = 32, the same mini-batches
(fedtrust's seeded streams), FedAvg aggregation, no evaluation. fedtrust runs in one process with its
batched executor (every client's local steps as one vmapped computation) and, as the reference, its
per-client loop; Flower runs ``flower_app.py`` (a quickstart-style PyTorch ClientApp and Flower's FedAvg)
through ``flwr.simulation.run_simulation`` on the Ray backend with one CPU per simulated client (with
``--flower-devices cuda``: the clients' models and data on the GPU, which as many clients as CPUs share
at a time; each Flower device is a run and the fastest is the baseline). Round 1
(start-up, warm-up) is not timed. The final models of the batched executor and of Flower are compared.
Writes benchmarks/results/simulation.md and .json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from aggregation import machine  # noqa: E402

MODELS = {"softmax": {"name": "softmax"}, "mlp": {"name": "mlp", "hidden": 200}, "cnn": {"name": "cnn"}}
#: What the default run times (the CNN is for GPUs: on a 2-core CPU Flower's side takes minutes a round)
DEFAULT_MODELS = ["softmax", "mlp"]


def spec(data: str, model: str, clients: int, rounds: int, device: str = "cpu") -> dict:
    return {
        "name": "bench-simulation",
        "seed": 0,
        "data": {"name": data, "clients": clients, "partition": {"name": "iid"}},
        "model": MODELS[model],
        "train": {
            "rounds": rounds,
            "fraction": 1.0,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.05,
            "device": device,
        },  # fmt: skip
        "rule": {"name": "fedavg"},
    }


def run_fedtrust(raw: dict, executor: str, min_seconds: float) -> tuple[float, torch.Tensor]:
    """Rounds per second over rounds 2.. (at least R rounds and ``min_seconds`` of timed rounds, so fast
    rounds are timed over many) and the global vector after round R."""
    raw = {**raw, "train": {**raw["train"], "executor": executor}}
    sim = build_simulation(validate(raw))
    sim.evaluate = lambda t: {}  # no evaluation, as on the Flower side
    ends, t, final = [], 0, None
    while t < sim.rounds or ends[-1] - ends[0] < min_seconds:
        t += 1
        sim.step(t)
        if sim.device.type == "cuda":
            torch.cuda.synchronize(sim.device)
        ends.append(time.perf_counter())
        if t == sim.rounds:
            final = sim.vector.cpu().clone()
    return (len(ends) - 1) / (ends[-1] - ends[0]), final


def round_floor(raw: dict) -> float:
    """Seconds for the arithmetic of one round without per-client structure: one epoch over every
    client's rows, batches of clients x B rows, forward and backward with one shared weight vector
    (median of 5). Every executor does at least this work; Flower's round time over it bounds any
    speed-up."""
    sim = build_simulation(validate(raw))
    x = torch.cat([a for a, _ in sim.fed.data])
    y = torch.cat([b for _, b in sim.fed.data])
    rows = raw["data"]["clients"] * raw["train"]["batch_size"]
    w = sim.vector.clone().requires_grad_(True)

    def epoch():
        for xb, yb in zip(x.split(rows), y.split(rows), strict=True):
            torch.autograd.grad(sim.model.loss(w, xb, yb), w)
        if sim.device.type == "cuda":
            torch.cuda.synchronize(sim.device)

    epoch()
    times = []
    for _ in range(5):
        began = time.perf_counter()
        epoch()
        times.append(time.perf_counter() - began)
    return sorted(times)[2]


def flower_resources(device: str) -> dict:
    """Flower's ``client_resources``: one CPU per simulated client; on a GPU the clients share it, as many
    at a time as there are CPUs (Flower's documented way to put simulated clients on a GPU)."""
    if device == "cpu":
        return {"num_cpus": 1, "num_gpus": 0.0}
    return {"num_cpus": 1, "num_gpus": math.floor(1e4 / (os.cpu_count() or 1)) / 1e4}  # Ray's resolution


def run_flower(raw: dict, device: str = "cpu") -> tuple[float, torch.Tensor]:
    """Rounds per second of Flower's simulation engine on the federation (its clients' models and data on
    ``device``) over rounds 2..R, and its final global vector."""
    raw = {**raw, "train": {**raw["train"], "device": device}}
    os.environ["FEDTRUST_BENCH_SPEC"] = json.dumps(raw)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in paths:  # the workers import flower_app from here
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *paths])
    import flower_app
    from flwr.simulation import run_simulation

    flower_app.simulation.cache_clear()
    flower_app.client_module.cache_clear()
    flower_app.ROUND_ENDS.clear()
    flower_app.FINAL.clear()
    run_simulation(
        server_app=flower_app.server,
        client_app=flower_app.client,
        num_supernodes=raw["data"]["clients"],
        backend_config={"client_resources": flower_resources(device)},
    )
    ends = flower_app.ROUND_ENDS[1:]  # [0] is the evaluation of the initial model
    if len(ends) != raw["train"]["rounds"] or not flower_app.FINAL:
        raise RuntimeError(f"Flower's run did not finish: {len(ends)} rounds recorded")
    return (len(ends) - 1) / (ends[-1] - ends[0]), flower_app.FINAL[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", nargs="+", default=["digits", "fashion_mnist"])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (round 1 is not timed)")
    parser.add_argument("--min-seconds", type=float, default=3.0, help="least timed seconds per fedtrust run")
    parser.add_argument("--no-flower", dest="flower", action="store_false")
    parser.add_argument("--no-loop", dest="loop", action="store_false", help="skip the per-client loop")
    parser.add_argument("--device", default="cpu", help="fedtrust's device (train.device)")
    parser.add_argument(
        "--flower-devices", nargs="+", default=["cpu"], metavar="DEVICE",
        help="where Flower's simulated clients train (each is a run; the fastest is the baseline)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=HERE / "results" / "simulation")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = []
    for data in args.data:
        for model in args.models:
            raw = spec(data, model, args.clients, args.rounds, args.device)
            row = {"data": data, "model": model, "clients": args.clients, "rounds": args.rounds}
            row["batched"], batched_vector = run_fedtrust(raw, "batched", args.min_seconds)
            if args.loop:
                row["loop"], _ = run_fedtrust(raw, "loop", args.min_seconds)
            row["floor"] = round_floor(raw)
            print(
                f"{data:14s} {model:8s} fedtrust batched {row['batched']:8.2f} rounds/s, "
                f"loop {row.get('loop', float('nan')):6.2f} rounds/s, "
                f"floor {row['floor'] * 1e3:.1f} ms/round",
                flush=True,
            )
            if args.flower:
                runs = {}
                for device in args.flower_devices:
                    rate, flower_vector = run_flower(raw, device)
                    agreement = float((flower_vector - batched_vector).norm() / batched_vector.norm())
                    runs[device] = {"rounds_per_s": rate, "agreement": agreement}
                    print(
                        f"{'':23s} Flower on {device:6s} {rate:8.3f} rounds/s: fedtrust "
                        f"{row['batched'] / rate:.1f}x, final models differ by {agreement:.1e} (relative)",
                        flush=True,
                    )
                best = max(runs, key=lambda k: runs[k]["rounds_per_s"])
                row["flower_runs"], row["flower_device"] = runs, best
                row["flower"], row["agreement"] = runs[best]["rounds_per_s"], runs[best]["agreement"]
                row["speedup"] = row["batched"] / row["flower"]
                row["ceiling"] = 1 / (row["flower"] * row["floor"])
            rows.append(row)
            write(args, rows)  # after every row, so a run stopped early keeps the rows it finished


def write(args, rows: list[dict]) -> None:
    info = machine()
    if torch.cuda.is_available() and "cuda" in " ".join([args.device, *args.flower_devices]):
        info["gpu"] = torch.cuda.get_device_name(torch.device(args.device) if "cuda" in args.device else 0)
    versions = {k: info[k] for k in ("python", "torch", "fedtrust", "flwr")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/simulation.py " + " ".join(sys.argv[1:])
    payload = {"machine": info, "versions": versions, "command": command.strip(), "rows": rows}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    lines = [
        "# Simulation: rounds per second, fedtrust vs Flower's simulation engine",
        "",
        f"Machine: {payload['machine']['cpu']}, {payload['machine']['threads']} threads"
        + (f"; GPU {info['gpu']}. " if "gpu" in info else ". ")
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + ".",
        f"Command: `{payload['command']}`.",
        "",
        f"{args.clients} clients, all training every round, IID, E = 1, B = 32, SGD lr 0.05, FedAvg, "
        "no evaluation; rounds 2..R timed. *rel. diff*: ||Flower - fedtrust|| / ||fedtrust|| of the final "
        "models (identical mini-batches on both sides). *floor*: the round's arithmetic without per-client "
        "structure (one epoch over all rows in batches of clients x B, one shared weight); *ceiling*: "
        "Flower's round time / floor, the most any executor could gain over Flower here. fedtrust on "
        f"{args.device}; Flower's clients on {', '.join(args.flower_devices)} (the fastest is the baseline; "
        "the JSON has each run).",
        "",
        "| data | model | fedtrust batched (rounds/s) | fedtrust loop | floor (ms/round) | Flower "
        "| Flower on | speed-up | ceiling | rel. diff |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        flower = (
            f"{r['flower']:.3f} | {r.get('flower_device', 'cpu')} | {r['speedup']:.1f}x "
            f"| {r['ceiling']:.0f}x | {r['agreement']:.0e}"
            if "flower" in r
            else "- | - | - | - | -"
        )
        loop = f"{r['loop']:.2f}" if "loop" in r else "-"
        lines.append(
            f"| {r['data']} | {r['model']} | {r['batched']:.2f} | {loop} | {r['floor'] * 1e3:.1f} "
            f"| {flower} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
