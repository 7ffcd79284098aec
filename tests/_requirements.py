"""Optional test requirements: skip on a developer's machine that lacks them, fail in CI.

CI (``CI=true``) installs everything the suite needs (`scripts/setup.sh test`), so a missing
requirement there is a broken set-up, not a reason to skip.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest


def in_ci() -> bool:
    """True when running under CI (``CI`` set to a true value)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip the current test with ``reason``, or fail it under CI."""
    if in_ci():
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str) -> ModuleType:
    """Import ``name`` or skip (fail under CI) with ``reason``."""
    try:
        return importlib.import_module(name)
    except ImportError:
        unavailable(reason)
        raise


def shared_data(name: str) -> Path:
    """The data set ``name`` (a directory) in ``$SCAMP_DATA``, else in ``shared/data`` beside the
    checkout; skips the test where it is absent, in CI too (a data set is not a package that the
    CI set-up installs: a fresh clone elsewhere has none)."""
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    root = Path(os.environ.get("SCAMP_DATA", beside))
    path = root / name
    if not path.is_dir():
        pytest.skip(f"{name} not found at {path}: set SCAMP_DATA to the folder that holds it")
    return path


def without_gpu_driver() -> None:
    """Skip where a GPU driver loads (``libcuda.so.1``): JAX starts its GPU backend as usual
    there, so a test of what happens without one has nothing to check."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    pytest.skip("a GPU driver loads here: JAX starts its GPU backend as usual")


def fresh_python(script: str, timeout: float,
                 **variables: str) -> subprocess.CompletedProcess[str]:
    """``python -c script`` in the checkout as a user's own process starts it: no
    ``JAX_PLATFORMS`` or ``XLA_FLAGS`` of the test run (unless ``variables`` set them), the
    project on ``PYTHONPATH``."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(root)
    env.update(variables)
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)
