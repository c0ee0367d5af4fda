# Two entry points on a fresh machine: `make demo` and `make test`. Both build .venv/ first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements-cpu.txt setup.py | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

venv: $(STAMP)

$(STAMP): requirements-cpu.txt setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-* && touch $@

demo: venv
	$(BIN)/megatron-tree demo

test: venv
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS) tests

bench: venv
	$(BIN)/python tools/bench_pack.py
	$(BIN)/python tools/bench_ops.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
