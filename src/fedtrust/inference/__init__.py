"""Truth inference on a tasks x sources (x K) array with missing entries (Nguyen, Lim, Wynter, Cai).

    from fedtrust.inference import ivar_vb
    res = ivar_vb(estimates)            # (tasks, sources) or (tasks, sources, K); NaN = missing
    res.consensus, res.noise, res.reliability, res.weights, res.trace

Useful on its own (crowdsourced predictions, sensor fusion) and the engine of the ivar_* / icov_* rules.
"""

from fedtrust.inference.icov import icov_mle, icov_vb
from fedtrust.inference.ivar import ivar_mle, ivar_vb
from fedtrust.inference.result import ConvergenceWarning, InferenceResult

METHODS = {"ivar_mle": ivar_mle, "ivar_vb": ivar_vb, "icov_mle": icov_mle, "icov_vb": icov_vb}

__all__ = ["METHODS", "ConvergenceWarning", "InferenceResult", "icov_mle", "icov_vb", "ivar_mle", "ivar_vb"]
