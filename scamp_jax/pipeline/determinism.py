"""Deterministic kernels where the pipeline promises bit-identical results.

CSP, GPipe and sequential runs, the single-process and the MPI executors, and repeated runs are
compared bit for bit. On GPUs some kernels (scatter-adds, reductions in some fusions, autotuned
convolutions) are not deterministic unless XLA is told to use deterministic ones with
``--xla_gpu_deterministic_ops=true`` (`use_deterministic_gpu_ops`). On CPU every kernel is
deterministic within a process, but XLA's CPU convolutions split their work by the size of the
process's worker pool, ``max(PJRT_NPROC`` (else ``NPROC``, else the CPUs the process may run
on)``, CPU devices)``, and round differently with another split: two processes with other core
counts, binding (Open MPI's ``mpirun`` binds a rank to a core or a socket) or device counts
train to other bits (`use_fixed_cpu_threads`). XLA reads both settings once, when JAX creates
its backends, so these must run before the first array.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

DETERMINISTIC_FLAG = "xla_gpu_deterministic_ops"
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                "jax_rocm7_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def gpu_backend_installed() -> bool:
    """Whether a JAX GPU plugin is installed and ``JAX_PLATFORMS`` does not exclude GPUs."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
        return False
    for name in _GPU_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package of a dotted name is absent
            continue
    return False


def use_deterministic_gpu_ops() -> bool:
    """Append ``--xla_gpu_deterministic_ops=true`` to ``XLA_FLAGS`` when JAX would run on a GPU.

    Nothing changes when no GPU backend is installed or when ``XLA_FLAGS`` already sets the flag
    (the user's value, true or false, is kept). Call before JAX creates its backend. Returns
    whether the flag is now set to true.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    # XLA's flag parser: a bare boolean flag is true, and so are "true" and "1" (any case); the
    # last occurrence wins
    values = re.findall(rf"--{DETERMINISTIC_FLAG}(?:=(\S*))?(?:\s|$)", flags)
    if values:
        return values[-1].lower() in ("", "true", "1")
    if not gpu_backend_installed():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --{DETERMINISTIC_FLAG}=true".strip()
    return True


#: The variable XLA's CPU client sizes its worker pool from, before ``NPROC`` and the CPUs.
CPU_THREADS_VARIABLE = "PJRT_NPROC"


def use_fixed_cpu_threads(threads: int) -> bool:
    """Size XLA's CPU worker pool by ``threads`` instead of the CPUs this process may use.

    XLA's CPU convolutions split their work by the pool's size, ``max(PJRT_NPROC`` (else the
    process's CPUs)``, CPU devices)``, and a different split rounds differently: the same
    training in a process pinned to one core, in one that may use two, and in an MPI rank
    (``mpirun`` binds ranks to cores or sockets) ends in different weights. Processes that set
    the same ``threads`` and make at most that many CPU devices compute the same bits whatever
    cores they run on; their CPU kernels then use at most ``threads`` threads at once (on a
    larger host, fewer than it has). Sets ``PJRT_NPROC`` unless it is set already (the user's
    value is kept). XLA's GPU client sizes its own thread pools from the same variable, so a
    process that trains on GPUs leaves it alone. Call before JAX creates its backends: once it
    has, the pool is sized and this changes nothing. Returns whether the pool's size is now
    ``threads``: False where ``PJRT_NPROC`` holds another value, or where JAX created its
    backends before ``PJRT_NPROC`` was set (the variable is then left unset).
    """
    if threads < 1:
        raise ValueError(f"{threads=} must be at least 1")
    current = os.environ.get(CPU_THREADS_VARIABLE)
    if current is not None:
        return current.strip() == str(threads)
    if _backends_started():
        return False
    os.environ[CPU_THREADS_VARIABLE] = str(threads)
    return True


def _backends_started() -> bool:
    """Whether JAX has created its backends (and so sized its CPU worker pool) already."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge  # no public way to ask (jax 0.12)

    return bool(xla_bridge.backends_are_initialized())
