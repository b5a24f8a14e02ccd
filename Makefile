# Set-up lives here so a fresh clone needs only `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned exactly: an unpinned torch pulls a multi-GB CUDA build. DeepSpeed is an sdist built against it.
TORCH := torch==2.13.0
DEEPSPEED := deepspeed==0.19.8
PYTEST_ARGS ?=

# SGLang's own argument code (CPU, no GPU packages), for check-sglang-args and the SGLang tests.
SGLANG_ROOT ?= .sglang

.PHONY: setup sglang demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -r requirements.txt
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation $(DEEPSPEED)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# One release per generation of SGLang's argument code (rules.VERSION_TABLE) installed, every release's wheel kept.
sglang: $(SGLANG_ROOT)/.installed

$(SGLANG_ROOT)/.installed: $(VENV)/.installed scripts/setup_sglang_venv.sh scripts/sglang-argcheck-requirements.txt platform/draftline/engines/sglang/rules.py
	SGLANG_ROOT=$(SGLANG_ROOT) DRAFTLINE_PYTHON=$(PY) bash scripts/setup_sglang_venv.sh
	touch $@

demo: setup
	$(VENV)/bin/draftline run --config configs/tiny-cpu.yaml

test: setup sglang
	$(PY) -m pytest -q -rs --durations=15 $(PYTEST_ARGS)

test-fast: setup sglang
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/extract.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/engines.py

clean:
	rm -rf .draftline .draftline-test
