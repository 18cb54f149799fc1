"""fedtrust rules on Flower (``pip install fedtrust[flower]``): a Message-API strategy and client helpers.

from fedtrust.flower import TrustStrategy, trust_client_app
strategy = TrustStrategy(rule="arfl", fraction_train=0.5)

Each name is imported from its module when first asked for: under Flower's default isolation a SuperNode
starts a process for every message it runs, so a ClientApp's start-up is paid every round, and the
client's side loads none of the server's (the strategy, its run files, their scoring rules).
"""

from importlib import import_module
from typing import TYPE_CHECKING

_WHERE = {
    "ArrayLayout": "arrays",
    "MalformedReply": "arrays",
    "LocalData": "client",
    "corrupted_partitions": "client",
    "node_name": "client",
    "server_training": "client",
    "trust_client_app": "client",
    "TrustStrategy": "strategy",
}
__all__ = [
    "ArrayLayout",
    "LocalData",
    "MalformedReply",
    "TrustStrategy",
    "corrupted_partitions",
    "node_name",
    "server_training",
    "trust_client_app",
]

if TYPE_CHECKING:
    from fedtrust.flower.arrays import ArrayLayout, MalformedReply
    from fedtrust.flower.client import (
        LocalData,
        corrupted_partitions,
        node_name,
        server_training,
        trust_client_app,
    )
    from fedtrust.flower.strategy import TrustStrategy


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
