# tramprof: `make run` starts the daemon with built-in defaults,
# `make test` runs the whole suite. Both install what is missing first.

PYTHON_SYSTEM ?= /usr/bin/python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tramprof-installed
TEST_STAMP := $(VENV)/.tramprof-test-deps
# Only the tests need these: a real Prometheus server, a browser, the tools
# that build and exercise the trampoline runtime (cffi, headers, CPython's
# own test suite, perf) and debootstrap for the other interpreters' roots.
PYVER := $(shell $(PYTHON_SYSTEM) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
TEST_PACKAGES := prometheus chromium python3-cffi python3-dev libpython$(PYVER)-testsuite \
	debootstrap linux-perf binutils openssl
PYTEST_ARGS ?=

.PHONY: setup run test test-unit test-privileged lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml deploy/install-deps.sh
	@if [ "$$(id -u)" = 0 ]; then sh deploy/install-deps.sh; \
	  else echo "setup: not root, skipping distribution packages (bcc, headers)"; fi
	@test -x $(BIN)/python || $(PYTHON_SYSTEM) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	@$(BIN)/python -c "import bcc" 2>/dev/null || echo "setup: WARNING: bcc is not importable (python3-bpfcc)"
	@touch $(STAMP)

$(TEST_STAMP): deploy/install-deps.sh Makefile
	@if [ "$$(id -u)" = 0 ]; then sh deploy/install-deps.sh $(TEST_PACKAGES); \
	  else echo "setup: not root, skipping test packages ($(TEST_PACKAGES))"; fi
	@touch $(TEST_STAMP)

run: setup
	$(BIN)/tramprof run

test: setup $(TEST_STAMP) lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-privileged: setup $(TEST_STAMP)
	$(BIN)/python -m pytest tests/bpf tests/e2e $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check daemon tests benchmarks trampolines
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
