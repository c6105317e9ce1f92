# Two entry points: `make run` (the worker with the shipped pair, observed) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system-deps run test test-fast lint bench vllm-venv plugin-wheel

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build lies on disk; installing it first keeps pip from pulling a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# Prometheus (and promtool) for the rule tests and the native stack.
system-deps:
	@command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

# VLLM=URL (a vLLM server already running) is watched too: the exporter reads its memory and
# Prometheus scrapes its own /metrics.
run: setup system-deps
	$(PY) scripts/local_stack.py $(if $(VLLM),--vllm $(VLLM))

# Tests run in TEST_JOBS processes (pytest-xdist), one file at a time each: in one process the suite
# kept about one of two cores busy, most tests waiting on a process they started.
TEST_JOBS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile

# The tests that run a real vLLM need its venv; when it cannot be built they are skipped and say why.
test: setup system-deps lint
	-$(MAKE) --no-print-directory vllm-venv
	$(PYTEST) tests

# The inner loop: the tests that start no worker, engine process or vLLM (tests/conftest.py marks
# the others slow), a few minutes on 2 cores.
test-fast: setup
	$(PYTEST) -m "not slow" tests

# The rules and the type checker's settings live in pyproject.toml.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy

# The vLLM plugin alone, for vLLM's environment: dist/vramledger_vllm_plugin-VERSION-py3-none-any.whl.
plugin-wheel:
	python3 scripts/plugin_wheel.py dist

# vLLM's CPU build in a venv of its own (VLLM_VENV, default .venv-vllm): the peer in bench/ and the
# vLLM end-to-end tests, which run when it exists and are skipped, saying why, when it does not.
VLLM_VENV ?= .venv-vllm
vllm-venv:
	VLLM_VENV=$(VLLM_VENV) bash scripts/vllm_venv.sh
