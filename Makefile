# Two commands on a fresh machine: `make demo` and `make test`.
# Each bootstraps .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check
# The demo needs trainwatch and its runtime only (numpy for the bundled trainer); the
# tests add torch, transformers, lightning, moto and the tools (minutes of pip).
DEMO_STAMP := $(VENV)/.demo
STAMP      := $(VENV)/.installed

.PHONY: demo test lint typecheck tools unit bench clean

$(DEMO_STAMP): pyproject.toml
	@echo "setting up .venv for the demo: trainwatch and its runtime (psutil, PyYAML, numpy, prometheus-client, APScheduler, nvidia-ml-py, xxhash)"
	@$(PYTHON) -m venv $(VENV)
	@$(PIP) -e .
	@touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) pyproject.toml
	@pkg-config --exists libsystemd 2>/dev/null && command -v gcc >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    gcc python3-dev libsystemd-dev pkg-config \
	  || echo "could not install systemd-python's build dependencies"; }
	@echo "setting up .venv for the tests: torch, transformers, lightning, moto, ruff, mypy and the rest of the dev extra (minutes on a fresh machine)"
	$(PIP) --upgrade pip
	$(PIP) -e '.[dev]'
	# NVIDIA's ft_launcher, for the goodput drill (benchmarks/goodput.py) and its tests. Without
	# its dependencies: it asks for the deprecated `pynvml` distribution, whose import hook warns
	# on every `import pynvml`; nvidia-ml-py (already here) is the module it imports.
	$(PIP) --no-deps 'nvidia-resiliency-ext==0.4.1'
	touch $(STAMP)

demo: $(DEMO_STAMP)
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

# Four processes, each test file whole in one (its module fixtures and order kept);
# tests that add users or groups take a lock (conftest.accounts).
# build/unit.xml: which tests failed, for CI's one rerun of them (.ci/rerun.py).
unit: $(STAMP)
	mkdir -p build
	$(BIN)/pytest -q -n 4 --dist loadfile --durations=15 --junitxml=build/unit.xml

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# `make install [PREFIX=/usr/local] [DESTDIR=/tmp/pkgroot]`, as root for a real install:
# a private venv at $(PREFIX)/lib/trainwatch (pip install '.[systemd]', not editable),
# $(PREFIX)/bin/trainwatch and faultinject linked into it, the systemd unit, sysusers
# and tmpfiles snippets, and /etc/trainwatch/trainwatch.yaml unless one exists.
# systemd looks for vendor files under /usr/lib; /usr/local/lib/systemd/system is not
# searched on every distribution, so any other PREFIX installs them under /etc.
PREFIX ?= /usr/local
TW_LIB := $(PREFIX)/lib/trainwatch
ifeq ($(PREFIX),/usr)
TW_SYSTEMD := /usr/lib
else
TW_SYSTEMD := /etc
endif

.PHONY: install install-venv install-files
install: install-venv install-files
	@if [ -z '$(DESTDIR)' ] && [ -d /run/systemd/system ]; then \
	  systemd-sysusers trainwatch.conf && systemd-tmpfiles --create trainwatch.conf && \
	  systemctl daemon-reload && \
	  echo "next: add jobs to /etc/trainwatch/trainwatch.yaml, then systemctl enable --now trainwatch"; \
	fi

# With DESTDIR the venv is built in place and then relocated: every DESTDIR path that
# venv and pip wrote (script shebangs, activate, pyvenv.cfg, .pyc source names) is
# rewritten to the final one. The interpreter it links to must exist on the target.
install-venv:
	@set -eu; root='$(DESTDIR)'; venv="$$root$(TW_LIB)"; \
	echo "installing trainwatch's venv at $$venv"; \
	$(PYTHON) -m venv "$$venv"; \
	rm -rf build/lib build/bdist.*; : "setuptools reuses these; a module moved away would linger"; \
	pip="$$venv/bin/python -m pip install -q --disable-pip-version-check --upgrade"; \
	if [ -n "$$root" ]; then pip="$$pip --no-compile"; fi; \
	log=$$(mktemp); \
	if $$pip '.[systemd]' >"$$log" 2>&1; then rm -f "$$log"; else \
	  echo "warning: systemd-python did not build (it needs gcc, python3-dev, libsystemd-dev" \
	       "and pkg-config; pip said why in $$log). The daemon will still start under" \
	       "Type=notify: it sends READY=1 through its own minimal sd_notify sender, and logs" \
	       "without journald fields. Install those packages and run make install again for" \
	       "systemd-python." >&2; \
	  $$pip . ; fi; \
	$$pip 'py-spy>=0.4' || echo "warning: py-spy did not install: incidents keep no stacks" >&2; \
	$$pip '.[snapshot]' || echo "warning: zstandard/s3fs did not install: no pull of snapshots from a remote store" >&2; \
	if [ -n "$$root" ]; then \
	  grep -rlIF "$$venv" "$$venv/bin" "$$venv/pyvenv.cfg" | xargs -r sed -i "s|$$venv|$(TW_LIB)|g"; \
	  "$$venv/bin/python" -m compileall -q -f -s "$$root" -p / "$$venv/lib"; \
	fi

install-files:
	@set -eu; root='$(DESTDIR)'; sd="$$root$(TW_SYSTEMD)"; \
	install -d "$$root$(PREFIX)/bin" "$$sd/systemd/system"; \
	for s in trainwatch faultinject; do ln -sfn "../lib/trainwatch/bin/$$s" "$$root$(PREFIX)/bin/$$s"; done; \
	sed 's|@PREFIX@|$(PREFIX)|g' systemd/trainwatch.service > "$$sd/systemd/system/trainwatch.service"; \
	chmod 0644 "$$sd/systemd/system/trainwatch.service"; \
	install -D -m 0644 systemd/trainwatch.sysusers "$$sd/sysusers.d/trainwatch.conf"; \
	install -D -m 0644 systemd/trainwatch.tmpfiles "$$sd/tmpfiles.d/trainwatch.conf"; \
	if [ -e "$$root/etc/trainwatch/trainwatch.yaml" ]; then \
	  echo "kept the existing $$root/etc/trainwatch/trainwatch.yaml"; \
	else install -D -m 0644 config/default.yaml "$$root/etc/trainwatch/trainwatch.yaml"; fi
