# Entry points on a fresh machine: `make demo` and `make test` (Python 3.11, megatron-core 0.16.1,
# the local CPU torch build; they build .venv/ first). More tiers, run by .ci/run:
#   make test-latest    the version-sensitive part of the suite (conftest.py: --tier latest) on the latest
#                       supported stack: Python 3.12 (pyenv 3.12.1 where pyenv is installed),
#                       megatron-core 0.19.2 (requirements-latest.txt) and the hf extra (requirements-hf.txt:
#                       megatron-bridge, transformers) in .venv-latest/
#   make test-kernels   the GPU backends' real Triton kernels on CPU through Triton's interpreter
#                       (tests_kernels/): .venv-latest plus requirements-kernels.txt in .venv-latest/kernels
# --dist loadscope --no-loadscope-reorder: each module runs on one worker (its module fixture, one batch of
# gloo runs, once), longest modules first (conftest.py).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements-cpu.txt setup.py | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

# Python >= 3.12 for megatron-core 0.17+. PYENV_VERSION picks pyenv's 3.12.1 through the python3.12
# shim; without pyenv it is ignored and python3.12 from PATH is used.
PY_LATEST ?= python3.12
PYENV_LATEST ?= 3.12.1
VENV_LATEST := .venv-latest
BIN_LATEST := $(VENV_LATEST)/bin
STAMP_LATEST := $(VENV_LATEST)/.installed-$(shell cat requirements-latest.txt requirements-hf.txt setup.py | cksum | cut -d' ' -f1)
KERNELS := $(VENV_LATEST)/kernels
STAMP_KERNELS := $(KERNELS)/.installed-$(shell cat requirements-kernels.txt | cksum | cut -d' ' -f1)

.PHONY: venv venv-latest venv-kernels demo test test-latest test-kernels bench clean

venv: $(STAMP)

$(STAMP): requirements-cpu.txt setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

venv-latest: $(STAMP_LATEST)

$(STAMP_LATEST): requirements-latest.txt requirements-hf.txt setup.py
	test -x $(BIN_LATEST)/python || PYENV_VERSION=$(PYENV_LATEST) $(PY_LATEST) -m venv $(VENV_LATEST)
	$(BIN_LATEST)/python -c 'import sys; assert sys.version_info >= (3, 12), \
		f"$(VENV_LATEST) has Python {sys.version.split()[0]}; megatron-core 0.17+ needs >= 3.12 (rm -r $(VENV_LATEST))"'
	$(BIN_LATEST)/python -m pip install -q --upgrade pip
	$(BIN_LATEST)/python -m pip install -q -r requirements-latest.txt
	$(BIN_LATEST)/python -m pip install -q --no-deps -r requirements-hf.txt
	$(BIN_LATEST)/python -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV_LATEST)/.installed-* && touch $@

venv-kernels: $(STAMP_KERNELS)

$(STAMP_KERNELS): requirements-kernels.txt $(STAMP_LATEST)
	rm -rf $(KERNELS)
	MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
		$(BIN_LATEST)/python -m pip install -q --no-deps --no-build-isolation --target $(KERNELS) -r requirements-kernels.txt
	touch $@

demo: venv
	$(BIN)/megatron-tree demo

test: venv
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=40 $(PYTEST_ARGS) tests

test-latest: venv-latest
	$(BIN_LATEST)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --tier latest --durations=40 $(PYTEST_ARGS) tests

test-kernels: venv-kernels
	TRITON_INTERPRET=1 PYTHONPATH=$(abspath $(KERNELS)) \
		$(BIN_LATEST)/python -m pytest -q -n 2 -c tests_kernels/pytest.ini $(PYTEST_ARGS) tests_kernels

bench: venv
	$(BIN)/python tools/bench_pack.py
	$(BIN)/python tools/bench_ops.py

clean:
	rm -rf $(VENV) $(VENV_LATEST) runs .pytest_cache .hypothesis
