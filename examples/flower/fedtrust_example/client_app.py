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
    missing = [key for key in ("partition-id", "num-partitions") if key not in node]
    if missing:  # (a SuperNode started with only a node-name was dropped every round with a KeyError)
        raise ValueError(
            f"this example's ClientApp picks its data by the node config's partition-id and num-partitions; "
            f'{" and ".join(missing)} missing (--node-config "partition-id=0 num-partitions=3"). A site '
            "with its own data gives trust_client_app a data_fn that loads it instead"
        )
    return partition(
        setting(cfg, "dataset", str),
        int(node["partition-id"]),
        int(node["num-partitions"]),
        setting(cfg, "benchmark-size", int, minimum=0),
    )


def _model(context: Context):
    return make_model(str(context.run_config["dataset"]), str(context.run_config["model"]))


app = trust_client_app(_model, _data)
