# Two commands on a fresh machine: `make demo` and `make test`.
# Each bootstraps .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck tools unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainwatch demo

test: lint typecheck tools unit

# The integration binaries: a real Prometheus and promtool (Debian package
# prometheus). Installed here when missing and we may; the tests fail in CI without them.
tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends prometheus \
	  || echo "could not install prometheus: its tests fail in CI, skip elsewhere"; }

lint: $(STAMP)
	$(BIN)/ruff check watchdog faultinject tests benchmarks grafana

# watchdog/ is imported as trainwatch: give mypy that name through a link.
typecheck: $(STAMP)
	mkdir -p build/mypy && ln -sfn ../../watchdog build/mypy/trainwatch
	MYPYPATH=build/mypy $(BIN)/mypy -p trainwatch -p faultinject
	$(BIN)/mypy --strict --python-version 3.11 grafana/dashboards.py

unit: $(STAMP)
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
