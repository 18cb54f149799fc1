"""A refactor changes no result: every rule on fixed rounds, and a short simulation per rule, give what
they gave when ``tests/golden/outputs.json`` was recorded (``python tests/golden/record.py``).

Tolerances come from the dtype, not from one machine's last digits: another CPU (its BLAS kernel, its
vector width) rounds differently, and iterative estimators stopping at a dtype-derived tolerance carry
that rounding into their answer. Iteration counts are left out here for the same reason (one more
iteration on another CPU is not a change in result), and with them what follows from the count: an
estimator's objective per iteration (``trace``; its last value is ``objective``, compared) and, for a fit
stopped at its iteration limit, the size of its last step, which the warning's text quotes (on a nearly
flat likelihood one CPU's last step moved a weight by 0.000974, another's by 4e-05). ``record.py
--compare`` shows every difference.
"""

import json
import math
import re
import warnings

import pytest
import torch
from golden import record

GOLDEN = json.loads(record.OUTPUTS.read_text())
#: (rtol, atol) per dtype of the fixed rounds; simulations train in float32 for three rounds, where a
#: rounding difference can move a test sample across a decision boundary (1/450 of the accuracy).
TOL = {"float32": (1e-3, 1e-4), "float64": (1e-6, 1e-8), "simulation": (1e-2, 2e-2)}
VOLATILE = {"iterations", "converged", "trace"}
#: present only where a fit stopped at its iteration limit, which rounding can decide: compared where both are
OPTIONAL = {"warning"}
#: (rtol, atol) of estimators resolved more coarsely than their dtype, per key (``""``: every other key).
#: ICOV-MLE stops where its L-BFGS calls find the likelihood flat (``icov._CovarianceFit``: weights to
#: about 1e-5-3e-4), so another CPU's rounding ends the fit elsewhere on that flat ridge, in float64 too.
#: Measured on these rounds under nine kernel settings of one CPU (ATen default/AVX2/AVX-512 times MKL
#: SSE4.2/AVX2/AVX-512): weights within 3.2e-4, the aggregate within 1.3e-3, the noise variances within
#: 7e-4 relative; sigma_u^2, the latent variance along which the likelihood is flattest, within 5%.
RESOLUTION = {"icov_mle": {"": (1e-2, 3e-3), "sigma_u2": (0.15, 3e-3)}}
#: Rounds with identical updates (rows of the same update) where the rule is told not to group them
#: (``sybils="off"``, the papers' setting): the joint likelihood's degenerate solution puts the trust on
#: the copies, and how it splits among them, the size of their collapsed variance (1e-17 beside the
#: others' 1-2) and with it the objective are the CPU's rounding (float32: 0.2 to each of five on an
#: Intel AVX-512 CPU, 1/3 to three and 1e-8 to two on an AMD EPYC). What is defined is compared: the
#: aggregate, the copies' weight together, and every other client's weight and statistics.
DEGENERATE = ("copies", "sybils=off")
NUMBER = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?")


def differences(recorded, now, rtol: float, atol: float, path: str = "", by_key=None) -> list[str]:
    """Every number of ``now`` off its recorded value by more than ``rtol``/``atol`` (or, under a key of
    ``by_key``, {key: (rtol, atol)}, by more than that key's), every other value that differs."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        keys, other = set(recorded) - VOLATILE - OPTIONAL, set(now) - VOLATILE - OPTIONAL
        if keys != other:
            return [f"{path}: keys differ: {sorted(keys ^ other)}"]
        keys |= set(recorded) & set(now) & OPTIONAL
        return [
            m
            for k in sorted(keys)
            for m in differences(
                recorded[k], now[k], *(by_key or {}).get(k, (rtol, atol)), f"{path}/{k}", by_key
            )
        ]
    if isinstance(recorded, list) and isinstance(now, list):
        if len(recorded) != len(now):
            return [f"{path}: {len(recorded)} entries recorded, {len(now)} now"]
        return [
            m
            for i, (a, b) in enumerate(zip(recorded, now, strict=True))
            for m in differences(a, b, rtol, atol, f"{path}[{i}]", by_key)
        ]
    if path.endswith("/fallback") and isinstance(recorded, str) and isinstance(now, str):
        # what the rule fell back to must hold; the error text of the fit that broke down is the
        # library's (torch's Cholesky message, a float division) and how a fit breaks may vary by CPU
        recorded, now = recorded.split(" -> ")[-1], now.split(" -> ")[-1]
    if path.endswith("/warning") and isinstance(recorded, str) and isinstance(now, str):
        # the same warning, its numbers aside: the limit and tol are the config's, the last step rounding's
        recorded, now = NUMBER.sub("#", recorded), NUMBER.sub("#", now)
    if isinstance(recorded, bool | str) or recorded is None or isinstance(now, bool | str) or now is None:
        return [] if recorded == now else [f"{path}: recorded {recorded!r}, now {now!r}"]
    if math.isclose(float(now), float(recorded), rel_tol=rtol, abs_tol=atol):
        return []
    return [f"{path}: recorded {recorded!r}, now {now!r}"]


@pytest.fixture(scope="module")
def rule_outputs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return json.loads(json.dumps(record.rule_outputs()))


def defined(case: str, results: list) -> list:
    """What a rule's results on a round define: all of them, except on a :data:`DEGENERATE` round, where
    the copies' weights are summed and their statistics, the objective and the fitted variances left
    out."""
    fixture, label = case.split("/")[1:]
    if fixture != DEGENERATE[0] or DEGENERATE[1] not in label:
        return results
    updates = record.rounds(getattr(torch, case.split("/")[0]))[fixture][0]["updates"]
    copies = (updates == updates[0]).all(1).tolist()
    assert sum(copies) > 1 and len(results) == 1
    others = [i for i, copy in enumerate(copies) if not copy]
    out = results[0]
    clients = {k: [v[i] for i in others] for k, v in out["info"]["clients"].items()}
    weights = [sum(w for w, copy in zip(out["weights"], copies, strict=True) if copy)]
    return [{"vector": out["vector"], "weights": weights + [out["weights"][i] for i in others],
             "info": {"clients": clients}}]  # fmt: skip


@pytest.mark.parametrize("case", sorted(GOLDEN["rules"]))
def test_every_rule_gives_its_recorded_aggregate_trust_and_info(rule_outputs, case):
    dtype, name = case.split("/")[0], case.split("/")[-1].split(",")[0]
    resolution = RESOLUTION.get(name, {})
    problems = differences(
        defined(case, GOLDEN["rules"][case]),
        defined(case, rule_outputs[case]),
        *resolution.get("", TOL[dtype]),
        by_key=resolution,
    )
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize(
    ("name", "options"), record.SIM_CASES, ids=[record.label(*case) for case in record.SIM_CASES]
)
def test_every_rule_trains_the_recorded_short_simulation(name, options):
    case = record.label(name, options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        now = json.loads(json.dumps(record.sim_outputs([(name, options)])))
    problems = differences(GOLDEN["simulations"][case], now[case], *TOL["simulation"])
    assert not problems, "\n".join(problems[:10])


def test_the_golden_file_covers_every_registered_rule():
    from fedtrust.rules import RULES

    recorded = {case.split("/")[-1].split(",")[0] for case in GOLDEN["rules"]}
    assert recorded == set(RULES)
