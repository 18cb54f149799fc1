"""fedtrust rules on Flower (``pip install fedtrust[flower]``): a Message-API strategy and client helpers.

from fedtrust.flower import TrustStrategy, trust_client_app
strategy = TrustStrategy(rule="arfl", fraction_train=0.5)
"""

from fedtrust.flower.arrays import ArrayLayout, MalformedReply
from fedtrust.flower.client import LocalData, node_name, server_training, trust_client_app
from fedtrust.flower.strategy import TrustStrategy

__all__ = [
    "ArrayLayout",
    "LocalData",
    "MalformedReply",
    "TrustStrategy",
    "node_name",
    "server_training",
    "trust_client_app",
]
