"""A Round straight from the clients' torch models or state dicts, buffers included, in FlatModel's layout."""

import pytest
import torch

import fedtrust
from fedtrust.models import FlatModel


def bn_net(seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    net.train()
    net(torch.randn(8, 4))  # moves the running statistics and the integer counter
    return net


def test_models_and_state_dicts_give_flat_models_vectors_and_an_aggregate_loads_back():
    nets = [bn_net(s) for s in range(3)]
    flat = FlatModel(bn_net(9), "classification")
    by_module = fedtrust.Round.from_models(nets)
    by_state = fedtrust.Round.from_models([n.state_dict() for n in nets], client_ids=["a", "b", "c"])
    expected = torch.stack([torch.cat([n.state_dict()[k].reshape(-1) for k in flat.names]) for n in nets])
    assert torch.equal(by_module.updates, expected) and torch.equal(by_state.updates, expected)
    assert (
        by_state.client_ids == ("a", "b", "c") and by_module.d == flat.size
    )  # running stats in, counter out
    out = fedtrust.rule("median")(by_module)
    target = bn_net(9)
    counter = int(target[1].num_batches_tracked)
    target.load_state_dict(flat.state_dict(out.vector))
    torch.testing.assert_close(target[1].running_mean, flat.unflatten(out.vector)["1.running_mean"])
    means = torch.stack([flat.unflatten(v)["1.running_mean"] for v in expected])
    torch.testing.assert_close(target[1].running_mean, means.median(0).values)  # the clients' statistics
    assert int(target[1].num_batches_tracked) == counter  # integer buffers are not aggregated
    # with the global model: the deltas from it, and no ``previous`` (which marks rows that are models:
    # FLAME would measure the deltas from it a second time)
    deltas = fedtrust.Round.from_models(nets, previous=nets[0])
    assert torch.equal(deltas.updates[0], torch.zeros(flat.size)) and deltas.previous is None
    torch.testing.assert_close(deltas.updates[1], expected[1] - expected[0])


def test_a_model_that_does_not_match_is_refused_naming_it():
    nets = [bn_net(0), torch.nn.Linear(4, 2)]
    with pytest.raises(ValueError, match=r"models\[1\] has no entry '0.weight'"):
        fedtrust.Round.from_models(nets)
    with pytest.raises(
        ValueError, match=r"models\[1\]\['weight'\] has shape \(2, 5\), models\[0\]'s has \(2, 4\)"
    ):
        fedtrust.Round.from_models([torch.nn.Linear(4, 2), torch.nn.Linear(5, 2)])
    with pytest.raises(ValueError, match=r"models\[0\] must be a torch.nn.Module or a state dict"):
        fedtrust.Round.from_models([[1.0, 2.0]])
    with pytest.raises(ValueError, match="must be a non-empty list"):
        fedtrust.Round.from_models([])
    floats = torch.nn.Linear(4, 3).state_dict()
    ints = {k: v.long() for k, v in floats.items()}  # a cast would truncate every weight to 0
    with pytest.raises(ValueError, match=r"models\[1\]\['weight'\] holds torch.int64, models\[0\]'s floats"):
        fedtrust.Round.from_models([floats, ints, floats])
    with pytest.raises(ValueError, match=r"models\[0\] has no floating-point entries"):
        fedtrust.Round.from_models([ints, floats])


def test_flame_on_models_given_as_deltas_clips_the_deltas_once():
    # FLAME's bound S_t is the median distance of the clients' models from the global one: a round of
    # deltas from Round.from_models(previous=...) must give the same as the deltas passed directly
    torch.manual_seed(0)
    glob = torch.nn.Linear(6, 3)
    nets = [torch.nn.Linear(6, 3) for _ in range(7)]
    for net in nets:
        net.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in glob.state_dict().items()})
    flame = fedtrust.rule("flame", noise=0.0)
    by_models = flame(fedtrust.Round.from_models(nets, previous=glob))
    deltas = torch.stack([torch.cat([p.detach().reshape(-1) - q.detach().reshape(-1)
                                     for p, q in zip(n.parameters(), glob.parameters(), strict=True)])
                          for n in nets])  # fmt: skip
    direct = fedtrust.rule("flame", noise=0.0)(fedtrust.Round(updates=deltas))
    torch.testing.assert_close(by_models.vector, direct.vector)
    assert by_models.info["clip_bound"] == pytest.approx(float(deltas.norm(dim=1).median()), rel=1e-5)
