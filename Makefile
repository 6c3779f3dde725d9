# Two commands do all the set-up on a fresh machine:
#   make test       - builds .venv, installs, runs the test suite
#   make reproduce  - builds .venv, installs, runs the main experiment job
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# On a CPU machine the CPU build of torch is pinned and installed first, so that
# nothing later can pull a CUDA build. On a GPU machine (nvidia-smi present) the
# torch already importable in the base interpreter is reused via system site-packages.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# REQUIRE_GPU=1: fail instead of building a CPU venv where no GPU is visible (a SLURM job's per-node setup
# runs `make venv VENV=.venv-gpu REQUIRE_GPU=1` on each compute node, experiments/cluster/slurm.py).
REQUIRE_GPU ?=
ifeq ($(REQUIRE_GPU),1)
ifneq ($(HAS_GPU),1)
$(error REQUIRE_GPU=1 but no GPU is visible on $(shell hostname) (nvidia-smi -L failed): build the GPU venv on a GPU node)
endif
endif

STAMP := $(VENV)/.installed

.PHONY: venv test test-fast reproduce report plots model gpu-check gpu-extras clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
ifeq ($(HAS_GPU),1)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	# Reuse the CUDA torch of the system (module or base image); without one, PyPI's default Linux
	# wheel, which is a CUDA build. The pin keeps every later install from replacing it.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-pin.txt
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch ' + torch.__version__ + ' cannot use CUDA here')"
	$(PIP) install -q -c $(VENV)/torch-pin.txt -e '.[dev,hf]'
	# The GPU extras are not installed here: flash-attn builds from source for an hour where no wheel
	# matches, and pip's backtracking could replace the pinned torch. `make gpu-extras` adds them.
else
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_SPEC)
	echo '$(TORCH_SPEC)' > $(VENV)/torch-pin.txt
	$(PIP) install -q -c $(VENV)/torch-pin.txt -e '.[dev,hf]'
endif
	# DeepSpeed, a test peer (docs/methods.md, "Peer defects"), pinned: a test shows a defect of this version.
	# Built against the torch above: with build isolation pip would fetch a torch of its own.
	$(PIP) install -q setuptools wheel
	$(PIP) install -q --no-build-isolation deepspeed==0.19.8
	touch $(STAMP)

# The linters first (ruff's rules and the import floors, both configured in pyproject.toml), then the tests.
test: $(STAMP)
	$(VENV)/bin/ruff check burst_impl baselines experiments tests benchmarks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(PYTEST_ARGS)

# `make test-fast`: the tests without those marked `slow` (pyproject.toml's markers: the long
# multi-process runs), for a quick check while editing; `make test` runs everything, linters included.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# `make reproduce`: the CPU preset end to end, measured on this machine: results/<machine>/ and
# plots/<machine>/ (<machine>: this machine's hardware slug, or the SLURM cluster profile's name). Only
# cases measured by this machine at this commit are skipped, so a fresh clone re-measures everything;
# the committed reference results (results/reference/) are never resumed from. PRESET=<name> picks another
# preset (a named list of specs: experiments/presets/<name>.yaml, e.g. a100_8, a100_32, a800_32,
# whose specs run on SLURM cluster profiles); CLUSTER=<name> runs every spec of the preset on that
# cluster profile (experiments/clusters/<name>.yaml); RUN_ARGS passes options (--dry-run, --force).
PRESET ?= cpu
CLUSTER ?=
RUN_ARGS ?=
ifeq ($(origin PROFILE),command line)
$(error PROFILE= was renamed PRESET=: make reproduce PRESET=$(PROFILE))
endif

reproduce: $(STAMP)
	$(VENV)/bin/burst-bench run $(PRESET) $(if $(CLUSTER),--cluster $(CLUSTER)) $(RUN_ARGS)
	$(VENV)/bin/burst-bench report

# `make report`: the reproduction report, reports/index.html and its Markdown twin reports/index.md (every
# claim of the papers, its verdict here, the papers' values next to the modelled and measured ones, the
# figures), built from whatever results exist (results/<machine>/, results/gpu_check/, results/reference/,
# results/modelled/); measures nothing. The last step of `make reproduce`. REPORT_ARGS passes options.
REPORT_ARGS ?=

report: $(STAMP)
	$(VENV)/bin/burst-bench report $(REPORT_ARGS)

# Redraw every figure from every results folder (results/<machine>/, results/reference/<machine>/,
# results/modelled/) into the same path under plots/; runs nothing.
plots: $(STAMP)
	$(VENV)/bin/burst-bench plots

# `make model`: the performance model (experiments/perfmodel) predicts every paper-size spec on the
# hardware profile its cluster profile names: results/modelled/ and plots/modelled/ (figures and tables, all
# labelled "modelled"). Runs nothing on any device. MODEL_ARGS passes options (e.g. --hardware NAME).
MODEL_ARGS ?=

model: $(STAMP)
	$(VENV)/bin/burst-bench model paper $(MODEL_ARGS)

# `make gpu-check`: every CUDA kernel and peer once, on this machine's GPUs (experiments/gpu_check.py):
# package report, tests/test_cuda_path.py, the profile's attention and GEMM efficiencies, the memory model
# against CUDA's counters, the world-size-1 harness per kernel, ring-flash-attn, NCCL at world size > 1
# when more than one GPU is visible, the kernel TFLOP/s sweep. Prints its plan (GPU_CHECK_ARGS="--steps
# ... --deadline-s S"; a lent device: experiments/gpu_check_lent.sh, one command); installs and builds nothing, so it
# does not build the venv either: it runs in .venv where that is built, else in $(PYTHON) (a GPU
# machine without network). Writes results/gpu_check/<gpu>/ (+ <gpu>.tar.gz) and plots/gpu_check/<gpu>/.
# Exit 1 when nvidia-smi lists GPUs that torch cannot use; without a GPU: says so, exits 0.
GPU_CHECK_ARGS ?=
GPU_CHECK_PY := $(if $(wildcard $(STAMP)),$(PY),$(PYTHON))

gpu-check:
	$(GPU_CHECK_PY) -m experiments.gpu_check $(GPU_CHECK_ARGS)

# `make gpu-extras`: the GPU extras (pyproject.toml's [gpu] pins) into the built venv, each on its own,
# --no-deps against the installed torch (nothing may replace it), allowed to fail: a package that does
# not install is reported missing by `make gpu-check` (or fails it under --require). flash-attn only
# from a prebuilt wheel (--only-binary): a source build takes an hour and needs the network.
# (read with ast, not tomllib: Python 3.10 has none)
GPU_EXTRAS ?= $(shell $(PYTHON) -c "import ast, re; t = open('pyproject.toml').read(); print(' '.join(chr(39) + r + chr(39) for r in ast.literal_eval(re.search(r'^gpu = (\[.*\])', t, re.M).group(1))))")

gpu-extras: $(STAMP)
	@for req in $(GPU_EXTRAS); do \
		echo "gpu-extras: $$req"; \
		$(PIP) install -q --no-deps --only-binary flash-attn -c $(VENV)/torch-pin.txt "$$req" \
			|| echo "gpu-extras: $$req did not install (allowed; make gpu-check reports it)"; \
	done

clean:
	rm -rf $(VENV) .pytest_cache
