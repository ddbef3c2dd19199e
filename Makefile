# `make demo` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS := dev,docs,mooncake,nixl,metrics,tracing
# Debian packages (installed when missing and we are root): the libraries the Mooncake wheel
# links against, and iproute2, whose `ip netns` the cross-namespace transfer test needs.
SYSLIBS := libibverbs1 librdmacm1 libnuma1 iproute2

.PHONY: demo test lint typecheck docs unit bench mutation dist setup sysdeps clean

# The main job: a verified P=4 -> D=2 staged transfer across processes (NIXL by default).
demo: $(STAMP)
	$(VENV)/bin/staging-contracts demo

test: $(STAMP) lint typecheck docs unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml) into build/site; strict: any warning fails the build.
# NO_MKDOCS_2_WARNING silences Material's notice about MkDocs 2, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

unit: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(VENV)/bin/staging-contracts bench

# Mutation testing of the core modules (minutes; not part of `make test`). See docs/testing.md.
mutation: $(STAMP)
	$(PY) -m pip install -q 'mutmut>=3.8,<4'
	$(PY) scripts/mutation.py $(MODULES)

# The sdist and the wheel into dist/, checked as an index would (the tests build and check
# their own copies: tests/test_packaging.py).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(MAKE) sysdeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77'
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

sysdeps:
	@missing=""; for p in $(SYSLIBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
		echo "note:$$missing missing and not root: the tests that need them will be skipped"; \
	fi

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis .mutation mutants
