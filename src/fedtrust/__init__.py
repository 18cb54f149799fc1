"""fedtrust: federated learning from untrusted sources.

from fedtrust import Round, rule
out = rule("geometric_median")(Round(updates=X))
out.vector, out.weights, out.info
"""

from importlib.metadata import version as _version

from fedtrust.aggregators import Aggregate, NoValidUpdates, Round, RoundRefused
from fedtrust.rules import available, register, rule

__version__ = _version("fedtrust")
__all__ = [
    "Aggregate",
    "NoValidUpdates",
    "Round",
    "RoundRefused",
    "__version__",
    "available",
    "register",
    "rule",
]
