"""Test setup: eight CPU devices before JAX initialises, Ctrl-C as Python sets it, the
project's markers, and a header line naming the Python and the releases of the stack under test."""

from __future__ import annotations

import os
import platform
import signal
from collections.abc import Iterator
from importlib import metadata

import pytest

# Must run before JAX initialises a backend: every test sees a pool of 8 CPU devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# The tests of Ctrl-C deliver SIGINT to this process: a shell that started it in the background
# (``cmd &`` without job control) had it ignored, and Python then leaves it ignored.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)



@pytest.fixture(autouse=True)
def _signal_handlers_as_they_were() -> Iterator[None]:
    """A command stopped in this process leaves SIGTERM ignored (its process is ending, and a
    scheduler's repeated SIGTERM must not kill it then): each test starts with the handlers
    the one before it found."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)


# The distributions whose releases decide whether the suite passes (see BUILD.md's install
# section); a missing optional one is reported as such.
_STACK = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "optuna", "numpy", "mpi4py",
          "mpi4jax", "torch")


def pytest_report_header() -> str:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    releases = ", ".join(f"{name} {version(name)}" for name in _STACK)
    return f"stack: Python {platform.python_version()}, {releases}"
