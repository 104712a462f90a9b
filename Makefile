# Two commands for a fresh machine (see README):
#   make demo   -- set up .venv, build the real MiniLM-L6 sentiment model, compile it, run it on movie-test
#   make test   -- set up .venv and run the test suite (what CI runs)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
EXTRAS  ?= cpu,export,dev
export PIP_DISABLE_PIP_VERSION_CHECK=1

.PHONY: setup test test-slow demo lint clean

$(BIN)/dyncompile: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: 2.13.0 is a local CPU build on these machines (a bare `torch` pulls GBs of CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(BIN)/dyncompile

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

demo: setup
	$(BIN)/python -m dyncompile.tools.demo

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
