# Quickstart: `make demo` (set up, run the whole product on the embedded tiny target) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo clean

setup: $(STAMP)

# torch is pinned only when the venv has none, so a CPU box never downloads a multi-GB CUDA build;
# a venv that already holds a torch (e.g. a CUDA build) keeps it.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m dflash_common.demo

clean:
	rm -rf $(VENV) demo .pytest_cache
