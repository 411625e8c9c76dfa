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
LINTED := course_lib tests benchmarks notebooks tools site conftest.py

.PHONY: course test test-ranks test-browser lint lab fresh site outputs benchmark clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

course: $(STAMP)      ## execute every notebook into build/course/ and print a summary table
	$(PY) -m tools.runner --out build/course $(ARGS)

test: $(STAMP)        ## unit tests of course_lib (one world size each: 3 where a test covers several), and nbval: every notebook once
	$(PY) -m pytest notebooks tests $(NBVAL) -m "not sweep" --ignore=tests/browser $(XDIST) --dist loadfile $(ARGS)

# The sweeps (tests marked `sweep`): every notebook under papermill at each of NPROCS but its own (nbval runs it
# there); each notebook's setup at NPROC 1-8 on 0-8 faked GPUs; the multi-rank tests at their other world sizes.
# NPROCS=1,2,4,6,8 is the full sweep (6 and 8: what gpu_node.sh gives on 8 GPUs); CI runs 1 and 4.
NPROCS ?= 1,4
test-ranks: $(STAMP)  ## the sweeps: notebooks at each of NPROCS (they run, assertions holding, or refuse at once), tests at other world sizes
	TEST_NPROCS=$(NPROCS) $(PY) -m pytest -m sweep tests --ignore=tests/browser $(XDIST) --dist load $(ARGS)

test-browser: AS_ROOT = $$(test "$$(id -u)" = 0 || echo sudo) env DEBIAN_FRONTEND=noninteractive
test-browser: $(STAMP) site  ## headless Chromium: JupyterLab runs notebooks 00 and 01 (outputs, ranks, explorer), and two site pages render; screenshots in build/browser/
	test -x /usr/bin/chromium || { $(AS_ROOT) apt-get install -y chromium || { $(AS_ROOT) apt-get update && $(AS_ROOT) apt-get install -y chromium; }; }
	$(PY) -m pytest tests/browser -p no:cacheprovider $(ARGS)

lint: $(STAMP)        ## ruff (lint and format) over code, tests, benchmarks and notebooks; mypy over course_lib
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy course_lib

# The learner's copy: practice/ (git-ignored), every output cleared and every answer folded, made on first use and
# never overwritten; notebooks/ keeps the stored outputs that nbval and the site read.
lab: $(STAMP)         ## JupyterLab on practice/, your copy of the notebooks (as root too: GPU containers)
	$(PY) tools/editions.py practice
	$(VENV)/bin/jupyter lab --notebook-dir=practice $$(test "$$(id -u)" = 0 && echo --allow-root) $(ARGS)

fresh: $(STAMP)       ## a fresh copy of one notebook in practice/, yours kept beside it: make fresh NB=03
	@test -n "$(NB)" || { echo "say which notebook: make fresh NB=03" >&2; exit 2; }
	$(PY) tools/editions.py restore $(NB)

# The executed course as a website: the stored notebooks rendered (nothing re-executed, nothing fetched), answers
# folded behind a click; warnings are errors.
site: $(STAMP)        ## the executed course as a website in build/site/ (open build/site/index.html)
	$(PY) tools/editions.py site-sources build/site-src
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html build/site-src build/site
	@echo "the site: build/site/index.html ($$(ls build/site/[0-9]*.html | wc -l) notebook pages)"

outputs: $(STAMP)     ## re-execute notebooks in place: the stored outputs nbval compares against
	$(PY) -m tools.runner --inplace $(ARGS)

benchmark: $(STAMP)   ## every script in benchmarks/, one table: figure, goal, measured
	$(PY) benchmarks/run_all.py $(ARGS)

clean:
	rm -rf build .pytest_cache
