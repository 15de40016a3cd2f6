# dptrain: `make run` starts the embedded service, `make test` runs the whole suite, `make test-fast`
# the tests that start no processes (the inner loop).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
SCHEMATHESIS := tests/security/test_schemathesis.py

.PHONY: setup run test test-fast lint typecheck clean bench bench-smoke

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# constraints.txt pins the CPU build of torch for development and CI.
	$(PY) -m pip install -q -c constraints.txt -e '.[all,dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/dptrain up --host $${HOST:-127.0.0.1} --port $${PORT:-8000}

# Two pytest processes (pytest-xdist), each taking a whole test module at a time (a module's
# stack or database is set up once): most e2e tests wait on processes they started, so two at once
# keep CI's two cores busy. Schemathesis makes its operations items that share one test id, which
# xdist cannot hand out one by one: that module runs after, on its own.
test: setup lint bench-smoke
	$(PY) -m pytest -n 2 --dist loadfile --ignore=$(SCHEMATHESIS) $(PYTEST_ARGS)
	$(PY) -m pytest $(SCHEMATHESIS) $(PYTEST_ARGS)

# The inner loop: every test not marked e2e (none starts a process: tests/conftest.py fails one
# that does), without lint or bench-smoke. Under two minutes; `make test` stays the whole suite.
test-fast: setup
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

# Every benchmark for real (minutes; needs PostgreSQL and Redis like the tests): writes
# bench/results.json and BENCHMARKS.md. See docs/benchmarks.md.
bench: setup
	$(PY) -m bench

# Each benchmark at tiny sizes, to a temporary directory: the scripts run, no timing is judged.
bench-smoke: setup
	$(PY) -m bench --smoke

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy api_schemas service workers dptrain dptrain_cli dptrain_server bench

clean:
	rm -rf $(VENV) .dptrain .pytest_cache .mypy_cache .ruff_cache
