"""XLA options of every compile the project makes, by backend and purpose: the one place.

A compile is made for one of these purposes (`Purpose`):

- ``GUIDE``: a planning compile read only for its memory figures (`memory_analysis`), never run:
  the batch search's points other than its answer, a fused group's points;
- ``ANSWER``: the planner's compile of the batch it answers with;
- ``RUN``: the training step a run trains with;
- ``EVAL``: the evaluation forward (compiled once by the planner, run by the trial);
- ``INIT``: a run's initial state where NumPy cannot compute it (run once per run; the others
  are computed without a compile, `scamp_jax.planning.host_init`).

Per backend:

- CPU: guidance at LLVM optimisation level 0 (``CPU_FAST_COMPILE``: the same buffer assignment,
  about half the compile time, half-speed code); the answer at XLA's defaults, so that it *is*
  the run's executable (`answer_is_runnable`); the initial state at level 1
  (``CPU_INIT_COMPILE``: about a fifth of the default level's compile time) where that keeps its
  values (jax 0.10 and 0.11), else at XLA's defaults.
- GPU: every planning compile with XLA's autotuner off (``GPU_PLANNING_COMPILE``): the autotuner
  runs kernels at compile time, takes an exclusive lock on the GPU while it does, and would
  stall the trials training beside the planner; the run's step is the one compile autotuned
  (its results kept by the persistent autotune cache, `scamp_jax.planning.compile_cache`), so
  the planner's answer is not the run's executable there. The evaluation forward runs rarely:
  its one compile is the planner's, autotuning off.
- other backends: XLA's defaults everywhere.
- a GPU target, described and not present (`scamp_jax.planning.targets`): the GPU's options
  with the target's own on top (`device_options`); nothing it compiles is run.

The initial state is made on the host on every backend, with NumPy or, failing that, compiled
for the host's CPU (`scamp_jax.planning.initial_state`), so a new architecture's initialisation
never compiles for an accelerator.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from enum import Enum
from typing import Any

#: XLA options of CPU planning compiles: LLVM optimisation level 0 (buffer assignment is done on
#: HLO before code generation, so the figures equal the default level's; a test pins it).
CPU_FAST_COMPILE: dict[str, str | bool] = {"xla_backend_optimization_level": "0"}
#: XLA options for the planner's guidance compiles on CPU where XLA still has the legacy
#: elemental emitters: those instead of the MLIR fusion emitters (most of a CPU compile's time).
#: XLA's fusion decisions change a little with them: peaks seen equal or 512 bytes above
#: ``CPU_FAST_COMPILE``'s (`cpu_rough_options`).
CPU_ROUGH_COMPILE: dict[str, str | bool] = {
    **CPU_FAST_COMPILE, "xla_cpu_use_fusion_emitters": False,
}
#: XLA options of the initialisation's compile on CPU: it runs once per run, so its code speed
#: hardly matters, while LLVM's default optimisation makes its compile the slowest of a trial
#: (digits MLP on jax 0.10: 2.7 CPU s at the default level, 0.58 at level 1, same values bit for
#: bit; level 0 rounds about 4% of the weights differently in the last place). Used up to
#: ``CPU_INIT_SAME_VALUES_THROUGH`` only.
CPU_INIT_COMPILE: dict[str, str | bool] = {"xla_backend_optimization_level": "1"}
#: Newest JAX release series, (major, minor), whose XLA computes the initial state at
#: ``CPU_INIT_COMPILE`` bit for bit as at its defaults, as the eagerly built model has it
#: (tests/test_reuse.py passes on jax 0.10.2 and 0.11.1; on 0.12.0.1 level 1 rounds 3 of a small
#: MLP's 32 first-layer weights differently). Newer JAX compiles an initial state NumPy cannot
#: compute (`scamp_jax.planning.host_init`) at XLA's defaults, the plain jitted model's values.
CPU_INIT_SAME_VALUES_THROUGH = (0, 11)
#: XLA options of GPU planning compiles: no autotuning (kernels chosen by XLA's heuristics).
GPU_PLANNING_COMPILE: dict[str, str | bool | int] = {"xla_gpu_autotune_level": 0}


class Purpose(Enum):
    """What a compile is for (see the module doc)."""

    GUIDE = "guide"
    ANSWER = "answer"
    RUN = "run"
    EVAL = "eval"
    INIT = "init"


def platform_of(devices: Iterable[Any]) -> str:
    """The one platform of ``devices`` (``jax.Device``s), e.g. ``"cpu"`` or ``"gpu"``; raises
    ``ValueError`` for an empty or mixed set."""
    platforms = {str(d.platform) for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices of one platform are compiled for together, got "
                         f"{sorted(platforms) or 'none'}; pass devices of one platform")
    return platforms.pop()


def compile_options(platform: str, purpose: Purpose) -> dict[str, Any] | None:
    """XLA options (``Lowered.compile``'s ``compiler_options``) of a ``purpose`` compile for
    ``platform``; None: XLA's defaults. A new dict each call (callers may extend it)."""
    if platform == "cpu":
        if purpose is Purpose.GUIDE:
            return dict(CPU_FAST_COMPILE)
        if purpose is Purpose.INIT:
            return dict(CPU_INIT_COMPILE) if _init_level_keeps_values() else None
        return None
    if platform in ("gpu", "cuda", "rocm") and purpose in (
            Purpose.GUIDE, Purpose.ANSWER, Purpose.EVAL):
        return dict(GPU_PLANNING_COMPILE)
    return None


def device_options(devices: Iterable[Any], purpose: Purpose) -> dict[str, Any] | None:
    """`compile_options` for the platform of ``devices``; on a GPU target's compile-only
    devices (`scamp_jax.planning.targets`) with the target's own options on top (its toolkit,
    no driver fallback, its autotuning cache)."""
    from scamp_jax.planning.targets import target_of

    devices = list(devices)
    options = compile_options(platform_of(devices), purpose)
    target = target_of(devices)
    if target is None:
        return options
    return {**(options or {}), **target.compiler_options}


#: How XLA's GPU compiler says that a fusion got no kernel configuration: without autotuning
#: (planning compiles, GPU targets) each matrix-product fusion takes one default Triton tiling,
#: and for some no default compiles, e.g. a SwinIR's f32[589824,48] product of a transposed
#: operand at batch 1024 for a described H200 ("Failed to get configs for: 2 out of 25
#: instructions ... TritonBackend does not support a default config"; for one fusion alone
#: "No supported config found for HLO ...").
NO_DEFAULT_KERNEL = "does not support a default config"
NO_CONFIG = ("Failed to get configs", "No supported config found")
#: The option that retry turns off: XLA's Triton matrix products (cuBLAS kernels instead).
TRITON_GEMM = "xla_gpu_enable_triton_gemm"


def without_default_kernels(options: dict[str, Any] | None,
                            err: BaseException) -> dict[str, Any] | None:
    """The options to compile again with when ``err`` says a fusion had no default kernel
    configuration (`NO_DEFAULT_KERNEL`): ``options`` with XLA's Triton matrix products off, so
    that those products take cuBLAS kernels. None for any other error, for an allocation
    failure (the autotuner out of memory: an out-of-memory for the ledger), and where Triton
    matrix products are off already."""
    text = str(err)
    if NO_DEFAULT_KERNEL not in text or not any(marker in text for marker in NO_CONFIG):
        return None
    if "alloc" in text or "RESOURCE_EXHAUSTED" in text:
        return None
    if (options or {}).get(TRITON_GEMM) is False:
        return None
    return {**(options or {}), TRITON_GEMM: False}


def answer_is_runnable(platform: str) -> bool:
    """Whether the planner's compile of its answer is the run's executable on ``platform``
    (its options are the run's: CPU and backends without planning options)."""
    return compile_options(platform, Purpose.ANSWER) == compile_options(platform, Purpose.RUN)


def _init_level_keeps_values() -> bool:
    """Whether ``CPU_INIT_COMPILE`` keeps the initial state's values on this JAX
    (``CPU_INIT_SAME_VALUES_THROUGH``)."""
    import jax

    return tuple(jax.__version_info__[:2]) <= CPU_INIT_SAME_VALUES_THROUGH


_rough_accepted: bool | None = None
_rough_lock = threading.Lock()


def cpu_rough_options() -> dict[str, str | bool] | None:
    """``CPU_ROUGH_COMPILE`` where this XLA accepts its options, else None (no rough setting).

    The legacy emitters' switch is gone from newer XLA releases (jax 0.12), which reject an
    unknown option at compile time; one tiny compile per process tells which kind this is.
    """
    global _rough_accepted
    with _rough_lock:
        if _rough_accepted is None:
            _rough_accepted = _accepts(CPU_ROUGH_COMPILE)
    return dict(CPU_ROUGH_COMPILE) if _rough_accepted else None


def _accepts(options: dict[str, Any]) -> bool:
    """Whether this XLA takes ``options`` (one tiny compile)."""
    import jax

    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), "float32"))
    try:
        lowered.compile(dict(options))
    except jax.errors.JaxRuntimeError as error:  # INVALID_ARGUMENT: No such compile option: ...
        if "No such compile option" not in str(error):
            raise
        return False
    return True
