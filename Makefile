# Two commands a user needs: `make serve` and `make test`. Everything else is
# derived. `make serve` installs no torch; the test extra pins torch to the CPU
# build; where this machine keeps wheels on disk (/opt/wheels) pip takes them.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIPX    := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
HOST    ?= 127.0.0.1
PORT    ?= 8080
MODEL   ?= smollm2-135m
PYTEST_ARGS ?=
# the suite's files on this many workers (pytest-xdist; 0 = in one process): two halve a 2-core box's wait
PYTEST_WORKERS ?= 2

.PHONY: serve test test-fast test-ui install install-test bench clean

$(VENV)/.stamp-base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIPX) -e .
	touch $@

$(VENV)/.stamp-test: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIPX) -e '.[test]'
	touch $@ $(VENV)/.stamp-base

install: $(VENV)/.stamp-base
install-test: $(VENV)/.stamp-test

serve: install
	@echo "imp: venv ready ($$(du -sm $(VENV) | cut -f1) MB); fetching $(MODEL) ..."
	$(PY) -m imp pull $(MODEL)
	@echo "imp: starting the server on http://$(HOST):$(PORT)/ (a first boot compiles the kernels once)"
	$(PY) -m imp --host $(HOST) --port $(PORT) --model $(MODEL)

test: install-test
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: install-test
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

# Browser tests: Debian's Chromium driven by Playwright (never its own browser
# download); installed here when missing and we are root, else the tests skip.
test-ui: install-test
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y chromium || { apt-get update && apt-get install -y chromium; }; fi
	$(PY) -m pytest -q -m ui tests/test_ui.py $(PYTEST_ARGS)

bench: install-test
	$(PY) bench/cpu_serving.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
