# The two commands of README.md:  make quickstart   |   make test
# Everything installs into .venv from this project's own files.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup quickstart test ui-check bench clean

setup: $(VENV)/.installed

# torch==2.13.0 is the CPU wheel on this machine's disk; constraints.txt keeps every
# later resolution on it (an unpinned torch would pull a multi-GB CUDA build).
$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $@

quickstart: setup
	$(VENV)/bin/rlpipe run pipelines/quickstart.yaml

test: setup
	$(VENV)/bin/python -m pytest

# The MLflow UI on a recorded run in headless Chromium (apt-get install chromium); screenshots
# go to $RLPIPE_SCREENSHOTS when set.
ui-check: setup
	$(VENV)/bin/python -m pytest -m browser tests/browser

bench: setup
	$(VENV)/bin/python benchmarks/engine_overhead.py --steps 30 --warmup 3
	$(VENV)/bin/python benchmarks/async_modes.py --steps 20 --warmup 3

clean:
	rm -rf $(VENV) mlruns mlflow.db outputs
