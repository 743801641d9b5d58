# The two commands a fresh clone needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean install

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "Python 3.11 is required (set PYTHON=...)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,torch]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m celery_ojs_ml demo $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The suite runs in TEST_WORKERS processes (pytest-xdist), each taking whole test files:
# the integration tests mostly wait on real workers, so two processes halve the time on
# two cores. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/spec.py
	$(BIN)/python bench/dispatch.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/replay.py --mode fgd --plot docs/images/replay_fgd.png
	$(BIN)/python bench/replay.py --mode time --plot docs/images/replay_time.png
	$(BIN)/python bench/replay_gang.py --plot bench/results/gang/replay_gang.png
	$(BIN)/python -m bench.replay_fair --workers 2 --horizon 14400 --half-life 3600 --plot bench/results/fair-share/replay_fair.png
	$(BIN)/python bench/scheduler.py --workers 100 1000 10000 --jobs 100000 --plot bench/results/scheduler/scheduler.png --out bench/results/scheduler/scheduler.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
