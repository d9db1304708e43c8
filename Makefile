# Two entry points, each creating .venv/ on first use:
#   make demo   - the main job
#   make test   - the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/sampler_demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check sampler constrain tests bench examples
	$(VENV)/bin/ruff format --check sampler constrain tests bench examples
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) bench/sampler.py
