"""Device set-up for entry points, before JAX initialises a backend.

Every entry point (the experiments' CLI, ``run_study``, the benchmarks, MPI ranks) goes through
`configure_device_memory`, directly or through `configure_cpu_devices` / `configure_for_search`.
It sets XLA's GPU allocator so that a plan whose compiled peak fits the ledger's usable bytes
does not run out of memory (the allocator policy). What XLA does, from its source
(openxla/xla, ``xla/tsl/framework/bfc_allocator.cc``, ``xla/pjrt/gpu/gpu_helpers.cc``; the
variables are read by ``generate_pjrt_gpu_plugin_options`` in jaxlib's ``xla_client.py``):

- The limit of the BFC allocator is ``total_memory * memory_fraction`` of the device
  (``CreateBFCAllocator``: ``allocator_memory = total_memory * memory_fraction``), and
  ``opts.allow_growth = !preallocate``.
- With growth (preallocation off), the pool is built from regions: the first 2 MiB
  (``curr_region_allocation_bytes_ = RoundedBytes(std::min(total_memory, size_t{2 << 20}))``),
  each next one twice as large and at least the request (``Extend``: ``while (rounded_bytes >
  curr_region_allocation_bytes_) curr_region_allocation_bytes_ *= 2``). Regions are never
  merged (the device allocator does not coalesce) nor returned (``DeallocateFreeRegions`` only
  with ``garbage_collection``, off by default), and one allocation must fit inside one region:
  a 410 MiB step buffer needs a new region of 512 MiB or more beside the ones already held, so a
  limit equal to the compiled peak fails (the MLP of the first GPU run: planned 471 MB, pool
  1.08 GB, out of memory at a 512 MiB limit).
- With preallocation the first allocation asks for the whole limit as one region
  (``curr_region_allocation_bytes_ = RoundedBytes(total_memory)``): every chunk is cut from it,
  and freed neighbours merge again. What is left is the chunk rounding: a free chunk less than
  twice and less than 128 MiB larger than a request is handed out whole (``ShouldSplitChunk``,
  ``max_internal_fragmentation_bytes_ = 128 << 20``), which ``peak_bytes_in_use`` counts; the
  study learns it as the allowance (`scamp_jax.hpo.calibration`). Where the device has less
  free memory than the limit, ``Extend`` backs off by 10% steps (``kBackpedalFactor = 0.9``):
  `held_pool_bytes` reads the pool a process really got.
- XLA's autotuner takes its buffers from the same pool while a step compiles: a run compiles
  its step before it places its state (`scamp_jax.hpo.lifecycle`).

The policy: **the process that trains on a GPU preallocates its pool as one region, and the
pool is the budget the ledger books.** `configure_device_memory` sets
``XLA_PYTHON_CLIENT_PREALLOCATE=true`` and ``XLA_CLIENT_MEM_FRACTION = pool / device memory``:
the pool is ``pool_bytes`` (the study's ``--memory-per-device``), else, for a process alone on
the device, XLA's own 75% (no fraction is set), and for ``processes`` processes that share it
(MPI ranks on one host) an equal share less what each holds outside its pool
(`scamp_jax.planning.budget.default_pool_bytes`: the CUDA context and modules, about 650 MB per
process on an H200). The device's memory is read with ``nvidia-smi`` before JAX starts, as CUDA
counts it (`gpu_memory_bytes`); where it cannot be, the fraction stays XLA's (0.75, split
between the processes). The planner's default budget is then the allocator's ``bytes_limit``,
the pool itself. A process that only plans or
orchestrates others on the same GPU (a benchmark's parent) passes ``preallocate=False``.

A value the user already set in the environment is kept (``XLA_PYTHON_CLIENT_PREALLOCATE=false``
returns to growth; ``XLA_CLIENT_MEM_FRACTION`` or the older ``XLA_PYTHON_CLIENT_MEM_FRACTION``
sets the pool, and with it the planner's budget). XLA reads these variables once, when JAX
creates its GPU backend; on CPU they have no effect.
"""

from __future__ import annotations

import numbers
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

#: JAX's GPU client reads these when it creates the backend (``jaxlib.xla_client``).
PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
#: The older spelling JAX still reads (setting both is an error in JAX).
OLD_MEM_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: XLA's fraction of a GPU's memory when none is set (``GpuAllocatorConfig``).
XLA_DEFAULT_FRACTION = 0.75
#: Variables MPI launchers set to the number of ranks on this host.
_LOCAL_RANKS_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def configure_device_memory(memory_fraction: float | None = None, *,
                            pool_bytes: int | None = None, processes: int | None = None,
                            preallocate: bool = True) -> dict[str, str]:
    """Set XLA's GPU allocator by the policy of the module doc, before JAX starts.

    Sets ``XLA_PYTHON_CLIENT_PREALLOCATE`` (``true`` for a process that trains, ``false`` with
    ``preallocate=False``) and ``XLA_CLIENT_MEM_FRACTION``, each unless the environment already
    sets it (a fraction in either spelling).

    Args:
      memory_fraction: share of each GPU's memory the allocator's pool takes, in (0, 1].
      pool_bytes: the pool per GPU, bytes (a study's budget per device); the fraction is this
        over the device's memory (read with ``nvidia-smi``).
      processes: processes that share each GPU (None: the MPI ranks on this host, when each
        sees more than one GPU's worth; else 1); without ``pool_bytes`` or ``memory_fraction``
        several get an equal share each less what each holds outside its pool, one alone
        XLA's own pool.
      preallocate: False for a process that only plans or starts others on the same GPU.

    Returns:
      The memory variables now in the environment (name -> value), for logs and tests.
    """
    if memory_fraction is not None and not 0.0 < memory_fraction <= 1.0:
        raise ValueError(
            f"{memory_fraction=} must be in (0, 1]: the share of each GPU's memory JAX may use; "
            "e.g. 0.9, or None for the study's budget")
    cpu_without_gpu_driver()
    os.environ.setdefault(PREALLOCATE_VAR, "true" if preallocate else "false")
    user_fraction = MEM_FRACTION_VAR in os.environ or OLD_MEM_FRACTION_VAR in os.environ
    if not user_fraction:
        fraction = memory_fraction
        if fraction is None and preallocate:
            fraction = pool_fraction(pool_bytes, processes if processes is not None
                                     else processes_per_gpu())
        if fraction is not None:
            os.environ[MEM_FRACTION_VAR] = f"{fraction:.6g}"
    names = (PREALLOCATE_VAR, MEM_FRACTION_VAR, OLD_MEM_FRACTION_VAR)
    return {name: os.environ[name] for name in names if name in os.environ}


#: JAX's CUDA plugins (``jax-cuda12-plugin``, ``jax-cuda13-plugin``), as JAX finds them.
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def cuda_plugin_installed() -> bool:
    """Whether one of JAX's CUDA plugins is installed (nothing is imported)."""
    import importlib.util

    try:
        return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def cpu_without_gpu_driver() -> bool:
    """Keep JAX on the CPU, without its CUDA plugin's start-up error, where a CUDA plugin is
    installed but no GPU driver loads (``libcuda.so.1``): e.g. the ``gpu-plan`` extra on a
    machine without a GPU. JAX would stay on the CPU there anyway, after printing the
    plugin's failed start-up check (``Jax plugin configuration error ... Unable to load
    cuDNN``, a traceback of some 20 lines); planning for a GPU target loads the plugin itself
    (`scamp_jax.planning.targets`). Sets ``JAX_PLATFORMS=cpu`` (and JAX's option where JAX is
    imported) unless ``JAX_PLATFORMS`` is set. Returns whether it did."""
    import ctypes

    if "JAX_PLATFORMS" in os.environ or not cuda_plugin_installed():
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
        return False  # a driver: JAX starts its GPU backend as usual
    except OSError:
        pass
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # imported: JAX read the variable already (no effect once started)
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


def pool_fraction(pool_bytes: int | None, processes: int = 1,
                  device_bytes: int | None = None) -> float | None:
    """The ``XLA_CLIENT_MEM_FRACTION`` that makes one process's pool ``pool_bytes`` (or its
    share of a GPU that ``processes`` processes use), on a GPU of ``device_bytes`` (None: read
    with `gpu_memory_bytes`); None where nothing needs setting (XLA's default pool for one
    process). Raises where the pool does not fit the device."""
    from scamp_jax.planning.budget import GPU_OUTSIDE_POOL_BYTES, default_pool_bytes

    if pool_bytes is None and processes <= 1:
        return None  # XLA's own pool: default_pool_bytes of one process
    total = device_bytes if device_bytes is not None else gpu_memory_bytes()
    if total is None:  # no nvidia-smi: XLA's share, split between the processes
        return XLA_DEFAULT_FRACTION / processes if pool_bytes is None else None
    pool = default_pool_bytes(total, processes) if pool_bytes is None else pool_bytes
    if processes * (pool + GPU_OUTSIDE_POOL_BYTES) > total:
        raise ValueError(
            f"a pool of {pool} bytes for each of {processes} process(es), with "
            f"{GPU_OUTSIDE_POOL_BYTES} bytes each outside it, exceeds the GPU's {total} bytes; "
            f"pass a memory_per_device of at most "
            f"{total // processes - GPU_OUTSIDE_POOL_BYTES} bytes")
    return pool / total


def processes_per_gpu() -> int:
    """Processes that may share each GPU of this host: the MPI ranks on it (from the
    launcher's variables), unless ``CUDA_VISIBLE_DEVICES`` gives each rank one GPU; else 1.

    Only a process an MPI launcher started counts its host's ranks
    (`scamp_jax.distributed.mpi.launcher_ranks`): a single process inside a batch job whose
    allocation has several tasks per node (``SLURM_NTASKS_PER_NODE``) has its GPUs to itself."""
    from scamp_jax.distributed.mpi import launcher_ranks

    if launcher_ranks() is None:
        return 1
    ranks = next((int(os.environ[v].split("(")[0]) for v in _LOCAL_RANKS_VARS
                  if os.environ.get(v, "").split("(")[0].isdigit()), 1)  # Slurm's "4(x2)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1:
        return 1
    return max(1, ranks)


def configure_cpu_devices(count: int = 8) -> None:
    """Make the host CPU appear as ``count`` JAX devices, and set GPU memory allocation.

    Must be called before JAX initialises a backend (before the first ``jax.devices()`` or array).
    The device count only affects the CPU platform: on a GPU machine JAX still picks the GPUs by
    default, each with one preallocated pool (`configure_device_memory`'s policy). Called before
    ``jax`` is imported, it sets ``XLA_FLAGS``, where a device count the user already set there
    is kept (with a warning where it is another count); once ``jax`` is imported, it sets JAX's
    ``jax_num_cpu_devices``, which wins over ``XLA_FLAGS``.

    Raises:
      TypeError: ``count`` is not a whole number (a float, a bool, a string).
      ValueError: ``count`` is below 1.
      RuntimeError: JAX has initialised a backend already.
    """
    _split_cpu(count, "configure_cpu_devices")


def _split_cpu(count: Any, caller: str) -> None:
    """`configure_cpu_devices` for the public function ``caller`` its errors name."""
    if isinstance(count, bool) or not isinstance(count, numbers.Integral):
        raise TypeError(f"{caller}() takes a whole number of CPU devices, not "
                        f"{type(count).__name__} {count!r}; e.g. {caller}(8)")
    count = int(count)
    if count < 1:
        raise ValueError(f"{caller}() takes at least 1 CPU device, not {count}")
    configure_device_memory()
    if "jax" in sys.modules:
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError as err:  # backend already initialised
            raise RuntimeError(
                f"{caller}() must run before JAX initialises a backend; call it at the top "
                "of your entry point, before creating arrays or calling jax.devices()"
            ) from err
        return
    flags = os.environ.get("XLA_FLAGS", "")
    kept = re.findall(r"--xla_force_host_platform_device_count=(\S*)", flags)
    if not kept:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    elif not (kept[-1].isdigit() and int(kept[-1]) == count):
        import logging

        logging.getLogger(__name__).warning(
            "XLA_FLAGS already sets %s CPU device(s) (--xla_force_host_platform_device_count="
            "%s); that is kept, not the %d of %s(%d): remove that flag from XLA_FLAGS to use %d",
            kept[-1], kept[-1], count, caller, count, count)


def configure_for_search(cpu_devices: int = 8) -> None:
    """Environment for an entry point that runs several trials per device.

    Splits the CPU into ``cpu_devices`` JAX devices and sets XLA's GPU allocator by the
    module's policy (`configure_device_memory`: one preallocated pool per GPU, from which the
    study books every trial packed onto it), both through `configure_cpu_devices`, whose rules
    it follows (a value the user already set in the environment is kept). Call before JAX
    initialises a backend.
    """
    _split_cpu(cpu_devices, "configure_for_search")


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


def _driver_index(device_index: int) -> str:
    """The GPU ``nvidia-smi -i`` names for this process's GPU ``device_index``: the entry of
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID, which ``-i`` takes too) that CUDA numbers
    ``device_index``, else the index itself."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    return visible[device_index] if device_index < len(visible) else str(device_index)


def process_device_bytes(device_index: int = 0) -> int | None:
    """Bytes this process holds on GPU ``device_index`` as the driver sees them, or None.

    Read from ``nvidia-smi --query-compute-apps`` (CUDA context, allocator pool, library
    workspaces: everything, unlike `allocator_stats`) for the GPU that ``CUDA_VISIBLE_DEVICES``
    numbers ``device_index`` here. None without ``nvidia-smi`` or when the
    process is not listed (e.g. a container whose PIDs the driver does not see).
    """
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", _driver_index(device_index),
             "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            return int(parts[1]) << 20  # MiB
    return None


#: Where a container's memory limit is read (cgroup v2, then v1); "max" or a figure above
#: the physical memory means none.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max",
                        "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int | None:
    """The memory this process's host gives it, bytes: the physical memory, or the container's
    (cgroup) limit where that is less; None where the system reports neither. What CPU
    devices share (their default budget, and the check that they hold no more than it)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    for path in CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < memory:
            memory = int(text)
    return memory


def gpu_memory_bytes() -> int | None:
    """The memory of the first GPU this process will see as CUDA reports it, bytes: the total
    XLA's pool fraction multiplies (`pool_fraction`). Read with ``nvidia-smi`` (so before JAX
    starts) as its total less what the driver and firmware reserve (``memory.reserved``, which
    CUDA does not count: on the H200 of ``../shared/gpu/2026-11-27-h200/`` XLA's pool was
    its fraction of 143,160 MiB, where ``nvidia-smi`` gives a total of 143,771); its total
    alone where the driver does not report the reserve. None without ``nvidia-smi`` or a
    GPU."""
    for fields in ("memory.total,memory.reserved", "memory.total"):
        row = _query_gpu(fields)
        if row is not None:
            return (row[0] - sum(row[1:])) << 20  # MiB
    return None


def _query_gpu(fields: str) -> list[int] | None:
    """``nvidia-smi``'s whole numbers ``fields`` (comma-separated) of this process's first GPU;
    None where it cannot say (no ``nvidia-smi``, an unknown field, "[N/A]")."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi", "-i", _driver_index(0), f"--query-gpu={fields}",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    if len(values) != fields.count(",") + 1 or not all(v.isdigit() for v in values):
        return None
    return [int(v) for v in values]


def held_pool_bytes(devices: Sequence[Any]) -> int | None:
    """The smallest pool the allocators of ``devices`` hold once each has been used, bytes
    (``pool_bytes``: with preallocation the one region they got, which is less than their
    limit where the device had less free memory); None where they report none (CPU devices).

    Places one 4-byte array on each device to make the allocator take its pool."""
    import jax
    import numpy as np

    pools = []
    for device in devices:
        if allocator_stats(device) is None:  # the one reader: a module attribute
            return None
        jax.block_until_ready(jax.device_put(np.zeros(1, np.float32), device))
        stats = allocator_stats(device) or {}
        if "pool_bytes" not in stats:
            return None
        pools.append(int(stats["pool_bytes"]))
    return min(pools) if pools else None
