"""Deterministic GPU kernels where the pipeline promises bit-identical results.

CSP, GPipe and sequential runs, the single-process and the MPI executors, and repeated runs are
compared bit for bit. On CPU XLA's kernels are deterministic; on GPUs some (scatter-adds,
reductions in some fusions, autotuned convolutions) are not unless XLA is told to use
deterministic ones with ``--xla_gpu_deterministic_ops=true``. XLA reads ``XLA_FLAGS`` once, when
JAX creates its GPU backend, so `use_deterministic_gpu_ops` must run before the first array.
"""

from __future__ import annotations

import importlib.util
import os

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
    if DETERMINISTIC_FLAG in flags:
        return f"--{DETERMINISTIC_FLAG}=true" in flags
    if not gpu_backend_installed():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --{DETERMINISTIC_FLAG}=true".strip()
    return True
