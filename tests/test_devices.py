"""Every rule on a device that is not the CPU (issue 20), checked without a GPU: the emulated device of
``elsewhere.py`` fails any operation that mixes it with CPU tensors, as CUDA does. A rule must take the
round there, compute there and return its aggregate and weights there, in the round's dtype, equal to
its CPU result to float rounding, across rounds (stateful rules keep their state between them)."""

import math

import pytest
import torch
from conftest import dtype_tol
from elsewhere import DEVICE, Elsewhere, elsewhere, on_host, to_elsewhere
from test_rule_properties import ALL, OPTIONS, make, random_round

import fedtrust.inference as inference
from fedtrust import Round, rule
from fedtrust.aggregators.state import copy_tree
from fedtrust.attacks import ATTACKS, AttackContext, attack
from fedtrust.probabilistic.posterior import fit_posterior

#: options that take a rule down its other paths (the loss defences read the server's benchmark)
VARIANTS = {
    "arfl": [{"defence": "benchmark"}],
    "focus": [{"defence": "benchmark"}, {"sybils": "off"}],
    "ivar_mle": [{"sybils": "off"}, {"weighting": "screen"}],
    "icov_vb": [{"sybils": "off"}, {"weighting": "screen"}],
}
CASES = [(name, {}) for name in ALL] + [(name, o) for name, opts in VARIANTS.items() for o in opts]


def there(r: Round, reports_on_host: bool = False) -> Round:
    """The same round on the emulated device (call under ``elsewhere()``); with ``reports_on_host`` the
    clients' counts and metrics are given on the host, as a server receives them (the simulator's and the
    Flower strategy's rounds)."""
    reported = (lambda t: t) if reports_on_host else to_elsewhere
    return Round(
        updates=to_elsewhere(r.updates),
        client_ids=r.client_ids,
        num_samples=reported(r.num_samples),
        metrics=reported(dict(r.metrics)),
        reference=r.reference,
        previous=None if r.previous is None else to_elsewhere(r.previous),
    )


def rounds(dtype, copies: bool = False):
    """Three rounds of one federation; the last with a group of three sending one vector (the sybil
    grouping's path) when ``copies``."""
    for seed in range(3):
        r = random_round(seed, dtype=dtype, previous=True)
        if copies and seed == 2:
            x = r.updates.clone()
            x[-3:] = x[-1]
            r = Round(x, r.client_ids, r.num_samples, r.metrics, r.reference, r.previous)
        yield r


def build(name, options):
    return rule(name, **{**OPTIONS.get(name, {}), **options})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("name", "options"), CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_rule_computes_on_the_rounds_device(name, options, dtype):
    on_cpu, on_device = build(name, options), build(name, options)
    for r in rounds(dtype, copies=True):
        expected = on_cpu(r)
        with elsewhere():
            out = on_device(there(r))
        assert isinstance(out.vector, Elsewhere) and isinstance(out.weights, Elsewhere)
        assert out.vector.dtype == dtype and out.weights.dtype == dtype
        # float64 rules iterate to a stopping rule: the device's torch path may stop a step apart
        tol = dtype_tol(dtype, factor=1e3 if name.startswith("icov") else 10.0)
        torch.testing.assert_close(on_host(out.vector), expected.vector, **tol)
        torch.testing.assert_close(on_host(out.weights), expected.weights, **tol)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"updates": torch.ones(4, 3, device="meta")}, "updates"),
        ({"updates": torch.ones(4, 3), "num_samples": torch.ones(4, device="meta")}, "num_samples"),
        ({"updates": torch.ones(4, 3), "metrics": {"train_loss": torch.ones(4, device="meta")}}, "metrics"),
    ],
)
def test_a_meta_tensor_holds_no_values_and_is_refused_naming_its_field(fields, field):
    """A plain meta tensor has a shape and no data (the emulated device above presents CPU data as meta):
    a rule on one failed inside torch ("Tensor.item() cannot be called on meta tensors"), and counts on
    meta beside CPU updates with "Cannot copy out of meta tensor"."""
    with pytest.raises(ValueError, match=rf"^Round.{field}.* is a meta tensor: it has a shape \(4.*\) but no "
                       r"values to read; give the tensor with its data \(on the CPU or a GPU\)$"):  # fmt: skip
        rule("mean")(Round(**fields))


@pytest.mark.parametrize("name", ALL)
def test_rule_takes_non_contiguous_float32_updates(name):
    """A transposed view (clients along columns in memory) gives the contiguous result."""
    r = random_round(5, dtype=torch.float32, previous=True)
    strided = r.updates.T.contiguous().T
    assert not strided.is_contiguous()
    a = make(name)(r)
    b = make(name)(Round(strided, r.client_ids, r.num_samples, r.metrics, r.reference, r.previous))
    torch.testing.assert_close(b.vector, a.vector, **dtype_tol(torch.float32, factor=10.0))
    torch.testing.assert_close(b.weights, a.weights, **dtype_tol(torch.float32, factor=10.0))


def test_the_emulated_device_catches_a_mix_as_cuda_would():
    """The harness itself: a CPU tensor of one or more dimensions mixed into the device's computation
    fails; 0-dim CPU scalars and CPU index tensors pass, as on CUDA; scalars read are counted."""
    x = to_elsewhere(torch.ones(4, 3))
    with elsewhere() as host:
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.ones(3)
        assert isinstance(x * torch.tensor(2.0), Elsewhere)
        assert isinstance(x[torch.tensor([0, 2])], Elsewhere)
        assert isinstance(torch.zeros(2, device=x.device), Elsewhere)
        assert isinstance(torch.tensor([1.0, 2.0], device=x.device), Elsewhere)
        assert float(x.sum()) == 12.0 and x.tolist()[0] == [1.0, 1.0, 1.0]
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
    assert host.syncs == 2


@pytest.mark.parametrize(
    ("name", "transfers"),
    [
        ("geometric_median", lambda out: out.info["iterations"] + 1),  # one per fused pass
        ("centered_clipping", lambda out: 1),
        ("krum", lambda out: 1),  # the Gram matrix
        ("multi_krum", lambda out: 1),
        ("cfl", lambda out: 2),  # the screen's norms, the Gram matrix
        ("foolsgold", lambda out: 2),  # the screen's norms, the histories' Gram matrix
        ("flame", lambda out: 2),  # the screen's norms, the distances and norms
        ("norm_bounding", lambda out: 1),  # the screen's norms, which the rule reads too
        ("dnc", lambda out: 1 + 2 * 5),  # the screen's norms; per iteration a Gram matrix and the scores
    ],
)
def test_per_client_arithmetic_runs_on_the_host_one_transfer_a_pass(name, transfers):
    """Weiszfeld steps, clip factors, Krum scores, CFL's bipartition, FoolsGold's similarities, FLAME's
    clustering and DnC's eigenproblems are arithmetic on n (or n^2) numbers: on a device each pass over
    the updates moves its results to the host in one transfer and the rule reads nothing more (a GPU's
    small round is its launches and syncs: DnC solved its eigenproblems there, FLAME read 9 scalars);
    the round's screening reads the counts where the server received them, on the host. The results
    come back on the device."""
    r = random_round(0, dtype=torch.float32)
    with elsewhere() as host:
        out = rule(name)(there(r, reports_on_host=True))
    assert isinstance(out.weights, Elsewhere)
    assert all(isinstance(v, Elsewhere) for v in out.info.get("clients", {}).values())
    assert (host.syncs, host.transfers) == (0, transfers(out))


@pytest.mark.parametrize("name", ["mean", "fedavg", "arfl"])
@pytest.mark.parametrize("reports_on_host", [True, False], ids=["reports on the host", "on the device"])
def test_the_clients_reported_numbers_are_read_on_the_host(name, reports_on_host):
    """The front door screens the clients' reported counts and metrics, and the mean's, FedAvg's and
    ARFL's weights are arithmetic on them: read where the server received them (the host), a clean round
    on a device costs these rules one read, the check that every update is sound: the mean's result
    (a scalar: finite, it proves every update finite), ARFL's update norms (the screen's, one transfer;
    its trust weights are a sort of n reported losses). Given on the device, the reports cost one
    transfer each, read once (a sync each before: 3 for the mean, 8 for ARFL). The weights come back on
    the device, equal to the CPU's."""
    r = random_round(0, dtype=torch.float32)
    expected = rule(name)(r)
    with elsewhere() as host:
        out = rule(name)(there(r, reports_on_host))
    reports = 0 if reports_on_host else 1 + (name == "arfl")  # the counts, and ARFL's losses
    assert (host.syncs, host.transfers) == ((0, 1 + reports) if name == "arfl" else (1, reports))
    assert isinstance(out.weights, Elsewhere) and isinstance(out.vector, Elsewhere)
    assert torch.equal(on_host(out.weights), expected.weights)


@pytest.mark.parametrize("name", [name for name in ALL if "+" not in name])
def test_the_scalars_a_rule_reads_from_the_device_do_not_grow_with_its_clients(name):
    """Every scalar read from a device is a sync: a rule reads a fixed number of them, whether the round
    has 14 clients or 33 (its per-client arithmetic runs on n numbers moved in one transfer). FOCUS's
    eq 4 scores each client's model on the server's benchmark: the reference gives each loss as a tensor
    on the device (as the simulator's and the Flower strategy's do), read together in one transfer.
    (Not the pre-aggregated rules: NNM's mixtures share neighbours, and near copies are confirmed one pair
    at a time, by a difference read back: a scalar per candidate pair, as for a group of copies.) The
    same with a fifth of the clients sending NaN: the front door read two counts per quarantined client
    (a device audit), now all of them in one transfer."""
    for broken in (False, True):  # a fifth of the clients sending NaN: quarantined, their counts read once
        syncs = []
        for n in (14, 33):
            r = random_round(0, n=n, d=40, dtype=torch.float32, previous=True)
            if broken:
                x = r.updates.clone()
                x[: n // 5, 0] = math.nan
                r = Round(x, r.client_ids, r.num_samples, r.metrics, r.reference, r.previous)
            with elsewhere() as host:
                build(name, {})(there(r))
            syncs.append(host.syncs)
        assert syncs[1] - syncs[0] == 0, (broken, syncs)


@pytest.mark.parametrize("name", [name for name in ALL if "+" not in name])
def test_the_kernels_a_rule_launches_on_the_device_do_not_grow_with_its_clients(name):
    """At a small round a GPU's time is its kernel launches (each one the host's dispatch: 10-30 us on an
    H200's host), not its reads: a rule launches a fixed number of kernels over its n clients, in a first
    round and in a second that reads its state, never a kernel or two per client (a state kept as one
    tensor a client: FoolsGold's histories, ICOV's factors, each copied in a launch of its own). FOCUS scores each client's model on the server's benchmark (eq
    4), a loss each: the benchmark's own kernels per client."""
    options = {"max_iter": 3, "tol": 0.0} if name == "geometric_median" else {}  # (iterations fixed)
    launches = []
    for n in (14, 33):
        first, second = (random_round(seed, n=n, d=40, dtype=torch.float32, previous=True) for seed in (0, 1))
        rule_ = build(name, options)
        with elsewhere() as host:  # two rounds of the same clients: the second reads what the first kept
            rule_(there(first))
            rule_(there(second))
        launches.append(host.launches)
    with elsewhere() as benchmark:  # one loss on the server's benchmark
        first.reference(to_elsewhere(first.updates[0]))
    per_client = 2 * benchmark.launches if name == "focus" else 0
    assert launches[1] - launches[0] == per_client * (33 - 14), (launches, host.kernels)


# ------------------------------------------------------------------ attacks, estimators, FedAG


def attack_context(x, bad, g, global_vector=None):
    def oracle(m):
        return rule("median")(Round(m)).vector

    if global_vector is None:
        global_vector = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    return AttackContext(x, bad, global_vector, "params", g, 1, oracle)


@pytest.mark.parametrize("name", sorted(ATTACKS))
@pytest.mark.parametrize("context_on_device", [True, False])
def test_attack_crafts_on_the_rounds_device(name, context_on_device):
    """Same malicious rows on the device as on the CPU: random draws come from the attack's generator
    where it lives (the CPU) and are moved, so a seed means the same attack everywhere. The mask of
    corrupted clients and the global vector may be given on the host (a device audit: every indexing
    attack failed with the mask there)."""
    options = {"mimic": {"target": 0}}.get(name, {})
    x = torch.randn(12, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float32) + 0.3
    bad = torch.tensor([True] * 3 + [False] * 9)
    expected = attack(name, **options)(attack_context(x, bad, torch.Generator().manual_seed(1)))
    with elsewhere():
        place = to_elsewhere if context_on_device else (lambda t: t)
        ctx = attack_context(
            to_elsewhere(x), place(bad), torch.Generator().manual_seed(1), place(torch.zeros(20))
        )
        sent = attack(name, **options)(ctx)
    assert isinstance(sent, Elsewhere) and sent.dtype == x.dtype
    torch.testing.assert_close(on_host(sent), expected, equal_nan=True, **dtype_tol(torch.float32, 10.0))


@pytest.mark.parametrize("method", ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"])
def test_estimator_runs_on_the_tables_device(method):
    """The estimators on a (tasks, sources, K) table with missing entries, on the device."""
    g = torch.Generator().manual_seed(3)
    truth = torch.randn(6, 1, 4, generator=g, dtype=torch.float64)
    noise = torch.tensor([0.1, 0.2, 0.5, 1.0, 2.0], dtype=torch.float64)[None, :, None]
    x = truth + noise.sqrt() * torch.randn(6, 5, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 4] = mask[3, 1] = False
    fit = getattr(inference, method)
    expected = fit(x, mask)
    with elsewhere():
        res = fit(to_elsewhere(x), to_elsewhere(mask))
    assert isinstance(res.consensus, Elsewhere) and isinstance(res.weights, Elsewhere)
    tol = dtype_tol(torch.float64, 1e3 if method.startswith("icov") else 10.0)
    torch.testing.assert_close(on_host(res.consensus), expected.consensus, **tol)
    torch.testing.assert_close(on_host(res.noise), expected.noise, **tol)


@pytest.mark.parametrize("method", ["ivar_mle", "ivar_vb", "icov_mle", "icov_vb"])
@pytest.mark.parametrize("sources", [8, 14])  # IVAR-MLE: the Gram path and the direct passes
def test_an_estimators_iterations_read_nothing_from_the_device(method, sources):
    """The iterations' arithmetic on sources x tasks numbers runs on the host: the scalars read from the
    device and the transfers do not grow with the iterations (IVAR-MLE read 3 scalars an iteration
    there, 214 syncs on a 66-iteration round); only the passes over the data (one transfer each, on
    IVAR-MLE's direct path) do."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1, 40, generator=g, dtype=torch.float64) + torch.randn(2, sources, 40, generator=g,
                                                                               dtype=torch.float64)  # fmt: skip
    x[:, : sources // 3] *= 3
    fit = getattr(inference, method)
    reads, iterations = {}, {}
    for max_iter in (2, 12):
        with elsewhere() as host:
            res = fit(to_elsewhere(x), max_iter=max_iter)
        assert isinstance(res.consensus, Elsewhere)
        iterations[max_iter] = res.iterations
        passes = res.iterations if method == "ivar_mle" and sources >= 12 else 0
        reads[max_iter] = (host.syncs, host.transfers - passes)
    assert iterations[2] == 2 < iterations[12]  # (ICOV-MLE's fit may settle before 12)
    assert reads[2] == reads[12]


def test_fedag_posterior_and_its_samples_stay_on_the_device():
    models = torch.randn(8, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    expected = fit_posterior(models)
    draws = expected.sample(5, torch.Generator().manual_seed(1))
    with elsewhere():
        post = fit_posterior(to_elsewhere(models))
        sampled = post.sample(5, torch.Generator().manual_seed(1))
    assert isinstance(post.mean, Elsewhere) and isinstance(sampled, Elsewhere)
    torch.testing.assert_close(on_host(post.var), expected.var)
    torch.testing.assert_close(on_host(sampled), draws)


@pytest.mark.parametrize("name", ALL)
def test_state_from_the_cpu_resumes_on_the_device(name):
    """A checkpoint holds CPU tensors (fedtrust.checkpoint writes them so): a rule loaded from one
    continues on the device as it continues on the CPU (resume across devices)."""
    first, second, third = rounds(torch.float32, copies=True)
    cpu = make(name)
    cpu(first)
    state = copy_tree(cpu.state_dict()) if hasattr(cpu, "state_dict") else None
    expected = [cpu(second), cpu(third)]
    resumed = make(name)
    if state is not None:
        resumed.load_state_dict(state)
    for r, want in zip((second, third), expected, strict=True):
        with elsewhere():
            out = resumed(there(r))
        torch.testing.assert_close(on_host(out.vector), want.vector, **dtype_tol(torch.float32, 10.0))
        torch.testing.assert_close(on_host(out.weights), want.weights, **dtype_tol(torch.float32, 10.0))


# ------------------------------------------------------------------ the simulator


def simulation_config(rule_name, corruption, executor, model="softmax"):
    from fedtrust.sweeps.config import validate

    return validate({
        "name": "device", "seed": 1,
        "data": {"name": "digits", "clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5},
                 "benchmark": 0.05},
        "model": {"name": model},
        "train": {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.3, "executor": executor},
        "corruption": {"fraction": 0.34, **corruption},
        "rule": {"name": rule_name},
    })  # fmt: skip


SIMULATIONS = [
    ("ivar_mle", {"name": "alie"}, "batched", "softmax"),
    (
        "fltrust",
        {"name": "backdoor", "samples": 0.5, "attack": {"name": "model_replacement"}},
        "loop",
        "softmax",
    ),
    ("arfl", {"name": "label_flip"}, "batched", "mlp"),
    ("focus", {"name": "fang_trimmed_mean"}, "loop", "mlp"),
]


@pytest.mark.parametrize(("rule_name", "corruption", "executor", "model"), SIMULATIONS,
                         ids=[f"{r}-{c['name']}-{e}" for r, c, e, _ in SIMULATIONS])  # fmt: skip
def test_simulation_runs_on_the_device(rule_name, corruption, executor, model):
    """Models, client data, the executor, the attack and the rule on the device: the same records as
    on the CPU (to float rounding), the global model there."""
    from fedtrust.sweeps.runner import build_simulation

    cfg = simulation_config(rule_name, corruption, executor, model)
    expected = build_simulation(cfg, device="cpu").run()
    with elsewhere():
        sim = build_simulation(cfg, device=DEVICE)
        records = sim.run()
        assert isinstance(sim.vector, Elsewhere)
    for got, want in zip(records, expected, strict=True):
        assert got["error"] == want["error"]
        for key, value in want["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, abs=0.02 if key == "accuracy" else 1e-3)
        assert got["weights"] == pytest.approx(want["weights"], abs=1e-3)


def test_an_evaluation_reads_the_device_once_whatever_its_batches():
    """FlatModel.evaluate adds its batches' sums where they are computed and reads them once (it read
    two a batch), with the CPU's numbers to the bit."""
    from fedtrust.data import load_digits
    from fedtrust.models import build_model

    digits = load_digits()
    model = build_model("mlp", digits, hidden=[16])
    w, x, y = model.init(0), digits.x_train, digits.y_train
    for batch in (100, 4096):  # 14 batches and 1
        with elsewhere() as host:
            scores = model.evaluate(to_elsewhere(w), to_elsewhere(x), to_elsewhere(y), batch=batch)
        assert host.syncs + host.transfers == 1
        assert scores == model.evaluate(w, x, y, batch=batch)


def second_round_on_the_device(executor: str, rule_name: str, clients: int = 6, model=None, **train):
    """What round 2 of a digits federation on the device asked of the host (round 1 sets it up); with a
    ``model`` (FedAG's linear one), of Boston housing's."""
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    data = {"name": "digits", "clients": clients, "benchmark": 0.05} if model is None else {
        "name": "boston", "clients": clients}  # fmt: skip
    cfg = validate({"name": "host", "seed": 1, "data": data, **({"model": model} if model else {}),
                    "train": {"rounds": 2, "executor": executor, **train}, "rule": {"name": rule_name}})  # fmt: skip
    with elsewhere():
        sim = build_simulation(cfg, device=DEVICE)
        sim.step(1)
    with elsewhere() as host:
        sim.step(2)
    return host


@pytest.mark.parametrize("executor", ["loop", "batched"])
def test_a_simulated_round_reads_as_many_device_scalars_whatever_its_clients(executor):
    """A round's reads from the device (each a GPU sync) do not grow with its clients: their reported
    losses are written where they are computed, and FOCUS's benchmark losses come back together (the
    per-client loop read each client's loss, and FOCUS each benchmark loss, one sync at a time)."""
    rounds = [second_round_on_the_device(executor, "focus", n, report_loss="always") for n in (6, 12)]
    reads = [(host.syncs, host.transfers) for host in rounds]
    assert reads[0] == reads[1], reads


@pytest.mark.parametrize("executor", ["loop", "batched"])
def test_a_simulated_round_copies_as_much_to_the_device_whatever_its_steps(executor):
    """Local steps do not copy to the device one by one (on CUDA each such copy waits for the kernels
    queued before it): the per-client loop moves each epoch's order of its client's rows once, where it
    indexed the rows with a CPU index every step (86 copies a 6-client round at batch size 32)."""
    uploads = [second_round_on_the_device(executor, "fedavg", batch_size=b).uploads for b in (8, 64)]
    assert uploads[0] == uploads[1] <= 6 + 4, uploads  # one a client, and the round's own


def test_train_device_is_checked_and_left_out_of_the_config_hash():
    from fedtrust.sim.settings import TrainSettings, resolve_device
    from fedtrust.sweeps.config import ConfigError, validate
    from fedtrust.sweeps.runner import config_hash

    cfg = simulation_config("mean", {"name": "none"}, "auto")
    on_cpu = validate(
        {**cfg.model_dump(exclude={"sweep"}), "train": {**cfg.train.model_dump(), "device": "cpu"}}
    )
    assert config_hash(on_cpu) == config_hash(cfg)  # a run resumes on another device
    with pytest.raises(ConfigError, match="train.device.*must be auto, cpu, cuda"):
        validate({**cfg.model_dump(exclude={"sweep"}), "train": {"device": "gpu"}})
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"train.device: 'cuda:1', but this torch .* sees no CUDA device"
        ):
            resolve_device("cuda:1")
    assert TrainSettings().device == "auto"
    # MPS has no float64, which the sums over a device's data take (a device audit found 9 such sites)
    with pytest.raises(ValueError, match=r"train.device: 'mps' is not supported: MPS has no float64"):
        resolve_device("mps")


@pytest.mark.parametrize("predictive", ["bootstrap", "omc", "linear"])
def test_fedag_simulation_scores_its_predictions_from_the_device(predictive):
    """FedAG's predictive distributions are computed on the device; the scores (scipy) on the host."""
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    cfg = validate({"name": "fedag", "seed": 0, "data": {"name": "boston", "clients": 5},
                    "model": {"name": "linear"}, "train": {"rounds": 2, "predictive": predictive},
                    "rule": {"name": "fedag"}})  # fmt: skip
    expected = build_simulation(cfg, device="cpu").run()
    with elsewhere():
        records = build_simulation(cfg, device=DEVICE).run()
    for key, value in expected[-1]["metrics"].items():
        assert records[-1]["metrics"][key] == pytest.approx(value, rel=1e-4)


@pytest.mark.parametrize("predictive", ["linear", "bootstrap"])
def test_fedag_reads_a_fixed_number_of_scalars_from_the_device_whatever_its_clients(predictive):
    """Eq 6's noise precision averages every client's mean squared residual: read in one transfer, not a
    sync a client (a device audit: 11 syncs a round at 5 clients, 16 at 10, with ``linear``)."""
    rounds = [
        second_round_on_the_device("auto", "fedag", n, model={"name": "linear"}, predictive=predictive)
        for n in (5, 10)
    ]
    assert rounds[0].syncs == rounds[1].syncs, [host.syncs for host in rounds]
