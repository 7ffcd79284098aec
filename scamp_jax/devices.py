"""Device set-up for entry points, before JAX initialises a backend.

Every entry point (the experiments' CLI, ``run_study``, the benchmarks, MPI ranks) goes through
`configure_device_memory`, directly or through `configure_cpu_devices` / `configure_for_search`:

- ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: JAX's GPU client otherwise reserves 75% of each GPU's
  memory when it starts, which leaves nothing for a second process on the same GPU (a parent that
  measures a child, two MPI ranks on one GPU) and hides what a trial really uses
  (``peak_bytes_in_use``). With preallocation off the allocator grows on demand up to its limit,
  ``memory_fraction`` of the device (XLA's default 0.75), and that limit is what the device
  reports as ``bytes_limit`` (`allocator_stats`): the planner's default budget per device. The
  allocator and the planner therefore agree on the budget whether or not a fraction is set.
- ``XLA_CLIENT_MEM_FRACTION`` only when a fraction is asked for (``memory_fraction=``).

A value the user already set in the environment is kept (``XLA_PYTHON_CLIENT_PREALLOCATE=true``
restores JAX's behaviour; ``XLA_CLIENT_MEM_FRACTION=0.9`` or the older
``XLA_PYTHON_CLIENT_MEM_FRACTION`` raises the limit, and with it the planner's budget). XLA reads
these variables once, when JAX creates its GPU backend; on CPU they have no effect.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

#: JAX's GPU client reads these when it creates the backend (``jaxlib.xla_client``).
PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
#: The older spelling JAX still reads (setting both is an error in JAX).
OLD_MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def configure_device_memory(memory_fraction: float | None = None) -> dict[str, str]:
    """Turn off GPU memory preallocation (and optionally cap the allocator) before JAX starts.

    Sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the environment already sets it, and,
    with ``memory_fraction``, ``XLA_CLIENT_MEM_FRACTION`` unless the environment already sets a
    fraction (either spelling). See the module docstring for why and how to override it.

    Args:
      memory_fraction: share of each GPU's memory the allocator may use, in (0, 1]; the planner's
        default budget per device follows it (``bytes_limit``). None: XLA's default (0.75).

    Returns:
      The memory variables now in the environment (name -> value), for logs and tests.
    """
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise ValueError(
            f"{memory_fraction=} must be in (0, 1]: the share of each GPU's memory JAX may use; "
            "e.g. 0.9, or None for XLA's default of 0.75"
        )
    os.environ.setdefault(PREALLOCATE_VAR, "false")
    user_fraction = MEM_FRACTION_VAR in os.environ or OLD_MEM_FRACTION_VAR in os.environ
    if memory_fraction is not None and not user_fraction:
        os.environ[MEM_FRACTION_VAR] = f"{memory_fraction:g}"
    names = (PREALLOCATE_VAR, MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR)
    return {name: os.environ[name] for name in names if name in os.environ}


def configure_cpu_devices(count: int = 8) -> None:
    """Make the host CPU appear as ``count`` JAX devices, and set GPU memory allocation.

    Must be called before JAX initialises a backend (before the first ``jax.devices()`` or array).
    The device count only affects the CPU platform: on a GPU machine JAX still picks the GPUs by
    default, with preallocation off (`configure_device_memory`).
    """
    if count < 1:
        raise ValueError(f"{count=} must be at least 1")
    configure_device_memory()
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

    Splits the CPU into ``cpu_devices`` JAX devices and turns off JAX's up-front reservation of
    75% of each GPU's memory, which would leave nothing for a second trial packed onto the same
    GPU (both through `configure_cpu_devices`, which calls `configure_device_memory`). A value the
    user already set is kept. Call before JAX initialises a backend.
    """
    configure_cpu_devices(cpu_devices)


#: Allocator statistics in bytes that `allocator_stats` always keeps where the backend reports
#: them (XLA's BFC allocator on GPUs). ``pool_bytes`` is what the allocator holds from the device
#: (with preallocation off it grows in regions and never shrinks), ``bytes_in_use`` what its live
#: buffers occupy, ``largest_free_block_bytes`` the largest request the pool can serve without
#: growing, ``bytes_limit`` its cap (device memory x the allocator's fraction).
ALLOCATOR_KEYS = ("bytes_in_use", "peak_bytes_in_use", "pool_bytes", "largest_free_block_bytes",
                  "bytes_limit")


def allocator_stats(device: Any) -> dict[str, int] | None:
    """The allocator's statistics of ``device`` now: name -> int, or None on CPU devices.

    The one reader of ``device.memory_stats()``: callers read it as
    ``scamp_jax.devices.allocator_stats`` at call time (not a copy bound at import), so that a
    single replacement (a test's fake device memory) reaches them all. Keeps every non-negative
    integer the backend reports (the backend writes -1 for a statistic it does not keep): on a
    GPU the `ALLOCATOR_KEYS` (bytes) and others such as ``peak_pool_bytes`` (bytes) and
    ``num_allocs`` (a count). None where the device reports no statistics (JAX's CPU devices).
    """
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
        return None
    kept = {str(k): int(v) for k, v in stats.items()
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
    return kept or None


def peak_bytes_in_use(devices: Sequence[Any] | None = None) -> int | None:
    """The largest ``peak_bytes_in_use`` over ``devices`` (default: all JAX devices), bytes.

    The allocator's high-water mark since the process started (it cannot be reset, so measure
    one thing per process). None where a device reports no memory statistics (CPU devices).
    """
    import jax

    peaks = []
    for device in devices if devices is not None else jax.devices():
        stats = allocator_stats(device)  # a module global: a replacement is seen here too
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def process_device_bytes(device_index: int = 0) -> int | None:
    """Bytes this process holds on GPU ``device_index`` as the driver sees them, or None.

    Read from ``nvidia-smi --query-compute-apps`` (CUDA context, allocator pool, library
    workspaces: everything, unlike `allocator_stats`). None without ``nvidia-smi`` or when the
    process is not listed (e.g. a container whose PIDs the driver does not see).
    """
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", str(device_index), "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            return int(parts[1]) << 20  # MiB
    return None
