"""Test setup: eight CPU devices before JAX initialises, and the project's markers."""

from __future__ import annotations

import os

# Must run before JAX initialises a backend: every test sees a pool of 8 CPU devices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
