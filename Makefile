# Two entry points for a fresh machine; both create .venv in the checkout first.
.PHONY: run test test-all lint

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
	.venv/bin/ruff check scamp_jax search_spaces experiments benchmarks tests
