# Two entry points for a fresh machine; both create .venv in the checkout first
# (scripts/setup.sh: Python 3.12+ when one is installed).
.PHONY: run test test-all test-oldest lint docs

run:
	scripts/setup.sh run
	.venv/bin/python -m experiments.swinir_hpo

# Tests run in TEST_WORKERS processes (pytest-xdist; each test in one of them, whole, so the
# tests that start processes of their own or send signals run as they do alone); 1: in this one.
TEST_WORKERS ?= 2
PYTEST_WORKERS = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

test:
	scripts/setup.sh test
	.venv/bin/python -m pytest $(PYTEST_WORKERS)

test-all:
	scripts/setup.sh test
	.venv/bin/python -m pytest $(PYTEST_WORKERS) -m "not gpu"

# The lower-bound run: the oldest releases pyproject.toml declares (.ci/minimum-versions.txt) on
# Python 3.11, in .venv-oldest, through the planner, memory, runner, CSP, study-storage and MPI
# tests, the initial states' compile (its cheaper CPU options keep values there), the SwinIR
# parity tests (PyTorch's CPU build is installable there) and the SR patches and fused groups'
# data (one NumPy call of bounded draws equals the scalar calls on the oldest NumPy too).
LOWER_BOUND_TESTS = tests/test_planner.py tests/test_memory.py tests/test_runner.py \
	tests/test_csp.py tests/test_study.py tests/test_mpi_local.py tests/test_mpi_runs.py \
	tests/test_reuse.py tests/test_host_init.py tests/test_swinir_parity.py tests/test_packaging.py \
	tests/test_sr_data.py tests/test_member_streams.py
test-oldest:
	scripts/setup.sh oldest
	.venv-oldest/bin/python -m pytest $(PYTEST_WORKERS) $(LOWER_BOUND_TESTS)

lint:
	.venv/bin/ruff check scamp_jax search_spaces experiments benchmarks tests examples
	.venv/bin/mypy scamp_jax search_spaces experiments benchmarks examples

# API reference from the docstrings (pdoc) in docs/api/; any pdoc warning fails the build.
PDOC_MODULES = scamp_jax scamp_jax.planning scamp_jax.scheduling scamp_jax.hpo scamp_jax.sim scamp_jax.pipeline scamp_jax.distributed
docs:
	scripts/setup.sh run
	.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[docs]"
	@mkdir -p docs/api
	.venv/bin/python -m pdoc --docformat google -o docs/api $(PDOC_MODULES) 2> docs/api/warnings.txt; \
	  status=$$?; cat docs/api/warnings.txt >&2; \
	  test $$status -eq 0 && test ! -s docs/api/warnings.txt
