"""An in-process Flower grid for strategy tests: nodes answer messages by running their ClientApp here."""

import itertools

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedtrust.data import load_digits
from fedtrust.flower import LocalData, trust_client_app
from fedtrust.flower.arrays import ArrayLayout
from fedtrust.models import FlatModel

DIGITS = load_digits()
TASKS = itertools.count(1)


class InProcessGrid:
    """Just enough of flwr's Grid for a strategy: nodes answer messages by running their ClientApp here."""

    def __init__(self, nodes: dict[int, tuple[ClientApp, dict]]):
        self.nodes = nodes
        self.offline: set[int] = set()  # nodes that left (connected again when taken out)

    def get_node_ids(self):
        return [node for node in self.nodes if node not in self.offline]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            app, config = self.nodes[node]
            TaskIdentity.node_id, TaskIdentity.task_id = node, next(TASKS)
            try:
                replies.append(
                    app(
                        msg,
                        Context(
                            run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={}
                        ),
                    )
                )
            except Exception as exc:  # a crashing ClientApp comes back as an error reply
                replies.append(Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
            finally:
                TaskIdentity.node_id, TaskIdentity.task_id = 0, next(TASKS)
        return replies


@pytest.fixture(autouse=True)
def server_identity():
    """Flower's messages read the sender's identity from here; the server's, between node calls."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, next(TASKS)


def model():
    return torch.nn.Linear(64, 10)


def share(k, parts=4, uneven=False):
    """Partition ``k`` of ``parts`` IID shares of digits' training rows (sized 1 : 2 : ... : parts when
    ``uneven``)."""
    order = torch.randperm(len(DIGITS), generator=torch.Generator().manual_seed(0))
    if uneven:
        ends = torch.tensor(range(1, parts + 1)).cumsum(0) * len(order) // (parts * (parts + 1) // 2)
        rows = order.tensor_split(ends[:-1].tolist())[k]
    else:
        rows = order.tensor_split(parts)[k]
    return LocalData(DIGITS.x_train[rows], DIGITS.y_train[rows], DIGITS.x_test, DIGITS.y_test, 10)


def federation(bad: dict[int, dict] | None = None, parts=4, extra: dict | None = None, uneven=False, **keys):
    """Nodes 100, 101, ... on partitions 0, 1, ...; ``bad`` adds node config (a corruption) by partition,
    ``keys`` go to trust_client_app (reply keys)."""
    app = trust_client_app(
        lambda ctx: model(),
        lambda ctx: share(int(ctx.node_config["partition-id"]), parts, uneven),
        local_epochs=2,
        lr=0.5,
        **keys,
    )
    nodes = {100 + k: (app, {"partition-id": k, **(bad or {}).get(k, {})}) for k in range(parts)}
    nodes.update(extra or {})
    return InProcessGrid(nodes)


def initial():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ArrayRecord(model().state_dict())


def accuracy(arrays):
    flat = ArrayLayout(arrays).flatten(arrays)
    return FlatModel(model(), "classification").evaluate(flat, DIGITS.x_test, DIGITS.y_test)["accuracy"]


def run(strategy, grid, rounds=3):
    return strategy.start(grid=grid, initial_arrays=initial(), num_rounds=rounds)


def far(grid, partitions, scale=1e11):
    """``grid`` with the nodes of ``partitions`` replying with their model replaced by +-``scale`` in
    every entry (signs of their own), as a broken or hostile node might."""
    for k in partitions:
        app, config = grid.nodes[100 + k]

        def replaced(msg, context, app=app, k=k):
            reply = app(msg, context)
            if reply.has_content():
                for record in reply.content.array_records.values():
                    for name in list(record.keys()):
                        a = record[name].numpy()
                        signs = np.random.default_rng(k).choice([-1.0, 1.0], size=a.shape).astype(a.dtype)
                        record[name] = Array(scale * signs)
            return reply

        grid.nodes[100 + k] = (replaced, config)
    return grid
