# traind: `make serve` runs the daemon; `make test` installs what the tests need and runs them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
ROOT   := $(shell [ "$$(id -u)" = 0 ] && echo yes)

.PHONY: serve test lint install test-deps system-deps clean

# The project and its runtime dependencies. torch is pinned exactly: the CPU wheel on disk here,
# where a looser requirement would pull a multi-GB CUDA build.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/.installed
test-deps: $(BIN)/.installed-test

# Real parts the tests drive: Debian's prometheus (scrapes), chromium (browser tests) and
# postgresql (the queue's contract tests). Installed only as root and only when missing;
# elsewhere those tests skip and say how.
HAVE_PG := $(shell command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && echo yes)
system-deps:
	@if [ -n "$(ROOT)" ] && { ! command -v prometheus >/dev/null || ! test -x /usr/bin/chromium || [ -z "$(HAVE_PG)" ]; }; then \
	  echo "installing Debian's prometheus, chromium and postgresql"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus chromium postgresql >/dev/null; \
	fi

serve: $(BIN)/.installed
	$(BIN)/traind db upgrade
	$(BIN)/traind serve

lint: $(BIN)/.installed-test
	$(BIN)/ruff check .
	mkdir -p .lint && ln -sfn .. .lint/traind
	MYPYPATH=.lint $(BIN)/mypy -p traind

test: $(BIN)/.installed-test system-deps lint
	$(BIN)/python -m pytest

clean:
	rm -rf var test-output .lint .pytest_cache .mypy_cache .ruff_cache
