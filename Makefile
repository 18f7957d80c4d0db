# kvwire: the README's two commands.
#   make demo   set up, then `kvwire check` and `kvwire bench` (the main job) on mooncake and on nixl, a plot each
#   make test      set up, then the default suite (every fast test, in parallel), ruff and mypy: minutes
#   make test-all  set up, then the slow tests (real engines across processes, fresh venvs, wheels)
#   make docs   the API reference from the docstrings (pdoc) into build/api/
#   make dist   an sdist and a wheel of every distribution (core/, plugins/*/, hosts/*/) into dist/
# Set-up is idempotent and quick when already done (stamp files).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
SYSLIBS := libibverbs.so.1 libnuma.so.1 libcurl.so.4
APT_PKGS := libibverbs1 libnuma1 libcurl4
TORCH_WHEELS := /opt/wheels/torch-2.13.0+cpu-cp$(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')-*.whl
DEV_DEPS := "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5" "hypothesis>=6.100" "ruff>=0.6" "mypy>=1.10" "setuptools>=77" "wheel" "build>=1.2" \
	"prometheus_client>=0.17" "matplotlib>=3.7" "pdoc>=15"
# Every distribution: the core and each plugin with a pyproject.toml (a new plugin is picked up by setup and dist).
PLUGIN_DIRS := $(patsubst %/pyproject.toml,%,$(sort $(wildcard plugins/*/pyproject.toml)))
# Host integrations (hosts/<host>/): distributions that plug kvwire into a serving engine.
HOST_DIRS := $(patsubst %/pyproject.toml,%,$(sort $(wildcard hosts/*/pyproject.toml)))
DIST_DIRS := core $(PLUGIN_DIRS) $(HOST_DIRS)
DISTS  := $(addsuffix /pyproject.toml,$(DIST_DIRS))
# Editable installs: plugins without extras (no torch, no NIXL wheel), but mooncake with its CPU engine wheel.
EDITABLES := $(foreach d,$(DIST_DIRS),-e "$(d)$(if $(filter plugins/mooncake,$(d)),[cpu])")

.PHONY: setup demo test test-all bench lint typecheck syspkgs dist docs clean

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "kvwire needs Python >= 3.10")'
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

syspkgs:
	@missing=""; for lib in $(SYSLIBS); do ldconfig -p | grep -q "$$lib" || missing="$$missing $$lib"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing system packages for the Mooncake engine (missing:$$missing)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PKGS) >/dev/null; \
	  else \
	    echo "missing system libraries:$$missing -- run as root: apt-get update && apt-get install -y $(APT_PKGS)"; \
	  fi; \
	fi

$(VENV)/.stamp-install: $(PY) $(DISTS) Makefile
	$(PIP) install --quiet $(DEV_DEPS)
	$(PIP) install --quiet $(EDITABLES)
	@# torch is optional for kvwire; install the CPU build only from local disk (any other torch is GBs of CUDA)
	@if ls $(TORCH_WHEELS) >/dev/null 2>&1; then $(PIP) install --quiet $$(ls $(TORCH_WHEELS) | head -n 1); \
	  else echo "no local CPU torch wheel ($(TORCH_WHEELS)): torch-tensor tests will be skipped"; fi
	@# kvwire-nixl's engine, without its deps: its unpinned `torch` would pull a CUDA build (see plugins/nixl/README.md)
	$(PIP) install --quiet --no-deps "nixl-cu12>=1.5.1,<1.6"
	@touch $@

setup: syspkgs $(VENV)/.stamp-install

# The installed transports side by side on the same job (each against its raw engine call), a plot each.
demo: setup
	$(VENV)/bin/kvwire check
	$(VENV)/bin/kvwire bench --backend mooncake --preset llama3-8b --requests 8 --tokens 4096 --compare-raw --compare-uncoalesced --plot demo-mooncake.png
	$(VENV)/bin/kvwire bench --backend nixl --preset llama3-8b --requests 8 --tokens 4096 --compare-raw --plot demo-nixl.png

# The API reference, generated from the docstrings (pdoc), into build/api/ (open build/api/index.html).
# Every warning is an error: a docstring pdoc cannot render fails the build.
DOC_MODULES := kvwire kvwire.submit kvwire.transport kvwire.planning kvwire.layout kvwire.landing kvwire.spec kvwire.metrics \
	kvwire.testing kvwire.lint kvwire_sglang \
	kvwire.hosts.vllm.layout kvwire.hosts.vllm.settings kvwire.hosts.vllm.params kvwire.hosts.vllm.registration
docs: setup
	rm -rf build/api
	$(PY) -W error -m pdoc --docformat restructuredtext $(DOC_MODULES) -o build/api
	@echo "API reference: build/api/index.html"

# One pytest worker per core (-n auto); the slow marker is the only split (see pyproject.toml).
PYTEST := $(PY) -m pytest -n auto -p no:cacheprovider

test: setup
	$(PYTEST) -m "not slow" tests
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# --dist loadgroup: tests marked with one xdist_group (a deployment of real servers) run on one worker, in order.
test-all: setup
	$(PYTEST) --dist loadgroup -m slow tests

bench: setup
	$(PY) bench/planning.py
	$(PY) bench/validation.py

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Each distribution's sdist, then its wheel built from that sdist (python -m build), into dist/: a file missing
# from an sdist fails here, not on a user's machine. No build isolation: the venv's setuptools builds (offline).
# In-tree builds leave build/ dirs whose stale files would end up in the next wheel: start from none.
dist: $(PY)
	$(PIP) install --quiet "setuptools>=77" wheel "build>=1.2"
	rm -rf dist $(addsuffix /build,$(DIST_DIRS))
	@set -e; for d in $(DIST_DIRS); do echo "building $$d"; $(PY) -m build --quiet --no-isolation --outdir dist "$$d" >/dev/null; done
	rm -rf $(addsuffix /build,$(DIST_DIRS))
	@ls -1 dist

clean:
	rm -rf $(VENV) build dist .mypy_cache .ruff_cache .pytest_cache .hypothesis $(addsuffix /build,$(DIST_DIRS))
	find . -name __pycache__ -prune -exec rm -rf {} +
	find . -name '*.egg-info' -prune -exec rm -rf {} +
