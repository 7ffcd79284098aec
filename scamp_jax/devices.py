"""Device set-up for entry points: split the CPU into N JAX devices before JAX initialises."""

from __future__ import annotations

import os
import sys


def configure_cpu_devices(count: int = 8) -> None:
    """Make the host CPU appear as ``count`` JAX devices.

    Must be called before JAX initialises a backend (before the first ``jax.devices()`` or array).
    It only affects the CPU platform: on a GPU machine JAX still picks the GPUs by default.
    """
    if count < 1:
        raise ValueError(f"{count=} must be at least 1")
    if "jax" in sys.modules:
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError as err:  # backend already initialised
            raise RuntimeError(
                "configure_cpu_devices() must run before JAX initialises a backend; call it at the "
                "top of your entry point, before creating arrays or calling jax.devices()"
            ) from err
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
