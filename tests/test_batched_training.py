"""The batched executor (all clients' local steps as one vmapped computation) gives the updates of the
per-client reference loop, for every model and mode."""

import pytest
import torch
from elsewhere import Elsewhere, elsewhere, on_host, to_elsewhere

from fedtrust.data import load_digits, synthetic_linear
from fedtrust.models import build_model
from fedtrust.sim import batched as executor
from fedtrust.sim.batched import Stacked, batched_local_sgd, batched_minibatch_gradients, mean_losses
from fedtrust.sim.training import local_sgd, mean_loss, minibatch_gradient
from fedtrust.sweeps.config import validate
from fedtrust.sweeps.runner import build_simulation

DIGITS = load_digits()


def clients(dataset, sizes, seed=0):
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    return [(dataset.x_train[rows], dataset.y_train[rows]) for rows in order[: sum(sizes)].split(sizes)]


CASES = [
    ("softmax", DIGITS, {}),
    ("mlp", DIGITS, {"hidden": [16, 8]}),
    ("cnn", DIGITS, {"channels": [4, 8], "hidden": 16}),
    ("linear", synthetic_linear(parties=3, samples=40), {}),
]


@pytest.mark.parametrize("group_bytes", [1 << 25, 1], ids=["one group", "a client a group"])
@pytest.mark.parametrize("name, dataset, options", CASES, ids=[c[0] for c in CASES])
def test_batched_local_sgd_matches_the_loop(name, dataset, options, group_bytes, monkeypatch):
    monkeypatch.setattr(executor, "GROUP_BYTES", group_bytes)
    model = build_model(name, dataset, **options)
    start = model.init(1)
    data = clients(dataset, [13, 40, 7, 0, 25])  # uneven sizes, a short last batch, an empty client
    gens = lambda: [torch.Generator().manual_seed(10 + k) for k in range(len(data))]  # noqa: E731
    loop = torch.stack(
        [local_sgd(model, start, x, y, 3, 8, 0.05, 1e-3, g) for (x, y), g in zip(data, gens(), strict=True)]
    )
    batched = batched_local_sgd(model, start, data, 3, 8, 0.05, 1e-3, gens())
    torch.testing.assert_close(batched, loop, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(batched[3], start)  # no data, no steps
    grads = torch.stack(
        [minibatch_gradient(model, start, x, y, 8, g) for (x, y), g in zip(data[:3], gens()[:3], strict=True)]
    )
    torch.testing.assert_close(
        batched_minibatch_gradients(model, start, data[:3], 8, gens()[:3]), grads, rtol=1e-4, atol=1e-6
    )
    losses = torch.tensor([mean_loss(model, start, x, y) for x, y in data[:3]])
    torch.testing.assert_close(mean_losses(model, start, data[:3]), losses, rtol=1e-5, atol=1e-6)
    # a round's clients picked from data stacked once (no copy) give the same as their own list
    stacked, picked = Stacked(data), [4, 0, 2]
    torch.testing.assert_close(
        mean_losses(model, start, stacked.select(picked)),
        mean_losses(model, start, [data[k] for k in picked]),
    )
    torch.testing.assert_close(
        batched_local_sgd(
            model, start, stacked.select(picked), 3, 8, 0.05, 1e-3, [gens()[k] for k in picked]
        ),
        batched[picked],
    )


@pytest.mark.parametrize("mode", ["params", "gradient", "one_round"])
def test_simulations_agree_between_executors(mode):
    def run(executor):
        cfg = validate({"name": "e", "data": {"name": "digits", "clients": 6}, "model": {"name": "mlp", "hidden": 16},
                        "train": {"mode": mode, "rounds": 4, "lr": 0.3, "executor": executor, "fraction": 0.7,
                                  "report_loss": "always"},
                        "corruption": {"name": "label_flip", "fraction": 0.34}, "rule": {"name": "median"}})  # fmt: skip
        return build_simulation(cfg).run()

    loop, batched = run("loop"), run("batched")
    for a, b in zip(loop, batched, strict=True):
        assert a["clients"] == b["clients"]
        assert a["metrics"]["accuracy"] == pytest.approx(b["metrics"]["accuracy"], abs=0.01)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)


def test_a_batch_size_above_every_clients_rows_trains_on_whole_shares_without_buffers_that_size():
    """batch_size 1e7 on shares of 13, 40 and 7 rows is one batch of each share a step: the same as
    batch_size 40, and the step plan (and the gathered batches) are 40 wide, not 1e7 (a hostile-input
    review: 1.3 GB of buffers at 300000, an allocation error at 1e8)."""
    model = build_model("softmax", DIGITS)
    start, data = model.init(1), clients(DIGITS, [13, 40, 7])
    gens = lambda: [torch.Generator().manual_seed(10 + k) for k in range(len(data))]  # noqa: E731
    steps = [
        [rows for rows in executor.batches(len(y), 10**7, g)] for (_, y), g in zip(data, gens(), strict=True)
    ]
    index, mask = executor._step_plan(Stacked.of(data), steps, 10**7)
    assert index.shape == mask.shape == (3, 1, 40)
    torch.testing.assert_close(
        batched_local_sgd(model, start, data, 2, 10**7, 0.05, 0.0, gens()),
        batched_local_sgd(model, start, data, 2, 40, 0.05, 0.0, gens()),
        rtol=0,
        atol=0,
    )


def test_a_device_trains_every_client_at_once_where_the_cpu_groups_them(monkeypatch):
    """The CPU keeps a group's parameter copies within GROUP_BYTES (its caches); on a device (a GPU) a
    group is kernels as wide as the group, so all clients train at once: a 100-client round of the
    Fashion-MNIST CNN (215K parameters, 86 MB of copies) took 3 groups there by the CPU's bound."""
    assert executor.group_size(100, 215_370 * 4, torch.device("cpu")) == 34
    assert executor.group_size(100, 215_370 * 4, torch.device("cuda")) == 100
    assert executor.group_size(100, 10, torch.device("cpu")) == 100
    assert executor.group_size(0, 10, torch.device("cuda")) == 1
    # the executor asks for the device of the start: on the emulated device one group, the CPU's result
    monkeypatch.setattr(executor, "GROUP_BYTES", 1)  # the CPU: a client a group
    model = build_model("mlp", DIGITS, hidden=[16, 8])
    start, data = model.init(1), clients(DIGITS, [13, 40, 7, 25])
    gens = lambda: [torch.Generator().manual_seed(10 + k) for k in range(len(data))]  # noqa: E731
    steps, groups = executor._sgd_steps, []
    monkeypatch.setattr(executor, "_sgd_steps", lambda *a: groups.append(len(a[3])) or steps(*a))
    on_cpu = batched_local_sgd(model, start, data, 2, 8, 0.05, 0.0, gens())
    assert groups == [1, 1, 1, 1]
    groups.clear()
    with elsewhere():
        there = batched_local_sgd(model, to_elsewhere(start), to_elsewhere(data), 2, 8, 0.05, 0.0, gens())
    assert groups == [4] and isinstance(there, Elsewhere)
    torch.testing.assert_close(on_host(there), on_cpu, rtol=1e-5, atol=1e-7)


def test_a_group_the_memory_cannot_hold_is_trained_again_in_halves(monkeypatch):
    """A group whose steps run out of memory (CUDA's OutOfMemoryError, or the RuntimeError of MPS or the
    CPU's allocator) is trained again in halves of its own width, with the updates of an undisturbed
    call to float rounding (a group's steps depend on the start and its step plan alone); the next call
    starts whole again (a transient shortage leaves no trace), one client that cannot fit raises, and
    an error that is not about memory is not retried."""
    model = build_model("mlp", DIGITS, hidden=[16, 8])
    start, data = model.init(1), clients(DIGITS, [13, 40, 7, 0, 25, 9, 11])
    gens = lambda: [torch.Generator().manual_seed(10 + k) for k in range(len(data))]  # noqa: E731
    whole = batched_local_sgd(model, start, data, 2, 8, 0.05, 1e-3, gens())
    steps, tried = executor._sgd_steps, []

    cuda = torch.OutOfMemoryError("emulated: CUDA out of memory")

    def holds(fits, error=cuda):
        def sgd_steps(model, start, stacked, index, *rest):
            tried.append(len(index))
            if not fits(len(index)):
                raise error
            return steps(model, start, stacked, index, *rest)

        tried.clear()
        monkeypatch.setattr(executor, "_sgd_steps", sgd_steps)

    cpu_allocator = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes")
    for error in (cuda, cpu_allocator):
        holds(lambda width: width <= 2, error)
        halved = batched_local_sgd(model, start, data, 2, 8, 0.05, 1e-3, gens())
        assert tried == [7, 4, 2, 2, 2, 1]  # 7 -> 4 -> 2 clients a group: 2 + 2 + 2 + 1
        torch.testing.assert_close(halved, whole, rtol=1e-5, atol=1e-7)
    holds(lambda width: True)
    batched_local_sgd(model, start, data, 2, 8, 0.05, 1e-3, gens())
    assert tried == [7]  # whole again
    monkeypatch.setattr(executor, "group_size", lambda *_: 3)
    holds(lambda width: width != 2)  # 5 clients in groups of 3 + 2: the short last group fails
    batched_local_sgd(model, start, data[:5], 2, 8, 0.05, 1e-3, gens()[:5])
    assert tried == [3, 2, 1, 1]  # halved from 2, not from 3
    holds(lambda width: False)
    with pytest.raises(torch.OutOfMemoryError):
        batched_local_sgd(model, start, data, 2, 8, 0.05, 1e-3, gens())
    holds(lambda width: width <= 2, RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        batched_local_sgd(model, start, data, 2, 8, 0.05, 1e-3, gens())
    assert tried == [3]
