# Two commands for a fresh machine (see README):
#   make demo   -- set up .venv, build the real MiniLM-L6 sentiment model, compile it, run it on movie-test
#   make test   -- set up .venv and run the test suite (what CI runs)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The OpenVINO flavour of ONNX Runtime clobbers the CPU one: it gets its own environment.
OV_VENV ?= .venv-openvino
OV_BIN  := $(OV_VENV)/bin
# Optimum's ONNX exporter (optimum-onnx) needs transformers<4.58, the export extra transformers>=5: its own
# environment, which `dyncompile export --exporter optimum` runs as a subprocess (tests/test_optimum_exports.py).
OPT_VENV ?= .venv-optimum
OPT_BIN  := $(OPT_VENV)/bin
# Files whose tests run again with provider="openvino" (runtime, early exit, speculative decoding, native OpenVINO,
# the OpenVINO + NNCF encoder peers). Of them only the tests that take the `provider` fixture or carry the `openvino`
# mark run there (tests/conftest.py deselects the rest: they would repeat the CPU suite exactly).
OV_TESTS ?= tests/test_plan_runtime.py tests/test_insert_early_exit.py tests/test_learned_policy.py tests/test_early_exit_real.py tests/test_openvino_native.py \
	tests/test_speculative.py tests/test_diffusion_provider.py tests/test_encoder_peers.py
EXTRAS  ?= cpu,export,dev,sandbox,serve
# pytest-xdist workers, one test file per worker (module fixtures build each compiled plan once): 2 fits CI's two
# cores (the CPU suite took 26 min in one process, 18 in two, on a 2-core VM); 0 runs in one process
PYTEST_WORKERS ?= 2
PYTEST  := -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile
# With workers, torch (and numpy's BLAS) take one thread each: two workers on two cores each ran torch on two
# threads, which then waited for each other (tests/test_eagle.py and tests/test_analysis.py side by side, as two
# workers run them: 144 s and 94 s wall with the default threads, 105 s and 81 s with one). ONNX Runtime's pip
# builds size their own thread pools (intra_op_num_threads), not from OMP_NUM_THREADS.
PYTEST_ENV := $(if $(filter 0,$(PYTEST_WORKERS)),,OMP_NUM_THREADS=1)
# The OpenVINO subset is one file's sampling tests (test_speculative.py, cheap module fixtures) more than anything:
# one worker per file left the other idle for most of the run; worksteal splits the files' tests between the workers
# (on the 2-core VM: 270 s with loadfile, 144 s with worksteal, both after the deselection above)
OV_PYTEST := -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal
export PIP_DISABLE_PIP_VERSION_CHECK=1
# No bytecode at install time: pip would compile every .py of the three environments (~570 MB, torch's most of it);
# Python compiles only the modules a process imports, once, into __pycache__
PIP_FLAGS ?= --no-compile

.PHONY: setup setup-openvino setup-optimum test test-slow demo lint clean

$(BIN)/dyncompile: pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first: 2.13.0 is a local CPU build on these machines (a bare `torch` pulls GBs of CUDA)
	$(BIN)/pip install -q $(PIP_FLAGS) torch==2.13.0
	$(BIN)/pip install -q $(PIP_FLAGS) -e ".[$(EXTRAS)]"
	touch $@

$(OV_BIN)/dyncompile: pyproject.toml
	$(PY) -m venv $(OV_VENV)
	$(OV_BIN)/pip install -q $(PIP_FLAGS) -e ".[openvino,openvino-native,peers,dev]"
	touch $@

$(OPT_BIN)/optimum-cli: pyproject.toml
	$(PY) -m venv $(OPT_VENV)
	$(OPT_BIN)/pip install -q $(PIP_FLAGS) torch==2.13.0
	$(OPT_BIN)/pip install -q $(PIP_FLAGS) -e ".[optimum]"
	touch $@

setup: $(BIN)/dyncompile

setup-openvino: $(OV_BIN)/dyncompile

setup-optimum: $(OPT_BIN)/optimum-cli

# The three environments are set up side by side (3 jobs: 123 s instead of 201 s one after another on a 2-core VM);
# then the CPU suite (it builds the real models into the cache; it runs Optimum's exporter from .venv-optimum), then
# the OpenVINO subset.
test:
	$(MAKE) --no-print-directory -j3 setup setup-openvino setup-optimum
	$(PYTEST_ENV) $(BIN)/python $(PYTEST)
	DYNCOMPILE_TEST_PROVIDER=openvino $(OV_BIN)/python $(OV_PYTEST) $(OV_TESTS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

demo: setup
	$(BIN)/python -m dyncompile.tools.demo

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(OV_VENV) $(OPT_VENV) build *.egg-info .pytest_cache
