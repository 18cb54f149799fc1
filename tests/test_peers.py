"""experiments/peers: the peers' own implementations as rules on fedtrust's federation. Where a peer
computes the same rule as fedtrust, the two agree on a round; the wrappers leave the round as it was;
the run caches what it computed and its report compares the twins."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import fedtrust
from fedtrust import Round

HERE = Path(__file__).parent.parent / "experiments" / "peers"


def load(name: str, file: str):
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (the run's worker function is pickled by its module's name)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers():
    from fedtrust.rules import RULES

    before = dict(RULES)
    sys.path.insert(0, str(HERE))
    rules = load("rules", "rules.py")
    rules.register_peers()
    yield rules
    sys.path.remove(str(HERE))
    RULES.clear()  # the rest of the suite sees fedtrust's rules only
    RULES.update(before)


def a_round(seed=0, n=12, d=40) -> Round:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:3] *= 10
    return Round(updates=x, num_samples=torch.randint(5, 40, (n,), generator=g).float())


@pytest.mark.parametrize(
    ("strategy", "ours", "options"),
    [
        ("fedavg", "fedavg", {}),
        ("fedmedian", "median", {}),
        ("fedtrimmedavg", "trimmed_mean", {"f": 0.25}),
        ("krum", "krum", {"f": 0.25}),
    ],  # fmt: skip
)
def test_flowers_strategy_aggregates_as_fedtrusts_rule_of_the_same_definition(peers, strategy, ours, options):
    r = a_round()
    before = r.updates.clone()
    theirs = fedtrust.rule("flower", strategy=strategy, **options)(r)
    torch.testing.assert_close(theirs.vector, fedtrust.rule(ours, **options)(r).vector, rtol=1e-6, atol=1e-6)
    assert torch.equal(r.updates, before)
    assert theirs.info["trust"].startswith("the peer reports no per-client trust")


def test_byzfls_aggregators_run_on_the_round_leave_it_as_it_was_and_resume(peers):
    if peers.byzfl_aggregators() is None:
        pytest.skip("byzfl is not installed (make peers and make bench install it)")
    r = a_round()
    before = r.updates.clone()
    torch.testing.assert_close(
        fedtrust.rule("byzfl", chain="median")(r).vector, fedtrust.rule("median")(r).vector
    )
    fedtrust.rule("byzfl", chain="arc+trmean", f=0.25)(r)  # ByzFL's ARC clips its input in place
    assert torch.equal(r.updates, before)
    rounds = [a_round(seed) for seed in range(4)]
    for chain in ("cc", "bucketing+geomed"):  # a centre kept across rounds; draws that follow the calls
        a = fedtrust.rule("byzfl", chain=chain, f=0.25)
        for x in rounds[:2]:
            a(x)
        b = fedtrust.rule("byzfl", chain=chain, f=0.25)
        b.load_state_dict(copy.deepcopy(a.state_dict()))
        for x in rounds[2:]:
            assert torch.equal(a(x).vector, b(x).vector)


def test_a_peer_loses_its_budget_to_quarantined_clients_as_fedtrusts_rules_do(peers):
    x = a_round(n=10).updates
    x[:2] = float("nan")  # two quarantined: f = floor(0.2 * 10) - 2 = 0, the plain mean of the rest
    r = Round(updates=x)
    out = fedtrust.rule("flower", strategy="fedtrimmedavg", f=0.2)(r)
    torch.testing.assert_close(out.vector, x[2:].mean(0))
    assert out.weights[:2].tolist() == [0.0, 0.0] and set(out.info["quarantined"]) == {0, 1}


def test_the_run_caches_its_cells_and_reports_twins_that_agree(peers, tmp_path, capsys):
    run = load("peers_run", "run.py")
    args = ["--seeds", "1", "--rounds", "2", "--attacks", "clean", "ipm", "--jobs", "1", "--out", str(tmp_path),
            "--peers", "flower(strategy=fedmedian)", "--fedtrust", "median"]  # fmt: skip
    run.main(args)
    assert "6 runs to compute, 0 cached" in capsys.readouterr().out
    report = (tmp_path / "digits.md").read_text()
    assert "| flower(strategy=fedmedian) | median | the same | 0.000 | 0.000 | - |" in report
    run.main(args)
    assert "0 runs to compute, 6 cached" in capsys.readouterr().out
