"""Backdoors do what their papers say: BadNets stamps a corner trigger and relabels, DBA splits the same
trigger among the attackers, model replacement boosts the poisoned update by n / eta, and the report's
attack success rate counts triggered non-target test images classified as the target."""

import pytest
import torch

from fedtrust.attacks import AttackContext, attack
from fedtrust.data.backdoor import Backdoor, DistributedBackdoor
from fedtrust.models import FlatModel
from fedtrust.sweeps.config import ConfigError, validate
from fedtrust.sweeps.runner import build_simulation


def test_badnets_stamps_the_bottom_right_square_and_relabels_only_the_poisoned_rows():
    b = Backdoor((1, 8, 8), target=3)  # size max(2, 8 // 7) = 2
    x, y = torch.rand(5, 64) * 0.5, torch.arange(5)
    bx, by = b(x, y, 10, torch.Generator())
    corner = {6 * 8 + 6, 6 * 8 + 7, 7 * 8 + 6, 7 * 8 + 7}
    assert set(torch.nonzero(b.mask()).squeeze(1).tolist()) == corner
    assert (bx[:, sorted(corner)] == 1.0).all() and torch.equal(by, torch.full((5,), 3))
    others = [i for i in range(64) if i not in corner]
    assert torch.equal(bx[:, others], x[:, others]) and (x[:, sorted(corner)] < 1).all()  # x untouched
    # three channels: the same square in each (CIFAR-10's 32x32: a 4-pixel square)
    rgb = Backdoor((3, 32, 32))
    assert rgb.size == 4 and int(rgb.mask().sum()) == 3 * 16


def test_dba_stripes_are_disjoint_and_make_up_the_global_trigger():
    dba = DistributedBackdoor((1, 28, 28), parts=4)  # size max(4, 28 // 7) = 4: one row each
    masks = [dba.mask(dba.stripe(p)) for p in range(4)]
    assert all(int(m.sum()) == 4 for m in masks)
    assert not any((masks[i] & masks[j]).any() for i in range(4) for j in range(i + 1, 4))
    assert torch.equal(masks[0] | masks[1] | masks[2] | masks[3], dba.mask())
    # called without a client rank, a stripe is drawn from the client's stream: replayed by the same stream
    x = torch.zeros(2, 784)
    one = dba(x, torch.zeros(2, dtype=torch.long), 10, torch.Generator().manual_seed(5))[0]
    again = dba(x, torch.zeros(2, dtype=torch.long), 10, torch.Generator().manual_seed(5))[0]
    assert torch.equal(one, again) and int((one[0] == 1).sum()) == 4


def test_dba_gives_the_ith_attacker_the_ith_stripe_so_together_they_stamp_the_whole_trigger():
    # Xie et al. 2020, Section 3: attacker i embeds local pattern i. Digits are 8x8: the trigger is the
    # bottom-right 4x4 square (size max(parts, 2, 8 // 7)), four stripes of one row each
    from fedtrust.data.corruptions import data_corruption
    from fedtrust.data.datasets import load_digits
    from fedtrust.data.partition import partitioner
    from fedtrust.sim.federation import build_federation

    digits = load_digits()
    dba = data_corruption("dba", input_shape=digits.input_shape, parts=4)
    fed = build_federation(digits, 10, partitioner("iid"), 0, dba, corrupted_fraction=0.8)
    stripes = [dba.mask(dba.stripe(p)) for p in range(4)]
    stamped = []
    for k in torch.nonzero(fed.corrupted).squeeze(1).tolist():
        x = fed.data[k][0]
        lit = [p for p, m in enumerate(stripes) if bool((x[:, m] == dba.value).all())]
        assert len(lit) == 1  # one stripe per attacker
        stamped.append(lit[0])
    assert stamped == [0, 1, 2, 3, 0, 1, 2, 3]  # in rank order: every stripe twice, none left out


def test_bad_backdoor_options_are_named():
    with pytest.raises(ValueError, match="needs images of shape"):
        Backdoor((13,))
    with pytest.raises(ValueError, match="size 9 does not fit"):
        Backdoor((1, 8, 8), size=9)
    with pytest.raises(ValueError, match=r"^corruption dba: parts 9 need a trigger of at least 9 rows, which "
                       r"does not fit in 8x8 images; give parts <= 8$"):  # fmt: skip
        DistributedBackdoor((1, 8, 8), parts=9)  # the user set parts, not size
    with pytest.raises(ValueError, match="size 9 does not fit"):
        DistributedBackdoor((1, 8, 8), size=9, parts=2)
    with pytest.raises(ValueError, match="target 12 is not a class"):
        Backdoor((1, 8, 8), target=12)(torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), 10, None)


def test_model_replacement_boosts_the_poisoned_update_by_n_over_eta():
    updates = torch.randn(10, 4)
    bad = torch.zeros(10, dtype=torch.bool)
    bad[:2] = True
    ctx = AttackContext(updates, bad, torch.zeros(4), "params", torch.Generator(), server_lr=0.5)
    torch.testing.assert_close(attack("model_replacement")(ctx), 20 * updates[:2])  # gamma = 10 / 0.5
    torch.testing.assert_close(attack("model_replacement", boost=3.0)(ctx), 3 * updates[:2])
    # eq 3 is one attacker's boost: k attackers that split it replace the model together, each
    # sending n / (eta k) times its update, and the mean moves the model by exactly their mean update
    split = attack("model_replacement", split=True)(ctx)
    torch.testing.assert_close(split, 10 * updates[:2])  # gamma = 10 / (0.5 * 2)
    step = 0.5 * (split.sum(0) + updates[2:].sum(0)) / 10  # eta * mean of what the server receives
    torch.testing.assert_close(step, updates[:2].mean(0) + 0.05 * updates[2:].sum(0))
    with pytest.raises(TypeError, match="split must be True or False, got 'yes'"):
        attack("model_replacement", split="yes")


def test_attack_success_rate_counts_triggered_non_target_images_classified_as_the_target():
    from fedtrust.sim.evaluation import BackdoorSuccess

    class Data:
        x_test = torch.rand(30, 64) * 0.5
        y_test = torch.arange(30) % 3
        num_classes = 3

    class Fed:
        dataset = Data

    linear = torch.nn.Linear(64, 3)
    model = FlatModel(linear, "classification")
    b = Backdoor((1, 8, 8), target=0)
    always_target = torch.cat([torch.zeros(3 * 64), torch.tensor([5.0, 0.0, 0.0])])
    assert BackdoorSuccess(model, Fed, b)(1, always_target)["backdoor_asr"] == 1.0
    # a model that reads only the trigger's pixels and answers class 0 when they are lit
    w = torch.zeros(3, 64)
    w[0, b.mask()] = 10.0
    reads_trigger = torch.cat([w.reshape(-1), torch.tensor([-30.0, 0.0, 0.0])])
    out = BackdoorSuccess(model, Fed, b)(1, reads_trigger)
    assert out["backdoor_asr"] == 1.0
    # and one that ignores it (answers class 1): no success, whatever the trigger
    ignores = torch.cat([torch.zeros(3 * 64), torch.tensor([0.0, 5.0, 0.0])])
    assert BackdoorSuccess(model, Fed, b)(1, ignores)["backdoor_asr"] == 0.0


def test_config_checks_the_backdoor_and_its_update_attack():
    ok = validate({"corruption": {"name": "backdoor", "fraction": 0.2, "samples": 0.5,
                                  "attack": {"name": "model_replacement"}}})  # fmt: skip
    assert ok.corruption.attack.name == "model_replacement"
    with pytest.raises(ConfigError, match="corruption.attack: .*'alie' is not a data corruption"):
        validate({"corruption": {"name": "alie", "fraction": 0.2, "attack": {"name": "model_replacement"}}})
    with pytest.raises(ConfigError, match="corruption: .*has no option 'sise'"):
        validate({"corruption": {"name": "backdoor", "sise": 3, "fraction": 0.2}})
    with pytest.raises(ConfigError, match="corruption.attack: unknown attack 'model_replace'"):
        validate({"corruption": {"name": "backdoor", "fraction": 0.2, "attack": {"name": "model_replace"}}})


def simulate(rule: str, corruption: dict) -> dict:
    cfg = validate({
        "data": {"name": "digits", "clients": 10},
        "model": {"name": "softmax"},
        "train": {"rounds": 10, "lr": 0.5, "batch_size": 32},
        "corruption": {"fraction": 0.2, "samples": 0.5, **corruption},
        "rule": {"name": rule},
    })  # fmt: skip
    return build_simulation(cfg).run()[-1]["metrics"]


def test_a_boosted_backdoor_takes_over_the_mean_but_not_the_median():
    boosted = {"name": "backdoor", "attack": {"name": "model_replacement"}}
    mean, median = simulate("mean", boosted), simulate("median", boosted)
    assert mean["backdoor_asr"] > 0.8 and median["backdoor_asr"] < 0.3
    assert median["accuracy"] > 0.8  # the median keeps the main task
    with pytest.raises(ValueError, match="needs images"):
        build_simulation(validate({"data": {"name": "synthetic_linear"}, "model": {"name": "linear"},
                                   "corruption": {"name": "backdoor", "fraction": 0.2}}))  # fmt: skip
