#!/usr/bin/env bash
# Create a virtual environment in the checkout and install scamp-jax into it.
#   scripts/setup.sh            runtime only (enough for the experiments on one host), in .venv
#   scripts/setup.sh test       + test tools, MPI (OpenMPI, mpi4py, mpi4jax), the PostgreSQL
#                               driver and, where pip has a CPU build of it, the PyTorch reference
#                               of the SwinIR parity tests, in .venv
#   scripts/setup.sh oldest     the oldest releases pyproject.toml declares
#                               (.ci/minimum-versions.txt) on the oldest Python it declares, with
#                               the test tools, MPI and that PyTorch reference, in .venv-oldest
# Python: $PYTHON if set; else the first of Python 3.12, 3.13, 3.14 found on PATH or under pyenv
# (JAX releases from 0.11 on need 3.12; CI runs 3.12), else python3. `oldest` takes Python 3.11.
# SCAMP_EXTRAS=a,b adds extras of pyproject.toml to what is installed.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
case "$mode" in
  run | test) VENV=".venv" ;;
  oldest) VENV=".venv-oldest" ;;
  *) echo "[setup] unknown mode '$mode': use run, test or oldest" >&2; exit 2 ;;
esac

# The interpreter for Python X.Y: pythonX.Y on PATH, else the newest pyenv X.Y.*; one that runs
# (a pyenv shim on PATH fails for a version that pyenv has but has not selected).
find_python() {
  local root="${PYENV_ROOT:-$HOME/.pyenv}" candidate
  for candidate in "$(command -v "python$1" || true)" \
      $(ls -d "$root"/versions/"$1".*/bin/python 2>/dev/null | sort -rV); do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys' >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"; why="from \$PYTHON"
elif [ "$mode" = "oldest" ]; then
  PY="$(find_python 3.11)" || {
    echo "[setup] the lower-bound run needs Python 3.11 (the oldest pyproject.toml declares):" \
      "install it (pyenv install 3.11) or name one with PYTHON=/path/to/python3.11" >&2
    exit 1
  }
  why="the oldest Python pyproject.toml declares"
else
  PY=""
  for version in 3.12 3.13 3.14; do
    PY="$(find_python "$version")" && break
  done
  if [ -n "$PY" ]; then
    why="Python 3.12+ gets the newest JAX"
  else
    PY="python3"
    why="no Python 3.12+ found: pip resolves jax 0.10 at most on Python 3.11"
  fi
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "[setup] $PY is not a Python 3.11+ (scamp-jax needs 3.11 or later; 3.12+ for the newest" \
    "JAX): install one, or name it with PYTHON=/path/to/python3.12" >&2
  exit 1
fi

if [ -x "$VENV/bin/python" ]; then
  echo "[setup] $VENV exists with $("$VENV/bin/python" --version) (remove it to start again)"
else
  echo "[setup] creating $VENV with $("$PY" --version)" \
    "($("$PY" -c 'import sys; print(sys.executable)'): $why)"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

# PyTorch only as the reference implementation in the SwinIR parity tests, and only where pip
# takes a CPU build: elsewhere (PyPI's Linux wheels for Python 3.12+) it is the CUDA build with
# several GB of nvidia-* packages, and the parity tests skip with a note.
install_torch() {
  local spec="torch==2.13.0" report
  report="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check --dry-run \
      --ignore-installed --report "$report" "$@" "$spec" >/dev/null 2>&1; then
    echo "[setup] pip cannot resolve $spec here: the SwinIR parity tests will say so" >&2
  elif "$VENV/bin/python" -c 'import json, sys
names = [i["metadata"]["name"] for i in json.load(open(sys.argv[1]))["install"]]
sys.exit(any(n.startswith("nvidia-") for n in names))' "$report"; then
    pip_install "$@" "$spec" \
      || echo "[setup] PyTorch could not be installed: the SwinIR parity tests will say so" >&2
  else
    echo "[setup] no CPU build of $spec for $("$VENV/bin/python" --version) here (PyPI's is the" \
      "CUDA build, several GB): not installed, so the SwinIR parity tests skip (CI runs them" \
      "in the lower-bound run); '$VENV/bin/pip install $spec' runs them here too" >&2
  fi
  rm -f "$report"
}

need_mpi() {
  if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
      echo "[setup] installing OpenMPI from Debian packages"
      apt-get update -q >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenmpi-dev openmpi-bin >/dev/null
    else
      echo "[setup] no MPI found: install OpenMPI (apt-get install libopenmpi-dev openmpi-bin)" \
        "and run again" >&2
      exit 1
    fi
  fi
}

constraints=()
case "$mode" in
  run) extras="" ;;
  test) need_mpi; extras="dev,mpi,postgres" ;;
  oldest) need_mpi; extras="dev,mpi"; constraints=(-c .ci/minimum-versions.txt) ;;
esac
if [ -n "${SCAMP_EXTRAS:-}" ]; then
  extras="${extras:+$extras,}$SCAMP_EXTRAS"
fi
target="."
[ -n "$extras" ] && target=".[$extras]"

stamp="$VENV/.installed-$mode-${extras:-none}"
if [ "$mode" = "run" ] && [ -z "$extras" ]; then
  # The package alone: any install of it with extras since pyproject.toml changed has it too
  # (make run after make test installs nothing, and needs no network).
  for other in "$VENV"/.installed-*; do
    if [ -f "$other" ] && [ ! pyproject.toml -nt "$other" ]; then stamp="$other"; break; fi
  done
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
    || { [ "$mode" = "oldest" ] && [ .ci/minimum-versions.txt -nt "$stamp" ]; }; then
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
  echo "[setup] installing scamp-jax $target into $VENV${constraints:+ with ${constraints[*]}}"
  env "${cuda_env[@]}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "${constraints[@]}" -e "$target"
  if [ "$mode" != "run" ]; then
    install_torch "${constraints[@]}"
  fi
  touch "$stamp"
fi
