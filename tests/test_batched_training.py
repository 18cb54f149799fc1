"""The batched executor (all clients' local steps as one vmapped computation) gives the updates of the
per-client reference loop, for every model and mode."""

import pytest
import torch

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
