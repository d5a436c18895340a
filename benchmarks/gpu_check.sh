#!/usr/bin/env bash
# The CUDA path, checked on a GPU machine (a lent one has PyTorch and CUDA but no package registry,
# and our default model's weights do not travel there: its tests use the random tiny Llama with the
# real tokenizer, saved beside this script's inputs).
#
# Prepare here, once (the folder .gpu/ is git-ignored and travels with the working tree):
#   mkdir -p .gpu && python -c "from ragcache_backend.model.loader import load_model; m = load_model(); \
#     m.tokenizer.save_pretrained('.gpu/tokenizer'); m.model.config.save_pretrained('.gpu/smollm2-config')"
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .gpu/whl pydantic==2.14.4 pydantic_core==2.50.5 annotated_types \
#     typing_inspection pytest-asyncio tenacity gguf pydantic-settings python-dotenv fastapi starlette uvicorn \
#     jsonschema jsonschema-specifications referencing rpds-py redis opentelemetry-api
#   pip download ... --platform manylinux_2_31_x86_64 -d .gpu/whl llguidance==1.9.1   # the grammar (structured output)
#   # optional, for step 3's comparison: the connector's worker before a change
#   mkdir -p .gpu/base && git show REV:ragcache_integrations/vllm/worker.py > .gpu/base/worker.py
# Then on the GPU machine, from the repository root: OUT=/some/folder bash benchmarks/gpu_check.sh
# (OVERLAP_ONLY=1: step 3 alone; NO_OVERLAP=1: steps 1 and 2 alone)
#
# 1. pytest on CUDA: the engine, cache, model, server-app and vLLM-connector-parts tests that need
#    neither the real model's package nor Redis nor faiss nor the embedder nor our installed
#    distribution (those run in CI; the six tests deselected below need one of them), with every
#    engine on `cuda`
#    (the server's tests serve sampling parameters, structured output and tool calls from it);
# 2. benchmarks/gpu_engine_check.py: exactness through the device, host (pinned) and disk tiers and
#    TTFT with and without hits, on SmolLM2-135M's shape with random weights.
# 3. benchmarks/connector_overlap.py: the vLLM connector's worker driven as vLLM drives it around a
#    stand-in forward pass (Llama-3-8B's and SmolLM2-135M's shapes, bf16): do its copies hide behind it?
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 RAGCACHE_TEST_TOKENIZER=$PWD/.gpu/tokenizer
export RAGCACHE_HOME=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"

if [ -z "${OVERLAP_ONLY:-}" ]; then  # OVERLAP_ONLY=1: step 3 alone
  timeout "${PYTEST_S:-300}" python3 -m pytest -q -rfE -p no:cacheprovider -o addopts= --timeout 120 \
    -m "not model and not slow" -k "not redis" \
    ${TESTS:-tests/engine tests/cache tests/model tests/server/test_app.py tests/integrations/vllm/test_connector_parts.py tests/integrations/vllm/test_connector_copies.py} \
    --ignore tests/model/test_grammar.py --ignore tests/model/test_openmp.py --ignore tests/cache/test_remote.py --ignore tests/engine/test_remote_tier.py \
    --deselect tests/model/test_model_loader.py::test_choose_dtype_names_and_auto \
    --deselect "tests/server/test_app.py::test_serve_options_checked_before_loading[argv6-two models given]" \
    --deselect tests/server/test_app.py::test_embeddings_are_the_retrieval_embedders \
    --deselect tests/engine/test_pipelining.py::test_ask_pipelined_equals_ask_on_a_real_store \
    --deselect tests/server/test_app.py::test_version \
    --deselect tests/cache/test_engine_free.py::test_a_restart_cut_at_the_host_budget_asks_no_remote_tier_for_what_the_disk_holds \
    --junitxml "$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.log" | tail -120
  echo "pytest exit: ${PIPESTATUS[0]}"

  timeout "${ENGINE_S:-180}" python3 benchmarks/gpu_engine_check.py --config .gpu/smollm2-config --tokenizer .gpu/tokenizer \
    --out "$OUT/engine.json" --profile-dir "${PROFILE_DIR:-$OUT}" 2>&1 | tail -60
  echo "engine check exit: ${PIPESTATUS[0]}"
fi

[ -n "${NO_OVERLAP:-}" ] && exit 0
BASE=""
[ -f .gpu/base/worker.py ] && BASE="--base-file .gpu/base/worker.py"
for args in "--shape llama3-8b --cached-tokens 4096 --new-tokens 64" "--shape llama3-8b --cached-tokens 4096 --new-tokens 256" "--shape llama3-8b --cached-tokens 2048 --new-tokens 1024" \
            "--shape smollm2-135m --cached-tokens 2048 --new-tokens 128"; do
  name=$(echo "$args" | tr -s ' -' '_' | sed 's/^_//')
  timeout "${OVERLAP_S:-120}" python3 benchmarks/connector_overlap.py $args $BASE --json "$OUT/overlap_$name.json" 2>&1 | tail -45
  echo "connector overlap ($args) exit: ${PIPESTATUS[0]}"
done
