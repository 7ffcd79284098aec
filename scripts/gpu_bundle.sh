#!/usr/bin/env bash
# Put in DIR what a bare GPU machine needs to run the GPU suite with no network:
#   DIR/wheels/   wheels (Python 3.12, manylinux x86-64) of what its image lacks: Optuna and its
#                 dependencies (SQLAlchemy, alembic, Mako, MarkupSafe, colorlog, tqdm) and
#                 pytest-timeout (the project's pytest settings name its option)
#   DIR/project/  the project at HEAD (git archive), DIR/PROJECT_COMMIT its commit
#   DIR/run.sh    the one command: bash DIR/run.sh OUT [suite flags, e.g. --minutes 9]
#                 installs the wheels into DIR/site (pip --no-index --target), runs
#                 python -m benchmarks.gpu_suite, and leaves in OUT gpu_suite.tar.gz (every
#                 result, at most 16 MiB), gpu_suite.json, gpu_suite.md and run.log.
# The image is expected to have Python 3.12, jax with its CUDA plugin, flax >= 0.12.12, optax,
# orbax-checkpoint, chex, scikit-image, scikit-learn, matplotlib, rich and pytest.
#
#   scripts/gpu_bundle.sh .gpu_bundle        # inside the checkout: ignored by git (.gitignore)
#
# then, with the device tool: carry [".gpu_bundle"], command: bash .gpu_bundle/run.sh "$OUT"
set -euo pipefail
DIR="${1:?usage: scripts/gpu_bundle.sh DIR (e.g. .gpu_bundle)}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
LIMIT_MIB=60
# Pinned to what the project is tested with (the shared environment's versions).
WHEELS=(optuna==5.0.0 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 MarkupSafe==3.0.4
        colorlog==6.12.0 tqdm==4.70.1 pytest-timeout==2.4.0)

rm -rf "$DIR"
mkdir -p "$DIR/wheels" "$DIR/project"
DIR="$(cd "$DIR" && pwd)"
echo "[gpu_bundle] wheels for CPython 3.12 manylinux x86-64 -> $DIR/wheels"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR/wheels" "${WHEELS[@]}"

echo "[gpu_bundle] project at $(git -C "$ROOT" rev-parse --short HEAD) -> $DIR/project"
if [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no)" ]; then
  echo "[gpu_bundle] note: uncommitted changes are not in the bundle (it takes HEAD)" >&2
fi
git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$DIR/project"
git -C "$ROOT" rev-parse HEAD > "$DIR/PROJECT_COMMIT"

cat > "$DIR/run.sh" <<'EOF'
#!/usr/bin/env bash
# bash run.sh OUT [suite flags]: install the wheels beside this script (no network) and run
# python -m benchmarks.gpu_suite (default 9 minutes); results in OUT.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${1:?usage: bash run.sh OUT [--minutes 9] [--cpu-smoke] ...}"; shift
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PIP_NO_INDEX=1
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$HERE/site" "$HERE"/wheels/*.whl || exit 1
export PYTHONPATH="$HERE/project:$HERE/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MPI4JAX_NO_WARN_JAX_VERSION=1
cd "$HERE/project"
"$PY" -m benchmarks.gpu_suite --out "${GPU_SUITE_DIR:-/tmp/gpu_suite}" \
  --archive "$OUT/gpu_suite.tar.gz" "$@" 2>&1 | tee "$OUT/run.log"
EOF
chmod +x "$DIR/run.sh"

size_kib=$(du -sk "$DIR" | cut -f1)
echo "[gpu_bundle] $DIR: $((size_kib / 1024)) MiB ($size_kib KiB)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "[gpu_bundle] $DIR is $size_kib KiB, over the ${LIMIT_MIB} MiB a device call carries;" \
       "leave out the largest wheels or the project's data" >&2
  exit 1
fi
echo "[gpu_bundle] run there: bash $DIR/run.sh OUT   (e.g. OUT=\$OUT with the device tool)"
