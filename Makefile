# `make course` runs every notebook; `make test` runs the test suite.
# Both create .venv on first use (torch==2.13.0 pinned in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: course test lab outputs benchmark clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

course: $(STAMP)   ## execute every notebook into build/course/ and print a summary table
	$(PY) -m course_lib.runner --out build/course $(ARGS)

test: $(STAMP)     ## unit tests of course_lib, nbval over notebooks/, papermill with NPROC=3
	$(PY) -m pytest tests notebooks --nbval --nbval-current-env --nbval-cell-timeout 600 \
		--nbval-sanitize-with tests/nbval_sanitize.cfg $(ARGS)

lab: $(STAMP)      ## JupyterLab on notebooks/ in the course environment
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks

outputs: $(STAMP)  ## re-execute notebooks in place: the stored outputs nbval compares against
	$(PY) -m course_lib.runner --inplace $(ARGS)

benchmark: $(STAMP)
	$(PY) benchmarks/launcher_overhead.py

clean:
	rm -rf build .pytest_cache
