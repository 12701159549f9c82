# Every target creates the virtual environment it needs, so a fresh machine
# with only Python 3.11+ can run `make demo` and `make test` directly.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The default suites run in this many pytest-xdist worker processes (`auto`: one per
# core; 0 runs them in pytest's own process). Most of a test's time is spent waiting on
# timers, handshakes and child processes, so one process leaves a core idle (the times
# are in CHANGELOG.md). Each test still runs whole in one worker, and tests share nothing
# but the machine (free ports, their own temporary directories, namespaces and etcd
# servers). The few that assert a ratio of wall-clock times are marked `alone` and run
# with no other test beside them (tests/run_alone.py). A worker ended by the hang backstop
# (tests/hang_backstop.py) fails its test; xdist starts another and the run goes on.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: install etcd valgrind test test-qh3 test-slow test-pythons soak demo certs lint docs perf fuzz dist dist-check clean

# editable_mode=compat installs a plain .pth entry for the source tree: setuptools' default
# editable install is an import hook, which mypy cannot see, so a user program's
# `import velomux_quic` failed to type-check (import-not-found). The install also builds
# the compiled record path (setup.py) in place, so it runs again when a .pyx changes; a
# compile error fails it. A compiled module is the .py beside each .pxd.
COMPILED_DECLARATIONS := $(wildcard velomux_quic/*/*.pxd)
COMPILED_SOURCES := $(wildcard velomux_quic/*/*.pyx) $(COMPILED_DECLARATIONS) \
	$(wildcard $(COMPILED_DECLARATIONS:.pxd=.py))

$(STAMP): pyproject.toml setup.py Makefile $(COMPILED_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,lint,perf,docs,etcd,otel,qh3]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

# The etcd server the discovery tests start (each its own, on free loopback ports, so a
# service the package may start on 2379 does not matter): Debian's etcd-server, installed
# when `etcd` is not on PATH and we are root; otherwise those tests skip, saying why.
etcd:
	@if ! command -v etcd >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing etcd-server (Debian) for the discovery tests"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null \
			|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null; } \
			|| echo "etcd-server did not install: the etcd discovery tests will skip"; \
		else \
			echo "etcd not found (and not root): the etcd discovery tests will skip"; \
		fi; \
	fi

# valgrind (callgrind) for the perf smoke test that counts instructions per token
# (perf/tokens.py --instructions): Debian's, installed as etcd-server is above; without it
# that test skips, saying why.
valgrind:
	@if ! command -v valgrind >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing valgrind (Debian) for the instruction-count perf test"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null \
			|| { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null; } \
			|| echo "valgrind did not install: the instruction-count perf test will skip"; \
		else \
			echo "valgrind not found (and not root): the instruction-count perf test will skip"; \
		fi; \
	fi

test: $(STAMP) etcd valgrind
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The whole suite again with every node on the qh3 engine (VELOMUX_QUIC_ENGINE=qh3, the
# velomux_quic[qh3] extra); the tests that need what qh3 does not do (EngineFeatures: one
# stream held back alone, MTU probes, derived reset tokens on every connection ID) skip
# there, saying which. Tests that name their engines (the fault matrix, the overload runs,
# tests/integration/test_engine_faults.py, the aioquic/qh3 interop matrix) run both either way.
test-qh3: $(STAMP) etcd
	VELOMUX_QUIC_ENGINE=qh3 $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The long soak and multi-host variants (marked `slow`), one at a time: each is long, and
# several measure rates or memory that a test beside them would disturb.
test-slow: $(STAMP) etcd
	$(PY) -m pytest -q -m slow --timeout=1800 $(PYTEST_ARGS)

# The oracle soak: random streams through 2% loss between two node processes, every item
# checked, resident memory sampled; a progress line every 10 s, exit 1 on any violation.
SOAK_SECONDS ?= 600
soak: $(STAMP)
	$(PY) -m tests.soak.oracle_soak --seconds $(SOAK_SECONDS)

demo: $(STAMP)
	$(PY) -m velomux_quic.programs.cli demo --certs certs/dev

certs: $(STAMP)
	$(PY) -m velomux_quic.programs.cli certs dev --out certs/dev

# The last two steps type-check examples/ as a user's program, with a user's settings
# (examples/mypy.ini: strict, nothing else): once through the installed package, once with
# MYPYPATH pointing at the source tree, where mypy analyses the library as user code.
lint: $(STAMP)
	$(VENV)/bin/ruff check velomux_quic tests perf examples fuzz tools
	$(VENV)/bin/ruff format --check velomux_quic tests perf examples fuzz tools
	$(VENV)/bin/mypy velomux_quic tests/conftest.py fuzz tools
	cd examples && $(abspath $(VENV))/bin/mypy --config-file mypy.ini .
	cd examples && MYPYPATH=$(CURDIR) $(abspath $(VENV))/bin/mypy --config-file mypy.ini .

# The documentation site (mkdocs.yml): strict, so a broken link, a missing page or an API
# entry that does not resolve fails the build. Output in site/ (git-ignored).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

perf: $(STAMP)
	$(PY) perf/run_all.py --short --out perf/results

# The fuzz targets (fuzz/), FUZZ_SECONDS each, coverage-guided with atheris (the `fuzz`
# extra). Where atheris has no wheel and cannot build, the run goes on with the pure-Python
# driver (seed corpus and deterministic mutations, no coverage feedback). FUZZ_TARGETS picks
# some: `make fuzz FUZZ_SECONDS=300 FUZZ_TARGETS="mux_batch envelope"`.
# FUZZ_EXAMPLES is the examples per hypothesis property of tests/unit/test_fuzz_properties.py,
# which the run ends with (round trips and structure-aware junk; 150 in `make test`).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?=
FUZZ_EXAMPLES ?= 5000
FUZZ_STAMP := $(VENV)/.installed-fuzz

$(FUZZ_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[fuzz]' --config-settings editable_mode=compat \
		|| echo "atheris did not install: fuzzing with the pure-Python driver"
	touch $(FUZZ_STAMP)

fuzz: $(FUZZ_STAMP)
	$(PY) -m fuzz.run --seconds $(FUZZ_SECONDS) $(FUZZ_TARGETS)
	VELOMUX_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q --timeout=3600 \
		tests/unit/test_fuzz_properties.py
	-$(PY) -m fuzz.replay

# The release: the sdist, and from it one manylinux wheel per Python in PYTHONS (each built
# by that Python, stripped, retagged by auditwheel; tools/build_wheels.py), checked by twine
# as a package index would render them.
RELEASE_STAMP := $(VENV)/.installed-release
PYTHONS ?= 3.11 3.12 3.13

$(RELEASE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[release]' --config-settings editable_mode=compat
	touch $(RELEASE_STAMP)

# dist/ is rebuilt only when what goes into it changed, so test-pythons after dist-check
# (as .ci/run runs them) installs the wheels dist-check checked instead of building again.
DIST_SOURCES := pyproject.toml setup.py MANIFEST.in README.md LICENSE CHANGELOG.md \
	tools/build_wheels.py $(shell find velomux_quic -name '*.py' -o -name '*.py[xi]' \
	-o -name '*.pxd' -o -name py.typed)
DIST_STAMP := dist/.complete

$(DIST_STAMP): $(RELEASE_STAMP) $(DIST_SOURCES)
	$(PY) tools/build_wheels.py --dist dist $(PYTHONS)
	$(VENV)/bin/twine check --strict dist/*
	touch $(DIST_STAMP)

dist: $(DIST_STAMP)

# Each wheel's tag (manylinux, in its name and its WHEEL file) and stripped extensions, and
# each wheel in a fresh virtual environment outside the checkout, used as a user would
# (tools/dist_check.py says what it runs under which Python).
dist-check: $(DIST_STAMP)
	$(PY) tools/dist_check.py --dist dist $(PYTHONS)

# The wheels make dist built, tested under every Python the package declares (pyenv's, or
# pythonX.Y on PATH; a missing one fails saying how to get it). PYTHONS must match the
# classifiers in pyproject.toml (a unit test checks). Run after dist-check, it reuses its
# wheels (dist is up to date); alone, it builds them first.
test-pythons: $(DIST_STAMP) etcd
	$(PY) tools/test_pythons.py --dist dist --workers $(PYTEST_WORKERS) $(PYTHONS)

clean:
	rm -rf $(VENV) build dist site *.egg-info .mypy_cache .ruff_cache
