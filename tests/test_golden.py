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
NUMBER = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?")


def differences(recorded, now, rtol: float, atol: float, path: str = "") -> list[str]:
    if isinstance(recorded, dict) and isinstance(now, dict):
        keys, other = set(recorded) - VOLATILE - OPTIONAL, set(now) - VOLATILE - OPTIONAL
        if keys != other:
            return [f"{path}: keys differ: {sorted(keys ^ other)}"]
        keys |= set(recorded) & set(now) & OPTIONAL
        return [m for k in sorted(keys) for m in differences(recorded[k], now[k], rtol, atol, f"{path}/{k}")]
    if isinstance(recorded, list) and isinstance(now, list):
        if len(recorded) != len(now):
            return [f"{path}: {len(recorded)} entries recorded, {len(now)} now"]
        return [
            m
            for i, (a, b) in enumerate(zip(recorded, now, strict=True))
            for m in differences(a, b, rtol, atol, f"{path}[{i}]")
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


@pytest.mark.parametrize("case", sorted(GOLDEN["rules"]))
def test_every_rule_gives_its_recorded_aggregate_trust_and_info(rule_outputs, case):
    dtype = case.split("/")[0]
    problems = differences(GOLDEN["rules"][case], rule_outputs[case], *TOL[dtype])
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
