# The two set-up commands of the README. Both create .venv if missing, install, then run.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
# The suite's files spread over pytest-xdist workers, one per logical core (at most 4), longest file first
# (tests/conftest.py).
PYTEST  = $(BIN)/python -m pytest -n logical --maxprocesses 4 --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-cpus docs bench gpu-bench lint clean fashion-mnist ivar-icov collusion arfl fedag robustness peers

$(STAMP): pyproject.toml constraints.txt setup.py src/fedtrust/aggregators/order_stats.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedtrust demo

test: $(STAMP)
	$(PYTEST)

# API documentation from the docstrings (pdoc) in docs/api; the test suite checks that it builds cleanly.
docs: $(STAMP)
	$(BIN)/python docs/build.py docs/api

# The suite on this CPU's own kernels, then as an AVX2 CPU without AVX-512 would run it (PyTorch's and
# MKL's AVX2 kernels), then as an old x86-64 CPU would (no AVX: PyTorch's default kernels, MKL at SSE4.2,
# OpenBLAS's Prescott kernels): results must not hang on how rounding falls.
test-cpus: $(STAMP)
	env -u OPENBLAS_CORETYPE $(PYTEST)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell $(PYTEST)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OPENBLAS_CORETYPE=Prescott $(PYTEST)

# Speed against the peers (benchmarks/README.md). ByzFL is installed for benchmarks only, without its
# dependencies (its top-level import pulls torchvision; the benchmark loads its aggregators module).
bench: $(STAMP) fashion-mnist
	$(BIN)/python -m pip install --quiet --no-deps byzfl==0.0.11
	$(BIN)/python benchmarks/aggregation.py
	$(BIN)/python benchmarks/attacks.py
	$(BIN)/python benchmarks/simulation.py

# Issue 20's GPU figures, on a machine with a CUDA GPU and torch's CUDA build (PyPI's torch is one on
# Linux): the CUDA tests, every rule against ByzFL on the device, and the Fashion-MNIST federation with
# fedtrust on the GPU against Flower's clients on the CPU and on the GPU.
gpu-bench: $(STAMP) fashion-mnist
	$(BIN)/python -m pip install --quiet --no-deps byzfl==0.0.11
	$(BIN)/python -m pytest tests/test_cuda.py
	$(BIN)/python benchmarks/gpu.py
	$(BIN)/python benchmarks/gpu_rank_windows.py
	$(BIN)/python benchmarks/simulation.py --data fashion_mnist --models softmax mlp cnn --device cuda \
		--flower-devices cpu cuda --out benchmarks/results/simulation_gpu

# The paper targets write their reports into the committed experiments/<experiment>/reports unless
# REPORTS names another folder (`make arfl REPORTS=/tmp/mine` writes /tmp/mine/arfl); raw runs go to
# RESULTS (finished runs are skipped on a re-run). Each shows a progress bar while it runs.
REPORTS ?=
RESULTS ?= results
reports = $(if $(REPORTS),$(REPORTS)/$(1),experiments/$(1)/reports)

# Nguyen et al.'s experiments (Table 1 synthetic + Figure 1 variants, one-round adversaries).
# Every config runs; the target fails at the end when a run failed or was refused (arfl likewise).
IVAR_ICOV = synthetic synthetic_participation synthetic_batch synthetic_adversaries one_round_digits one_round_fashion
ivar-icov: $(STAMP) fashion-mnist
	@failed=; for c in $(IVAR_ICOV); do $(BIN)/fedtrust run experiments/ivar_icov/$$c.yaml --out $(RESULTS) --report-dir $(call reports,ivar_icov) || failed="$$failed $$c"; done; \
	test -z "$$failed" || { echo "failed or refused runs in:$$failed (see the tables above)"; exit 1; }

# Colluding groups against IVAR/ICOV and the true-covariance oracle (issue 17; ~15 min on 2 cores).
collusion: $(STAMP)
	$(BIN)/python experiments/ivar_icov/collusion.py --seeds 5 --out $(call reports,ivar_icov)/collusion

# ARFL's Table 2 (IID and Dirichlet), its lambda sweep, FOCUS's four-client experiment and the liars
# study, on Fashion-MNIST.
ARFL = table2 table2_dirichlet lambda focus liars
arfl: $(STAMP) fashion-mnist
	@failed=; for c in $(ARFL); do $(BIN)/fedtrust run experiments/arfl/$$c.yaml --out $(RESULTS) --report-dir $(call reports,arfl) || failed="$$failed $$c"; done; \
	test -z "$$failed" || { echo "failed or refused runs in:$$failed (see the tables above)"; exit 1; }

# FedAvg-Gaussian: the toy (Fig. 2), Boston with the paper's protocol, robust FedAG.
fedag: $(STAMP)
	$(BIN)/python experiments/fedag/run.py all --out $(call reports,fedag)

# Every rule against every attack on digits, 3 seeds (issue 19; 25-45 min on 2 cores: the README's table;
# cached per source).
robustness: $(STAMP)
	$(BIN)/python experiments/robustness/run.py --data digits --seeds 3 --out $(call reports,robustness)

# fedtrust's rules against ByzFL's and Flower's own implementations on the robustness federation (digits,
# 3 seeds, 24 min on 2 cores: experiments/peers/README.md; cached per source). ByzFL is installed for this
# and the benchmarks only.
peers: $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps byzfl==0.0.11
	$(BIN)/python experiments/peers/run.py --data digits --seeds 3 --out $(call reports,peers)

# Fashion-MNIST for the experiments that name it: found where the loader looks (FEDTRUST_FASHION_MNIST,
# Debian's package, ~/.fedtrust/fashion-mnist), else Debian's dataset-fashion-mnist is installed (with
# sudo when not root); elsewhere put the IDX files in one of those folders.
fashion-mnist:
	@for d in "$$FEDTRUST_FASHION_MNIST" /usr/share/datasets/fashion-mnist "$$HOME/.fedtrust/fashion-mnist"; do \
		test -n "$$d" && test -d "$$d" && exit 0; done; \
	sudo=; test "$$(id -u)" = 0 || sudo=sudo; \
	($$sudo apt-get update && $$sudo apt-get install -y dataset-fashion-mnist) || { echo "fashion-mnist: \
	Debian's dataset-fashion-mnist did not install; put Fashion-MNIST's IDX files in \
	~/.fedtrust/fashion-mnist or name their folder in FEDTRUST_FASHION_MNIST" >&2; exit 1; }

lint: $(STAMP)
	$(BIN)/python -m ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
