# `make course` runs every notebook; `make test` runs the test suite.
# Every target creates .venv on first use (torch==2.13.0 pinned in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# nbval: re-execute notebooks/ at their default parameters and compare with the stored outputs.
# A cell over --nbval-cell-timeout is interrupted and fails naming the cell, before pytest-timeout
# (300 s per test, pyproject.toml) would stop the whole item with a traceback.
NBVAL := --nbval --nbval-current-env --nbval-cell-timeout 270 --nbval-sanitize-with tests/nbval_sanitize.cfg
# Two pytest workers: most of a test's time is process start-up, so two run side by side on 2 cores.
# A notebook's cells stay in one worker (loadfile: nbval runs them in order in one kernel).
XDIST := -n 2
LINTED := course_lib tests benchmarks notebooks conftest.py

.PHONY: course test test-ranks test-browser lint lab outputs benchmark clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

course: $(STAMP)      ## execute every notebook into build/course/ and print a summary table
	$(PY) -m course_lib.course.runner --out build/course $(ARGS)

test: $(STAMP)        ## unit tests of course_lib, and nbval: every notebook once, at its default parameters
	$(PY) -m pytest tests notebooks $(NBVAL) -m "not notebook" --ignore=tests/browser $(XDIST) --dist loadfile $(ARGS)

# NPROCS: the world sizes test-ranks runs every notebook at (1,2,4,8 is the full sweep; CI runs 1 and 4),
# each but the notebook's own NPROC, at which nbval in `make test` runs it.
NPROCS ?= 1,4
test-ranks: $(STAMP)  ## every notebook under papermill at each of NPROCS: it runs there (its own assertions hold) or refuses at once
	TEST_NPROCS=$(NPROCS) $(PY) -m pytest -m notebook tests/test_notebooks.py $(XDIST) --dist load $(ARGS)

test-browser: AS_ROOT = $$(test "$$(id -u)" = 0 || echo sudo) env DEBIAN_FRONTEND=noninteractive
test-browser: $(STAMP)  ## JupyterLab in headless Chromium runs notebooks 00 and 01: outputs, ranks, explorer; screenshots in build/browser/
	test -x /usr/bin/chromium || { $(AS_ROOT) apt-get install -y chromium || { $(AS_ROOT) apt-get update && $(AS_ROOT) apt-get install -y chromium; }; }
	$(PY) -m pytest tests/browser -p no:cacheprovider $(ARGS)

lint: $(STAMP)        ## ruff (lint and format) over code, tests, benchmarks and notebooks; mypy over course_lib
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy course_lib

lab: $(STAMP)         ## JupyterLab on notebooks/ in the course environment (as root too: GPU containers)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $$(test "$$(id -u)" = 0 && echo --allow-root) $(ARGS)

outputs: $(STAMP)     ## re-execute notebooks in place: the stored outputs nbval compares against
	$(PY) -m course_lib.course.runner --inplace $(ARGS)

benchmark: $(STAMP)   ## every script in benchmarks/, one table: figure, goal, measured
	$(PY) benchmarks/run_all.py $(ARGS)

clean:
	rm -rf build .pytest_cache
