"""On a real CUDA device, when torch sees one (skipped otherwise): every rule and a short simulation
give the CPU's results there. ``test_devices.py`` checks the same paths on every machine through an
emulated device; this module is the check on the hardware itself."""

import pytest
import torch
from conftest import dtype_tol
from float_specials import assert_window_agrees, special_columns, windows
from test_devices import CASES, SIMULATIONS, build, rounds, simulation_config

from fedtrust import Round

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


def on_cuda(r: Round) -> Round:
    move = lambda t: None if t is None else t.cuda()  # noqa: E731
    return Round(move(r.updates), r.client_ids, move(r.num_samples), {k: move(v) for k, v in r.metrics.items()},
                 r.reference, move(r.previous))  # fmt: skip


#: Iteration limits under which every round here converges. Two devices round differently, so they agree
#: at a fixed point, not at an iterate stopped early: ICOV-MLE's default 50 iterations stop short on two
#: of these rounds (it converges linearly there, in 99 on the float64 one), and on an H200 the two
#: stopped iterates differed by 0.8% where the CPU's own rounding gives the same iterate.
CONVERGED = {"icov_mle": {"max_iter": 500}}
#: How far ICOV-MLE's converged weights move when the inputs move by one ulp (different rounding, as on
#: another device): up to 1.5e-5 on these rounds and 9.7e-5 on 11 x 60 ones, in float64 as in float32
#: (its L-BFGS fit stops on a flat likelihood; measured on this machine's CPU). At fixed points the float64
#: case still failed on an H200 at the rounding tolerance (the run's time limit cut its message off).
ICOV_MLE_RESOLUTION = 5e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_rule_on_cuda_matches_the_cpu(name, options, dtype):
    options = {**CONVERGED.get(name, {}), **options}
    on_cpu, on_gpu = build(name, options), build(name, options)
    for r in rounds(dtype, copies=True):
        expected, out = on_cpu(r), on_gpu(on_cuda(r))
        assert expected.info.get("converged", True), f"{name} stopped short on the CPU: raise CONVERGED"
        assert out.vector.is_cuda and out.weights.is_cuda and out.vector.dtype == dtype
        # CUDA's reductions sum in another order than the CPU's: float rounding apart, and an iterative
        # rule may stop a step apart
        tol = dtype_tol(dtype, factor=1e3 if name.startswith("icov") else 100.0)
        if name == "icov_mle":  # its fit resolves the weights (so the consensus) to ~1e-5 in any dtype
            tol = {k: max(v, ICOV_MLE_RESOLUTION) for k, v in tol.items()}
        torch.testing.assert_close(out.vector.cpu(), expected.vector, **tol)
        torch.testing.assert_close(out.weights.cpu(), expected.weights, **tol)


@pytest.mark.parametrize(("rule_name", "corruption", "executor", "model"), SIMULATIONS,
                         ids=[f"{r}-{c['name']}-{e}" for r, c, e, _ in SIMULATIONS])  # fmt: skip
def test_short_simulation_on_cuda_matches_the_cpu(rule_name, corruption, executor, model):
    """Both executors, an attack, a backdoor, and the rules that read the server's benchmark split
    (FOCUS's losses come back as CUDA tensors, read in one transfer; FLTrust's g_0)."""
    from fedtrust.sweeps.runner import build_simulation

    cfg = simulation_config(rule_name, corruption, executor, model)
    expected = build_simulation(cfg, device="cpu").run()
    sim = build_simulation(cfg, device="cuda")
    records = sim.run()
    assert sim.vector.is_cuda
    for got, want in zip(records, expected, strict=True):
        assert got["error"] == want["error"]
        assert got["metrics"]["accuracy"] == pytest.approx(want["metrics"]["accuracy"], abs=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("method", ["sort", "count", "select"])
@pytest.mark.parametrize("n", [1, 2, 11, 16, 17, 100, 101])
def test_each_rank_window_kernel_matches_the_torch_path(n, method, dtype):
    """Each Triton kernel gives rank_window_by_sort's values and tie shares and row_norms' norms, for
    continuous values, a few distinct ones and a block of copies, contiguous or not; rank_window takes
    a kernel up to triton_windows.MAX_CLIENTS clients."""
    from fedtrust.aggregators import triton_windows
    from fedtrust.aggregators.passes import row_norms
    from fedtrust.aggregators.rank_windows import rank_window, rank_window_by_sort

    assert triton_windows.suits(torch.zeros(n, 3, dtype=dtype, device="cuda")) == (
        n <= triton_windows.MAX_CLIENTS
    )
    g = torch.Generator().manual_seed(n)
    continuous = torch.randn(n, 2000, generator=g, dtype=dtype)
    few = torch.randint(0, 3, (n, 2000), generator=g).to(dtype)
    copies = continuous.clone()
    copies[-max(1, n // 5) :] = copies[-1]
    eps = torch.finfo(dtype).eps
    for x in (continuous, few, copies):
        for lo, hi in {(0, n), (n // 2, n // 2 + 1), (n // 10, n - n // 10), (0, max(1, n - n // 5))}:
            for on_gpu in (x.cuda(), x.T.contiguous().T.cuda()):
                values, weights, norms = triton_windows.rank_window(on_gpu, lo, hi, method)
                assert not triton_windows.FAILURES
                want_values, want_weights = rank_window_by_sort(x, lo, hi)
                torch.testing.assert_close(values.cpu(), want_values, rtol=8 * n * eps, atol=8 * n * eps)
                torch.testing.assert_close(weights.cpu(), want_weights, rtol=16 * eps, atol=16 * eps)
                torch.testing.assert_close(norms.cpu(), row_norms(x), rtol=16 * eps, atol=0.0)
                routed = rank_window(on_gpu, lo, hi)  # the kernel of n's method_for, or the torch path
                torch.testing.assert_close(routed[0].cpu(), want_values, rtol=8 * n * eps, atol=8 * n * eps)
                torch.testing.assert_close(routed[1].cpu(), want_weights, rtol=16 * eps, atol=16 * eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("method", ["sort", "count", "select"])
def test_each_rank_window_kernel_orders_special_values_as_comparisons_do(method, dtype):
    """-0.0 and +0.0 as one value, an infinity, the largest exponents, subnormals, neighbours one ulp
    apart, in windows of one to four ranks and wide ones (float_specials): the bitcasts, the -0.0 fold
    and the unsigned comparisons of the select kernel on the hardware, and the other kernels' ties."""
    from fedtrust.aggregators import triton_windows
    from fedtrust.aggregators.rank_windows import rank_window_by_sort

    for n in (2, 5, 16, 33, 100):
        x = special_columns(dtype, n, d=3000)
        for lo, hi in windows(n):
            got = triton_windows.rank_window(x.cuda(), lo, hi, method)
            assert not triton_windows.FAILURES
            assert_window_agrees(got, rank_window_by_sort(x, lo, hi), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("n", "f"), [(7, 1), (11, 2), (100, 24)])
def test_the_bulyan_kernel_gives_the_cpus_values_to_the_bit(n, f, dtype):
    """Bulyan's second phase in one kernel does the CPU path's float64 arithmetic in its order: the same
    values to the bit, and the slot shares to the dtype's rounding, for continuous values, a few distinct
    ones and a block of copies among the selected clients."""
    from fedtrust.aggregators import triton_windows
    from fedtrust.aggregators.bulyan import closest_to_median

    g = torch.Generator().manual_seed(n)
    theta, beta = n - 2 * f, n - 4 * f
    selected = torch.randperm(n, generator=g)[:theta]
    continuous = torch.randn(n, 3000, generator=g, dtype=dtype)
    few = torch.randint(0, 3, (n, 3000), generator=g).to(dtype)
    copies = continuous.clone()
    copies[-(f + 1) :] = copies[-1]
    eps = torch.finfo(dtype).eps
    for x in (continuous, few, copies):
        values, weights = triton_windows.closest_to_median(x.cuda(), selected.cuda(), beta)
        assert not triton_windows.FAILURES
        want, slots = closest_to_median(x.numpy(), selected.sort().values.numpy(), beta)
        assert torch.equal(values.cpu(), torch.from_numpy(want))
        torch.testing.assert_close(
            weights.cpu(), torch.from_numpy(slots / slots.sum()).to(dtype), rtol=16 * eps, atol=16 * eps
        )
