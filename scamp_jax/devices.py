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


def configure_for_search(cpu_devices: int = 8) -> None:
    """Environment for an entry point that runs several trials per device.

    Splits the CPU into ``cpu_devices`` JAX devices (see `configure_cpu_devices`) and turns off
    JAX's up-front reservation of 75% of each GPU's memory (``XLA_PYTHON_CLIENT_PREALLOCATE``),
    which would leave nothing for a second trial packed onto the same GPU. A value the user already
    set is kept. Call before JAX initialises a backend.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    configure_cpu_devices(cpu_devices)
