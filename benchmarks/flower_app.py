"""The Flower side of ``simulation.py``: the same federation as a plain Flower app on the Message API.

A ClientApp the way Flower's PyTorch quickstart writes one (load the global arrays into an ``nn.Module``,
local SGD with ``torch.optim.SGD``, reply with the new arrays and ``num-examples``) and Flower's own
``FedAvg`` strategy. The benchmark's run spec reaches the simulation's worker processes through the
environment (``FEDTRUST_BENCH_SPEC``, JSON); each worker builds the federation from it once. Clients draw
their mini-batches from fedtrust's seeded streams, so both engines train on identical batches and their
final models agree (checked by ``simulation.py``).
"""

from __future__ import annotations

import copy
import json
import os
import time
from functools import cache

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedtrust.seeding import stream
from fedtrust.sim.training import batches
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

SPEC = "FEDTRUST_BENCH_SPEC"


@cache
def simulation():
    """The fedtrust Simulation for the spec (its federation, model and seed); built once per process."""
    torch.set_num_threads(1)  # one simulated client per CPU, as the backend's client_resources say
    return build_simulation(validate(json.loads(os.environ[SPEC])))


@cache
def client_module() -> torch.nn.Module:
    """The model as Flower's quickstart holds it: an ``nn.Module`` on the clients' device (where the
    federation's data is), one per process."""
    sim = simulation()
    return copy.deepcopy(sim.model.module).to(sim.device)


client = ClientApp()


@client.train()
def train(msg: Message, context: Context) -> Message:
    sim = simulation()
    k = int(context.node_config["partition-id"])
    t = int(msg.content["config"]["server-round"])
    s = sim.settings
    module = client_module()
    module.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    optimiser = torch.optim.SGD(module.parameters(), lr=s.lr)
    x, y = sim.fed.data[k]
    g = stream(sim.seed, "train", t, k)
    for _ in range(s.local_epochs):
        for rows in batches(len(y), s.batch_size, g):
            optimiser.zero_grad()
            torch.nn.functional.cross_entropy(module(x[rows]), y[rows]).backward()
            optimiser.step()
    content = RecordDict(
        {"arrays": ArrayRecord(module.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
    )
    return Message(content=content, reply_to=msg)


#: Wall-clock time at the end of each round (round 0: the start), read by simulation.py in-process.
ROUND_ENDS: list[float] = []
#: The final global parameters as one flat vector.
FINAL: list[torch.Tensor] = []

server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    sim = simulation()
    torch.set_num_threads(os.cpu_count() or 1)  # the server runs in the driver process
    spec = json.loads(os.environ[SPEC])
    module = sim.model.module
    module.load_state_dict(sim.model.state_dict(sim.initial))
    clients = sim.fed.num_clients
    strategy = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients
    )

    def stamp(server_round: int, arrays: ArrayRecord) -> None:
        ROUND_ENDS.append(time.perf_counter())

    result = strategy.start(
        grid, ArrayRecord(module.state_dict()), num_rounds=spec["train"]["rounds"], evaluate_fn=stamp
    )
    state = result.arrays.to_torch_state_dict()
    FINAL.append(torch.cat([state[name].reshape(-1) for name in sim.model.names]))
