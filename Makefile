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

.PHONY: venv test reproduce plots clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
ifeq ($(HAS_GPU),1)
	$(PYTHON) -m venv --system-site-packages $(VENV)
	# Reuse the CUDA torch of the system (module or base image); without one, PyPI's default Linux
	# wheel, which is a CUDA build. The pin keeps every later install from replacing it.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-pin.txt
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch ' + torch.__version__ + ' cannot use CUDA here')"
	$(PIP) install -q -c $(VENV)/torch-pin.txt -e '.[dev]'
	# The GPU extras (flash-attn, ring-flash-attn, xformers), built against that torch.
	$(PIP) install -q setuptools wheel ninja packaging psutil
	$(PIP) install -q -c $(VENV)/torch-pin.txt --no-build-isolation -e '.[gpu]'
else
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e '.[dev]'
endif
	# DeepSpeed, a test peer (README, "Peer defects"), pinned: a test shows a defect of this version.
	# Built against the torch above: with build isolation pip would fetch a torch of its own.
	$(PIP) install -q setuptools wheel
	$(PIP) install -q --no-build-isolation deepspeed==0.19.8
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# `make reproduce`: the CPU preset end to end (results/ and plots/). With PROFILE=<name>
# (a100_8, a100_32, a800_32: experiments/presets/<name>.yaml) the cluster sweeps go through
# the SLURM template instead; RUN_ARGS passes options (e.g. --dry-run, --force).
PROFILE ?= cpu
RUN_ARGS ?=

reproduce: $(STAMP)
	$(PY) -m experiments.run $(PROFILE) $(RUN_ARGS)

# Redraw every figure from the results files; runs nothing.
plots: $(STAMP)
	$(PY) -m experiments.plots

clean:
	rm -rf $(VENV) .pytest_cache
