"""Configs: a wrong key or value is reported with its path and the valid choices; sweeps expand to the
Cartesian product; a sweep's runs are validated one by one."""

import re

import pytest
import yaml

from fedtrust.sweeps.config import ConfigError, expand, load, validate


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"trian": {}},
            r"trian: unknown key 'trian'; valid keys here: name, seed, data, model, train, corruption, rule, sweep",
        ),
        (
            {"train": {"epochs": 3}},
            r"train.epochs: unknown key 'epochs'; valid keys here: mode, rounds, fraction, local_epochs",
        ),
        ({"train": {"rounds": 0}}, r"train.rounds: Input should be greater than or equal to 1 \(got 0\)"),
        (
            {"train": {"fraction": 1.5}},
            r"train.fraction: Input should be less than or equal to 1 \(got 1.5\)",
        ),
        (
            {"train": {"mode": "fedprox"}},
            r"train.mode: Input should be 'params', 'gradient' or 'one_round' \(got 'fedprox'\)",
        ),
        ({"train": {"lr": "fast"}}, r"train.lr: Input should be a valid number"),
        (
            {"train": {"rounds": True}},
            r"train.rounds: must be a number, not true or false \(got True\)",
        ),
        (
            {"rule": {"name": "fltrust"}},
            r"rule: fltrust reads the server's benchmark split \(Round.reference: update\), but data.benchmark is 0",
        ),
        (
            {"train": {"mode": "one_round", "server_lr": 0.5}},
            r"train: server_lr 0.5 has no effect in one_round mode",
        ),
        (
            {"corruption": {"fraction": 2}},
            r"corruption.fraction: Input should be less than or equal to 1 \(got 2\)",
        ),
        (
            {"corruption": {"lie": {"metric": "x", "valu": 1}}},
            r"corruption.lie.valu: unknown key 'valu'; valid keys here: metric, value",
        ),
        (  # (the front door quarantines a loss below 0: the experiment would not measure the lie)
            {"corruption": {"lie": {"value": -1.0}}},
            r"corruption.lie.value: Input should be greater than or equal to 0 \(got -1.0\)",
        ),
        # a Byzantine budget no round of the config can meet: refused before any client trains
        (
            {"data": {"clients": 10}, "rule": {"name": "krum", "f": 50}},
            r"rule: krum: needs n > 2f \+ 2 clients, got n=10 with f=50; this config's rounds have 10 "
            r"\(data.clients 10\)$",
        ),
        (  # FedAG's base rule's budget too
            {"data": {"clients": 4}, "rule": {"name": "fedag", "base": "krum", "base_options": {"f": 3}}},
            r"rule: krum: needs n > 2f \+ 2 clients, got n=4 with f=3; this config's rounds have 4",
        ),
        (
            {"data": {"clients": 100}, "train": {"fraction": 0.2}, "rule": {"name": "bulyan", "f": 5}},
            r"rule: bulyan: needs n >= 4f \+ 3 clients, got n=20 with f=5; this config's rounds have 20 "
            r"\(data.clients 100 x train.fraction 0.2\)$",
        ),
        (
            {
                "data": {"clients": 8},
                "corruption": {"name": "ipm", "added": 2},
                "rule": {"name": "bucketing+krum", "f": 2},
            },
            r"rule: bucketing\+krum: krum: needs n > 2f \+ 2 clients, got n=5 with f=2; this config's rounds "
            r"have 10 \(data.clients 8 \+ corruption.added 2\)$",
        ),
        (
            {"data": {"clients": 6}, "rule": {"name": "nnm+median", "f": 3}},
            r"rule: nnm\+median: nnm: needs n > 2f",
        ),
        (
            {"data": {"clients": 6}, "rule": {"name": "dnc", "f": 3, "c": 2.0}},
            r"rule: dnc: needs n > c f clients",
        ),
        (
            {"data": {"clients": 6}, "rule": {"name": "trimmed_mean", "f": 3}},
            r"rule: trimmed_mean: needs n > 2f",
        ),
        (
            {"data": {"benchmark": 1.5}},
            r"data.benchmark: a share must be < 1 \(an int counts rows\), got 1.5$",
        ),
        ({"name": "a b"}, r"name: use letters, digits"),
        (
            {"rule": {"name": "krumm"}},
            r"rule: unknown rule 'krumm'. Did you mean 'krum'\? Valid rules: mean, fedavg",
        ),
        ({"rule": {"name": "krum", "f": -2}}, r"rule: krum: f must be >= 0, got -2"),
        (
            {"rule": {"name": "krum", "g": 1}},
            r"rule: rule 'krum' has no option 'g'; its options: f \(default 0\)",
        ),
        (
            {"data": {"name": "mnist"}},
            r"data: unknown dataset 'mnist'. Valid datasets: digits, fashion_mnist, idx",
        ),
        (
            {"data": {"name": "digits", "folds": 3}},
            r"data: dataset 'digits' has no option 'folds'; its options: test_fraction",
        ),
        # a dataset's required options are asked for with the config, not met as a TypeError in every run
        ({"data": {"name": "csv"}}, r"data: dataset 'csv' needs options path, target$"),
        ({"data": {"name": "idx"}}, r"data: dataset 'idx' needs option directory$"),
        (
            {"data": {"partition": {"name": "dirichlet", "alpha": 0}}},
            r"data.partition: partition dirichlet: alpha must be > 0.0, got 0",
        ),
        (
            {"data": {"partition": {"name": "pathological"}}},
            r"data.partition: unknown partition 'pathological'. Valid partitions: iid, dirichlet",
        ),
        (
            {"model": {"name": "mlp", "width": 3}},
            r"model: model 'mlp' has no option 'width'; its options: hidden \(default 200\)",
        ),
        (
            {"corruption": {"name": "label_flop"}},
            r"corruption: unknown corruption 'label_flop'. Did you mean 'label_flip'\?",
        ),
        (
            {"corruption": {"name": "alie", "z": "big"}},
            r"corruption: attack alie: z must be a number, got 'big'",
        ),
        ({"corruption": {"name": "none", "std": 1}}, r"corruption: 'none' takes no options, got \['std'\]"),
        ([1, 2], r"a config must be a mapping of keys, got list"),
        (
            {"data": {"clients": 6}, "corruption": {"name": "sign_flip", "fraction": 0.05}},
            r"corruption.fraction: 0.05 of 6 clients rounds to no corrupted client; give at least 0.0834",
        ),
        (
            {"corruption": {"name": "label_flip", "fraction": 0.2, "lie": {"metric": "train_los"}}},
            r"corruption.lie.metric: Input should be 'train_loss' \(got 'train_los'\)",
        ),
    ],
)
def test_bad_configs_name_the_path_and_the_valid_choices(raw, message):
    with pytest.raises(ConfigError, match=message) as refused:
        validate(raw)
    assert "Value error" not in str(refused.value)  # pydantic's prefix, not the user's business


def test_a_byzantine_budget_the_rounds_can_meet_is_accepted():
    """The check reads the clients a round samples: f = 3 suits Krum on 10 (n > 2f + 2), f = 2 Bulyan on
    11 (n >= 4f + 3), a fraction resolves against the round's clients, and f left to the round (NNM's
    None) needs nothing."""
    for raw in [
        {"data": {"clients": 10}, "rule": {"name": "krum", "f": 3}},
        {
            "data": {"clients": 10},
            "corruption": {"name": "ipm", "added": 1},
            "rule": {"name": "bulyan", "f": 2},
        },
        {"data": {"clients": 100}, "train": {"fraction": 0.2}, "rule": {"name": "multi_krum", "f": 0.4}},
        {"data": {"clients": 4}, "rule": {"name": "nnm+median"}},
    ]:
        validate(raw)


def test_an_empty_config_or_sweep_list_is_refused_not_run_as_the_default(tmp_path):
    from fedtrust.sweeps.config import load

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty.yaml is empty"):
        load(empty)
    with pytest.raises(ConfigError, match=r"sweep.seed: an empty list would make no runs"):
        expand(validate({"name": "s", "sweep": {"seed": []}}))


def test_sweep_is_the_cartesian_product_with_readable_labels():
    cfg = validate(
        {
            "name": "s",
            "sweep": {
                "rule": [{"name": "fedavg"}, {"name": "multi_krum", "f": 0.3}],
                "corruption.name": ["label_flip", "label_shuffle"],
                "corruption.fraction": [0.3, 0.5],
                "seed": [0, 1, 2],
            },
        }
    )
    runs = expand(cfg)
    assert len(runs) == 2 * 2 * 2 * 3
    labels = [label for label, _ in runs]
    assert labels[0] == "rule=fedavg_corruption=label_flip_corruption.fraction=0.3_seed=0"
    assert "rule=multi_krum,f=0.3_corruption=label_shuffle_corruption.fraction=0.5_seed=2" in labels
    last = runs[-1][1]
    assert last.rule.name == "multi_krum" and last.rule.options == {"f": 0.3} and last.seed == 2


def test_a_plus_key_sets_several_paths_together():
    cfg = validate(
        {
            "name": "s",
            "sweep": {"rule.name": ["median", "krum"], "seed+data.test_fraction": [[0, 0.2], [1, 0.3]]},
        }
    )
    runs = expand(cfg)
    assert [label for label, _ in runs][:2] == [
        "rule=median_seed=0_data.test_fraction=0.2",
        "rule=median_seed=1_data.test_fraction=0.3",
    ]
    assert (
        expand(validate({"name": "s", "sweep": {"seed+data.seed": [[0, 0], [1, 1]]}}))[1][0] == "seed=1"
    )  # a dataset seed repeats the seed
    assert [(c.seed, c.data.options["test_fraction"]) for _, c in runs] == [
        (0, 0.2),
        (1, 0.3),
        (0, 0.2),
        (1, 0.3),
    ]
    with pytest.raises(
        ConfigError, match=r"sweep.seed\+data.seed\[0\]: needs 2 values \(one per path\), got 3"
    ):
        expand(validate({"name": "s", "sweep": {"seed+data.seed": [3]}}))


def test_a_bad_value_inside_a_sweep_names_the_run():
    cfg = validate({"name": "s", "sweep": {"rule.name": ["median", "krumm"]}})
    with pytest.raises(ConfigError, match=r"sweep run rule=krumm: rule: unknown rule 'krumm'"):
        expand(cfg)


def test_sweeping_a_name_with_dicts_is_refused():
    cfg = validate({"name": "s", "sweep": {"rule.name": [{"name": "krum"}]}})
    with pytest.raises(
        ConfigError, match=r"sweep.rule.name: values are names; sweep the section \(rule\) for dicts"
    ):
        expand(cfg)


def test_load_reads_yaml_and_reports_the_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "rule": {"name": "median"}, "sweep": {"seed": [0, 1]}}))
    assert load(path).rule.name == "median"
    path.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match=r"exp.yaml: not valid YAML"):
        load(path)
    path.write_text("name: x\nsweep: {rule.name: [nope]}\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: sweep run rule=nope: rule: unknown rule 'nope'"):
        load(path)
    with pytest.raises(ConfigError, match=r"config file .*missing.yaml does not exist"):
        load(tmp_path / "missing.yaml")


def test_set_overrides_a_value_before_validation(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("name: x\ndata: {name: fashion_mnist}\n")
    assert load(path, ["data.name=digits", "train.rounds=7"]).data.name == "digits"
    with pytest.raises(
        ConfigError, match=r"train.rounds: Input should be greater than or equal to 1 \(got 0\)"
    ):
        load(path, ["train.rounds=0"])
    with pytest.raises(ConfigError, match=r"--set expects path=value, got 'rounds'"):
        load(path, ["rounds"])


def test_the_committed_example_configs_are_valid():
    from pathlib import Path

    configs = sorted(Path(__file__).parent.parent.glob("experiments/**/*.yaml"))
    assert configs, "no example configs found"
    for path in configs:
        cfg = load(path)
        assert expand(cfg)


def test_a_component_on_one_line_reads_its_options_as_yaml():
    from fedtrust.registry import parse_spec

    assert parse_spec("median") == ("median", {})
    assert parse_spec("ivar_mle(weighting=screen)") == ("ivar_mle", {"weighting": "screen"})
    assert parse_spec(" backdoor(target=3, samples=0.5, split=true) ") == (
        "backdoor",
        {"target": 3, "samples": 0.5, "split": True},
    )
    with pytest.raises(ValueError, match=r"'dba\(parts=2': options go in parentheses"):
        parse_spec("dba(parts=2")
    with pytest.raises(ValueError, match="option 'parts' is not of the form key=value"):
        parse_spec("dba(parts)")


def test_exponents_keep_their_sign_in_run_labels():
    cfg = validate({"name": "t", "corruption": {"name": "crash", "fraction": 0.2},
                           "sweep": {"corruption.value": [1.0e20, 1.0e-20]}})  # fmt: skip
    assert [label for label, _ in expand(cfg)] == ["corruption.value=1e20", "corruption.value=1e-20"]


def test_numbers_in_exponent_form_are_numbers_in_configs_and_overrides(tmp_path):
    """PyYAML reads 1e-6 as a string (YAML 1.1); fedtrust reads it as YAML 1.2 does, a number."""
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nrule: {name: geometric_median, nu: 1e-6}\ntrain: {lr: 5E-1}\n")
    cfg = load(path, ["rule.tol=1e-9"])
    assert cfg.rule.options["nu"] == 1e-6 and cfg.rule.options["tol"] == 1e-9 and cfg.train.lr == 0.5


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    """YAML forbids it and PyYAML keeps the last silently: a second train section would drop the first's
    learning rate; a repeated sweep key would run only its last list."""
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ntrain: {rounds: 2, lr: 0.5}\nrule: {name: median}\ntrain: {rounds: 3}\n")
    with pytest.raises(
        ConfigError, match=r"(?s)c.yaml: not valid YAML .*key 'train' given twice \(first on line 2\)"
    ):
        load(path)
    path.write_text("name: t\nsweep: {seed: [0, 1], seed: [5]}\n")
    with pytest.raises(ConfigError, match=r"key 'seed' given twice"):
        load(path)


def test_only_true_and_false_are_booleans_as_in_yaml_1_2(tmp_path):
    """YAML 1.1 reads off/on/yes/no as booleans: sybils: off would be False, refused as not 'off'."""
    from fedtrust.registry import yaml_value

    assert yaml_value("[off, on, yes, no, true, False]") == ["off", "on", "yes", "no", True, False]
    path = tmp_path / "c.yaml"
    path.write_text("name: t\nrule: {name: ivar_mle, sybils: off}\n")
    cfg = load(path, ["name=no"])
    assert cfg.rule.options["sybils"] == "off" and cfg.name == "no"


def test_integers_are_read_as_yaml_1_2_reads_them(tmp_path):
    """YAML 1.1 read seed: 010 as octal 8 (sweep folders seed=8, seed=9 for [010, 011]) and rounds: 1:30 as
    sexagesimal 90; YAML 1.2 reads 10, and 1:30 and 1_000 are strings, refused as not integers."""
    from fedtrust.registry import yaml_value

    numbers = [10, 11, 15, 31, -5, "1:30", "1_000", "0b11"]
    assert yaml_value("[010, 011, 0o17, 0x1F, -5, 1:30, 1_000, 0b11]") == numbers
    assert yaml_value("[.5e3, -.5e-3, 1., 1e5, 2.5]") == [500.0, -0.0005, 1.0, 1e5, 2.5]  # floats as before
    path = tmp_path / "long.yaml"
    path.write_text("name: t\nseed: 0" + "0" * 5000 + "1\n")  # (Python's bare digit-limit ValueError)
    with pytest.raises(ConfigError, match=r"long.yaml.*integer 0000.*Exceeds the limit \(4300 digits\)"):
        load(path)
    path = tmp_path / "c.yaml"
    path.write_text("name: t\ntrain: {rounds: 1}\nsweep: {seed: [010, 011]}\n")
    assert [label for label, _ in expand(load(path))] == ["seed=10", "seed=11"]
    path.write_text("name: t\ntrain: {rounds: 1:30}\n")
    with pytest.raises(ConfigError, match=r"train.rounds: Input should be a valid integer.*got '1:30'"):
        load(path)


def test_a_value_in_an_error_message_is_cut_short(tmp_path):
    """Six lines of nested YAML aliases as seed: gave a 3.85 MB error message (ninefold a level more)."""
    lines = ["  - &a1 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"  - &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(2, 7)]
    path = tmp_path / "bomb.yaml"
    path.write_text("name: bomb\ndefs:\n" + "\n".join(lines) + "\nseed: *a6\n")
    with pytest.raises(ConfigError, match=r"seed: Input should be a valid integer \(got \[\[\[") as caught:
        load(path)
    assert len(str(caught.value)) < 2000


def test_a_sweep_refuses_paths_that_set_each_other(tmp_path):
    """sweep: {train.rounds: [1, 2], train: [{rounds: 3}]} ran 3 rounds in both runs, whose folders said 1
    and 2; a swept 'sweep' key was a run of its own. Both are refused, naming the paths."""
    path = tmp_path / "c.yaml"
    for sweep, message in [
        ("{train.rounds: [1, 2], train: [{rounds: 3}]}", "train.rounds and train are swept both"),
        ("{rule: [{name: mean}], rule.name: [median]}", "rule and rule.name are swept both"),
        ("{seed+train.rounds: [[0, 1]], train.rounds: [2]}", "train.rounds and train.rounds are swept both"),
        ("{sweep: [{train.rounds: [1, 2]}]}", "sweep.sweep: a sweep cannot sweep the sweep"),
    ]:
        path.write_text(f"name: t\nsweep: {sweep}\n")
        with pytest.raises(ConfigError, match=re.escape(message)):
            load(path)


def test_set_refuses_a_path_the_sweep_sets(tmp_path):
    """The sweep sets its paths in every run, over any --set: refused rather than silently ignored (a
    section above a swept path or a path below one alike); the sweep's own list can be set."""
    path = tmp_path / "sw.yaml"
    path.write_text("name: t\nrule: {name: median}\nsweep: {seed: [0, 1], rule.name: [median, mean]}\n")
    for item in ["seed=5", "rule.name=krum", "rule={name: krum}"]:
        with pytest.raises(ConfigError, match=r"sw.yaml sweeps (seed|rule.name), which sets it in every run"):
            load(path, [item])
    assert [cfg.seed for _, cfg in expand(load(path, ["sweep.seed=[5]"]))] == [5, 5]


def test_a_folder_or_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .* is a folder; give the YAML file"):
        load(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: t\xff\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(byte 7 is 0xff\)"):
        load(path)


@pytest.mark.parametrize(
    "block, message",
    [
        (
            {"model": {"name": "mlp", "hidden": -5}},
            r"seed=0: model: model mlp: hidden\[0\] must be >= 1, got -5",
        ),
        ({"corruption": {"name": "dba", "parts": 100, "fraction": 0.5}}, r"seed=0: corruption: .*parts 100"),
        (
            {"corruption": {"name": "label_flip", "target": 99, "fraction": 0.5}},
            r"seed=0: corruption: corruption label_flip: target 99 is not a class \(0..9\)",
        ),
        (
            {"data": {"name": "digits", "clients": 4, "test_fraction": 0.001}},
            r"seed=0: data: test_fraction 0.001 of 1797 rows leaves 1795 training and 2 test rows; the split "
            r"is stratified .* \(nothing was run\)$",
        ),
        (
            {
                "data": {"name": "synthetic_linear", "clients": 3, "noise": [1, 2]},
                "model": {"name": "linear"},
            },
            r"seed=0: data: synthetic_linear: noise needs one level per party \(5\), got 2",
        ),
        (  # FLTrust refused every round of a run that "finished": the share was no row of 1347
            {"data": {"name": "digits", "clients": 4, "benchmark": 1e-5}, "rule": {"name": "fltrust"}},
            r"seed=0: data.benchmark: a share of 1e-05 of the 1347 training rows is no row; ask for at least "
            r"one \(an int counts rows\) \(nothing was run\)$",
        ),
        (
            {"data": {"name": "digits", "clients": 4, "benchmark": 1347}, "rule": {"name": "fltrust"}},
            r"seed=0: data.benchmark: 1347 rows would leave no training data \(of 1347\)",
        ),
    ],
)
def test_option_values_only_the_data_can_check_are_refused_before_any_run(tmp_path, block, message):
    """The config check knows a model's and a data corruption's option names but not whether -5 hidden
    units or a 100-part trigger in 8x8 images fit, nor whether a test split of 0.1% leaves a row of each
    class to stratify: swept over three seeds, the run failed three times, one run after another. Now the
    sweep is refused once, naming the run and the field, and nothing is written."""
    from fedtrust.sweeps.runner import run_experiment

    cfg = validate({"name": "bad", "data": {"name": "digits", "clients": 4}, "train": {"rounds": 1},
                    "sweep": {"seed": [0, 1, 2]}, **block})  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        run_experiment(cfg, tmp_path, progress=False)
    assert not (tmp_path / "bad").exists()


def test_a_swept_section_without_a_name_is_labelled_by_its_options(tmp_path):
    """corruption.lie swept over [null, {metric: train_loss, value: 0.0}]: the report's columns read
    'corruption.lie=None' and 'corruption.lie=metric=train_loss, value=0.0', not an empty label that
    hides what the column is."""
    from fedtrust.report.results import Run, options_that_differ

    runs = [
        Run(tmp_path / str(k), {"swept": {"rule": {"name": "arfl"}, "corruption.lie": lie, "seed": 0}}, [])
        for k, lie in enumerate([None, {"metric": "train_loss", "value": 0.0}])
    ]
    options_that_differ(runs)
    assert [r.setting for r in runs] == ["corruption.lie=None", "corruption.lie=metric=train_loss, value=0.0"]
