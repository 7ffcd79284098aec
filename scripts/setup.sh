#!/usr/bin/env bash
# Create .venv in the checkout and install scamp-jax into it.
#   scripts/setup.sh            runtime only (enough for the experiments on one host)
#   scripts/setup.sh test       + test tools, MPI (OpenMPI, mpi4py, mpi4jax), the PostgreSQL
#                               driver and the PyTorch reference used by the SwinIR parity tests
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
PY="${PYTHON:-python3}"
VENV=".venv"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

extras="."
if [ "$mode" = "test" ]; then
  if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      echo "[setup] installing OpenMPI from Debian packages"
      apt-get update -q >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenmpi-dev openmpi-bin >/dev/null
    else
      echo "[setup] no MPI found: install OpenMPI (apt-get install libopenmpi-dev openmpi-bin) and run again" >&2
      exit 1
    fi
  fi
  extras=".[dev,mpi,postgres]"
fi

stamp="$VENV/.installed-$mode"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # mpi4jax takes dirname(nvcc)/.. as the CUDA root when an nvcc is on PATH; without CUDA
  # headers there its build fails. Point it at an empty directory to build the CPU extension.
  cuda_env=()
  if [ -z "${CUDA_PATH:-}" ] && [ -z "${CUDA_ROOT:-}" ]; then
    nvcc_path="$(command -v nvcc || true)"
    if [ -z "$nvcc_path" ] || [ ! -f "$(dirname "$nvcc_path")/../include/cuda_runtime_api.h" ]; then
      mkdir -p "$VENV/no-cuda"
      cuda_env=(CUDA_PATH="$PWD/$VENV/no-cuda")
    fi
  fi
  echo "[setup] installing scamp-jax $extras into $VENV"
  env "${cuda_env[@]}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$extras"
  if [ "$mode" = "test" ]; then
    # CPU PyTorch, only as the reference implementation in the SwinIR parity tests.
    pip_install "torch==2.13.0" \
      || echo "[setup] PyTorch could not be installed: the SwinIR parity tests will say so" >&2
  fi
  touch "$stamp"
fi
