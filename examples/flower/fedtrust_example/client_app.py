"""The ClientApp: local SGD on this node's partition, reporting what fedtrust rules read.

A node is told which partition it holds by its node config (``partition-id``, ``num-partitions``; the
simulation sets them). For demos a node can be corrupted: in a deployment through its node config
(``fedtrust-corruption="random_labels"``, ``fedtrust-attack="sign_flip"`` or ``fedtrust-lie=0.0``), in
simulation by listing its partition in the run config's ``fedtrust-corrupted-partitions``.
"""

from flwr.app import Context

from fedtrust.flower import trust_client_app
from fedtrust_example.task import make_model, partition, setting


def _data(context: Context):
    cfg = context.run_config
    node = context.node_config
    return partition(
        setting(cfg, "dataset", str),
        int(node["partition-id"]),
        int(node["num-partitions"]),
        setting(cfg, "benchmark-size", int, minimum=0),
    )


def _model(context: Context):
    return make_model(str(context.run_config["dataset"]), str(context.run_config["model"]))


app = trust_client_app(_model, _data)
