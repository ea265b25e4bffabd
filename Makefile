# The two commands of the README. Both install what they need first (scripts/bootstrap.sh).
PY := .venv/bin/python
# The suite runs in its written order; scripts/stress_suite.sh --shuffle runs it shuffled (pytest-randomly).
PYTEST_ARGS ?= -p no:randomly
# make test's pytest-xdist workers: a module is one work unit, the modules on the session's Ray
# Serve stack one unit per worker (tests/helpers/workers.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

.PHONY: install run test test-fast lint bench sim

install:
	@bash scripts/bootstrap.sh

run: install
	$(PY) -m gateway.cli serve $(ARGS)

test: install
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The quick tiers only (tests/helpers/tiers.py): no Redis, Ray or vLLM, no slow test; about a minute.
test-fast: install
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "(pure or engine) and not slow"

lint: install
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache

bench: install
	$(PY) -m gateway.cli bench engine

sim: install
	$(PY) -m gateway.cli sim $(ARGS)
