# Two entry points for a fresh machine; both create .venv in the checkout first.
.PHONY: run test test-all lint docs

run:
	scripts/setup.sh run
	.venv/bin/python -m experiments.swinir_hpo

test:
	scripts/setup.sh test
	.venv/bin/python -m pytest

test-all:
	scripts/setup.sh test
	.venv/bin/python -m pytest -m "not gpu"

lint:
	.venv/bin/ruff check scamp_jax search_spaces experiments benchmarks tests examples

# API reference from the docstrings (pdoc) in docs/api/; any pdoc warning fails the build.
PDOC_MODULES = scamp_jax scamp_jax.planning scamp_jax.scheduling scamp_jax.hpo scamp_jax.sim scamp_jax.pipeline scamp_jax.distributed
docs:
	scripts/setup.sh run
	.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[docs]"
	@mkdir -p docs/api
	.venv/bin/python -m pdoc --docformat google -o docs/api $(PDOC_MODULES) 2> docs/api/warnings.txt; \
	  status=$$?; cat docs/api/warnings.txt >&2; \
	  test $$status -eq 0 && test ! -s docs/api/warnings.txt
