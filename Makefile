# Two commands on a fresh machine: `make demo` and `make test`.
# Each bootstraps .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainwatch demo

test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check watchdog faultinject tests benchmarks

# watchdog/ is imported as trainwatch: give mypy that name through a link.
typecheck: $(STAMP)
	mkdir -p build/mypy && ln -sfn ../../watchdog build/mypy/trainwatch
	MYPYPATH=build/mypy $(BIN)/mypy -p trainwatch -p faultinject

unit: $(STAMP)
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
