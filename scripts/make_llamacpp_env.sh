#!/usr/bin/env bash
# Create .venv-llamacpp: llama-cpp-python (it vendors llama.cpp) built from its PyPI source for this CPU,
# in its own virtual environment. Used by `scripts/bench.py --methods ...,llamacpp,llamacpp_lookup` and
# by scripts/demo.py (a llama.cpp line when this environment exists). CPU only: GGML_NATIVE tunes the
# kernels to the CPU that builds it (so a copy moved to another CPU may not run), no CUDA, no BLAS.
# The build runs under `nice` (NICE=0 turns that off): on a 2-core machine it takes several minutes.
set -euo pipefail
VENV="${1:-.venv-llamacpp}"
PYTHON="${PYTHON:-python3}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
NICE="${NICE:-10}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
start=$(date +%s)
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
-DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_SERVER=OFF ${EXTRA_CMAKE_ARGS:-}" \
CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" FORCE_CMAKE=1 \
    nice -n "$NICE" "$VENV/bin/pip" install -q --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMACPP_VERSION"
echo "pip install of llama-cpp-python took $(( $(date +%s) - start )) s (a build from source: several minutes on 2 cores)"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $VENV')"
