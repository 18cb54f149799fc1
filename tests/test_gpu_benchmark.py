"""benchmarks/gpu.py, the issue 20 benchmark a GPU session runs, checked on the CPU: every rule it times
runs in both dtypes and lands in its table, so a lent GPU's minutes are not spent finding a broken script."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu.py"
RULES = ["mean", "median", "trimmed_mean", "bulyan", "krum", "geometric_median", "ivar_mle"]


def test_the_gpu_benchmark_times_every_rule_in_both_dtypes_on_the_cpu(tmp_path):
    out = tmp_path / "gpu"
    args = ["--device", "cpu", "--n", "7", "--d", "1e3", "--repeat", "1", "--dtype", "float32", "float64"]
    subprocess.run([sys.executable, str(SCRIPT), *args, "--rules", *RULES, "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)  # fmt: skip
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [(r["dtype"], r["rule"]) for r in rows] == [
        (t, name) for t in ("float32", "float64") for name in RULES
    ]
    assert all("error" not in r and r["seconds"] > 0 and r["floor"] > 0 for r in rows)
    if importlib.util.find_spec("byzfl"):  # installed by make bench, not by make test
        assert all("byzfl" in r for r in rows if r["rule"] in ("median", "krum"))  # the peer timed beside it
    table = out.with_suffix(".md").read_text()
    assert "cpu (no GPU)" in table and "| 7 | 1e+03 | float64 | bulyan |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the benchmark would run")
def test_asked_for_cuda_where_there_is_none_it_says_so(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--n", "4", "--d", "10", "--out", str(tmp_path / "g")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr
