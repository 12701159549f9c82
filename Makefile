# Every target creates the virtual environment it needs, so a fresh machine
# with only Python 3.11+ can run `make demo` and `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-slow demo certs lint perf clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lint,perf]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The long soak and multi-host variants (marked `slow`).
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --timeout=1800 $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m velomux_quic.cli demo --certs certs/dev

certs: $(STAMP)
	$(PY) -m velomux_quic.cli certs dev --out certs/dev

lint: $(STAMP)
	$(VENV)/bin/ruff check velomux_quic tests perf
	$(VENV)/bin/ruff format --check velomux_quic tests perf
	$(VENV)/bin/mypy velomux_quic tests/conftest.py

perf: $(STAMP)
	$(PY) perf/run_all.py --short --out perf/results

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
