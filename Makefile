# The README's two commands are `make demo` and `make test`; both bootstrap what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_CPU := torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-all protos check-protos lint servers venv clean images compose-up compose-down compose-smoke podman-setup

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing policyloop into $(VENV) (log: $(VENV)/install.log)"
	@$(PIP) install -q --upgrade pip > $(VENV)/install.log 2>&1 || { tail -40 $(VENV)/install.log; exit 1; }
	@# Without a GPU, take the CPU wheel first so that nothing pulls a multi-GB CUDA build.
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(PY) -c "import torch" 2>/dev/null; then \
		$(PIP) install $(TORCH_CPU) >> $(VENV)/install.log 2>&1 || { tail -40 $(VENV)/install.log; exit 1; }; \
	fi
	@$(PIP) install -e '.[all,dev]' >> $(VENV)/install.log 2>&1 || { tail -40 $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

# What the tests and `policyloop up` need from the system: nats-server and redis-server (they
# start their own), bubblewrap (the sandbox isolates jobs with bwrap) and docker-compose (to
# validate compose.yaml), prometheus and promtool (`up` runs Prometheus; tests check the alert rules).
# Installed with apt where missing and possible.
SYSTEM_TOOLS := nats-server:nats-server redis-server:redis-server bwrap:bubblewrap docker-compose:docker-compose \
	prometheus:prometheus promtool:prometheus
servers:
	@missing=""; \
	for pair in $(SYSTEM_TOOLS); do \
		bin=$${pair%%:*}; pkg=$${pair##*:}; \
		command -v $$bin >/dev/null 2>&1 || test -x /usr/sbin/$$bin || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "installing$$missing with apt-get"; \
			apt-get install -y -q --no-install-recommends $$missing >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $$missing >/dev/null; }; \
		else \
			echo "policyloop needs$$missing: install them (Debian/Ubuntu: sudo apt-get install$$missing)"; \
			exit 1; \
		fi; \
	fi

demo: $(STAMP) servers
	$(VENV)/bin/policyloop demo

test: $(STAMP) servers
	$(PY) -m pytest $(PYTEST_ARGS)

# Everything, slow tests included.
test-all: $(STAMP) servers
	$(PY) -m pytest -m '' $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) -m policyloop.contracts.generate

check-protos: $(STAMP)
	$(PY) -m policyloop.contracts.generate --check

lint: $(STAMP)
	$(VENV)/bin/ruff check libs services tests perf

# Containers (docs/deploy.md). `images` builds with docker, or podman where no Docker engine runs;
# TORCH_VARIANT=cuda builds the CUDA torch image; IMAGE_PREFIX=registry/path/ names them for a push.
images:
	docker/build-images.sh

# A host without a Docker engine: rootful podman, its settings, debootstrap (root; Debian/Ubuntu).
podman-setup:
	docker/setup-podman.sh

compose-up:
	docker/compose.sh up -d --no-build

compose-down:
	docker/compose.sh down --volumes --remove-orphans

# Brings the compose cluster up, trains, kills, scales, audits and tears down (several minutes).
compose-smoke: $(STAMP)
	$(PY) perf/compose_smoke.py

clean:
	rm -rf $(VENV) runs .pytest_cache
