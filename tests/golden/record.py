"""Golden outputs: every rule on fixed rounds and a short simulation per rule, recorded before a refactor
and compared after it (``tests/test_golden.py``; issue 18: "a refactor changes no result").

    python tests/golden/record.py                 # rewrite tests/golden/outputs.json from this checkout
    python tests/golden/record.py --compare       # largest deviation of this checkout from the file

Record only when a result is meant to change, and say why in the commit. The committed file was recorded
on one CPU; on another the iterative fits round differently (``tests/test_golden.py`` allows for it), so a
refactor is checked digit for digit against outputs recorded on the same machine before it:

    python tests/golden/record.py --file /tmp/before.json             # before the change
    python tests/golden/record.py --file /tmp/before.json --compare   # after it: 0 numbers differ
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).parent
OUTPUTS = HERE / "outputs.json"

#: Rule name and options: every registered rule with its defaults, plus the options that change a path.
RULE_CASES = [
    ("mean", {}),
    ("fedavg", {}),
    ("median", {}),
    ("trimmed_mean", {}),
    ("trimmed_mean", {"f": 2}),
    ("geometric_median", {}),
    ("geometric_median", {"weighted": True}),
    ("krum", {"f": 1}),
    ("multi_krum", {"f": 1}),
    ("bulyan", {"f": 1}),
    ("centered_clipping", {"tau": 1.0, "n_iter": 3}),
    ("cfl", {}),
    ("norm_bounding", {}),
    ("norm_bounding", {"bound": 1.0}),
    ("dnc", {"f": 1}),
    ("dnc", {"f": 1, "b": 10, "niters": 3}),  # subsamples of the 30-40 coordinates
    ("flame", {}),
    ("flame", {"noise": 0.0}),
    ("foolsgold", {}),
    ("fltrust", {}),
    ("arfl", {}),
    ("arfl", {"defence": "clip"}),
    ("focus", {}),
    ("ivar_mle", {}),
    ("ivar_mle", {"sybils": "off"}),
    ("ivar_vb", {}),
    ("icov_mle", {}),  # to convergence (9-69 iterations, 4 s in all): stopped at 10, the path was the CPU's
    ("icov_vb", {}),
    ("icov_vb", {"sybils": "off"}),
    ("fedag", {}),
    ("fedag", {"base": "ivar_vb"}),
]

#: Rules run on a short simulation (the demo's federation, smaller).
SIM_CASES = [
    ("mean", {}),
    ("median", {}),
    ("trimmed_mean", {"f": 0.25}),
    ("geometric_median", {}),
    ("krum", {"f": 0.25}),
    ("multi_krum", {"f": 0.25}),
    ("bulyan", {"f": 0.1}),
    ("centered_clipping", {}),
    ("cfl", {}),
    ("norm_bounding", {}),
    ("dnc", {"f": 0.25}),
    ("flame", {}),
    ("foolsgold", {}),
    ("fltrust", {}),
    ("arfl", {}),
    ("focus", {}),
    ("ivar_mle", {}),
    ("ivar_vb", {}),
    ("icov_mle", {}),
    ("icov_vb", {}),
    ("fedag", {"base": "ivar_vb"}),
]


def label(name: str, options: dict) -> str:
    return name + "".join(f",{k}={v}" for k, v in sorted(options.items()))


def rounds(dtype: torch.dtype) -> dict[str, list]:
    """Named sequences of round arguments (consecutive rounds for stateful rules)."""
    g = torch.Generator().manual_seed(17)

    def honest(n: int, d: int, shift: float = 0.5) -> torch.Tensor:
        return (shift + torch.randn(n, d, generator=g, dtype=torch.float64)).to(dtype)

    def args(x: torch.Tensor, ids, losses=None) -> dict:
        n = x.shape[0]
        loss = torch.linspace(0.5, 2.0, n, dtype=torch.float64) if losses is None else losses
        return {
            "updates": x,
            "client_ids": list(ids),
            "num_samples": torch.arange(10, 10 + 5 * n, 5)[:n].to(dtype),
            "metrics": {"train_loss": loss.to(dtype)},
        }

    spread = []
    for t in range(3):
        x = honest(11, 40)
        x[8:] = x[8:] * 6 - 3  # three far-off clients
        ids = [f"c{(i + t) % 13}" for i in range(11)]  # clients come and go across rounds
        spread.append(args(x, ids))
    tied = honest(8, 30).round()  # integer entries: ties at every order statistic
    tied[5] = tied[2]  # and one copy
    ties = [args(tied, range(8))]
    bad = honest(9, 30)
    bad[1, 3] = math.nan
    bad[4, 0] = math.inf
    bad_args = args(bad, range(9))
    bad_args["num_samples"][6] = -1.0
    copies = honest(10, 30)
    copies[6:] = copies[0]  # five identical updates
    return {
        "spread": spread,
        "ties": ties,
        "quarantine": [bad_args],
        "copies": [args(copies, range(10))],
    }


class reference:  # noqa: N801 - recorded outputs name it
    """The server's benchmark: the loss of a vector against ``target``, and its own update (the target)."""

    def __init__(self, target: torch.Tensor):
        self.target = target

    def __call__(self, v: torch.Tensor) -> float:
        return float(((v.double() - self.target) ** 2).mean())

    def update(self) -> torch.Tensor:
        return self.target


def plain(value):
    """JSON-ready: tensors as lists (NaN as None), dicts and lists recursively, other scalars as is."""
    if isinstance(value, torch.Tensor):
        value = value.detach().double().tolist()
    if isinstance(value, float):
        return None if not math.isfinite(value) else value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    return repr(value)


#: info entries that are timings or texts: not compared.
SKIP_INFO = {"seconds", "warning", "trace"}


def rule_outputs() -> dict:
    from fedtrust import Round, rule

    out = {}
    for dtype in (torch.float32, torch.float64):
        for fixture, sequence in rounds(dtype).items():
            for name, options in RULE_CASES:
                r = rule(name, **options)
                results = []
                for kw in sequence:
                    target = kw["updates"][0].double()
                    rnd = Round(**kw, reference=reference(target))
                    try:
                        agg = r(rnd)
                    except Exception as exc:  # a refusal is an output too
                        results.append({"error": f"{type(exc).__name__}: {exc}"})
                        continue
                    info = {k: v for k, v in agg.info.items() if k not in SKIP_INFO}
                    results.append(
                        {"vector": plain(agg.vector), "weights": plain(agg.weights), "info": plain(info)}
                    )
                out[f"{str(dtype)[6:]}/{fixture}/{label(name, options)}"] = results
    return out


def sim_config(name: str, options: dict) -> dict:
    return {
        "name": "golden",
        "data": {
            "name": "digits",
            "clients": 8,
            "partition": {"name": "dirichlet", "alpha": 1.0},
            "benchmark": 0.05,
        },
        "model": {"name": "softmax"},
        "train": {
            "rounds": 3,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.5,
            "eval_every": 1,
            "fraction": 0.75,
        },
        "corruption": {"name": "label_flip", "fraction": 0.25},
        "rule": {"name": name, **options},
        "seed": 3,
    }


def sim_outputs(cases=SIM_CASES) -> dict:
    from fedtrust.sweeps.config import validate
    from fedtrust.sweeps.runner import build_simulation

    out = {}
    for name, options in cases:
        records = build_simulation(validate(sim_config(name, options))).run()
        out[label(name, options)] = [
            {k: plain(v) for k, v in r.items() if k not in ("seconds", "rule_seconds")} for r in records
        ]
    return out


def record() -> dict:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"rules": rule_outputs(), "simulations": sim_outputs()}


def deviations(a, b, path: str = "") -> list[tuple[float, str]]:
    """(absolute difference, path) of every number where two outputs differ; inf for structural changes."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [(math.inf, f"{path}: keys {sorted(set(a) ^ set(b))}")]
        return [x for k in a for x in deviations(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [(math.inf, f"{path}: length {len(a)} != {len(b)}")]
        return [
            x for i, (u, v) in enumerate(zip(a, b, strict=True)) for x in deviations(u, v, f"{path}[{i}]")
        ]
    if isinstance(a, bool | str) or a is None or isinstance(b, bool | str) or b is None:
        return [] if a == b else [(math.inf, f"{path}: {a!r} != {b!r}")]
    return [(abs(float(a) - float(b)), path)] if a != b else []


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--compare", action="store_true", help="compare with the recorded file, write nothing"
    )
    parser.add_argument(
        "--file", type=Path, default=OUTPUTS, help=f"the file to write or compare with (default {OUTPUTS})"
    )
    args = parser.parse_args()
    now = json.loads(json.dumps(record()))
    if not args.compare:
        args.file.write_text(json.dumps(now, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {args.file} ({args.file.stat().st_size // 1024} KiB)")
        return
    dev = sorted(deviations(json.loads(args.file.read_text()), now), reverse=True)
    print(f"{len(dev)} numbers differ; largest:")
    for d, p in dev[:15]:
        print(f"  {d:.3g}  {p}")
    sys.exit(1 if dev else 0)


if __name__ == "__main__":
    main()
