"""Pipelined supernet training (NASPipe in JAX): CSP schedules, tick programs, the executor.

Decisions (`csp_schedule`, `gpipe_schedule`, `sequential_schedule`, `build_program`) are pure
host-side functions returning plain data; only `PipelineExecutor` touches devices. Any supernet
that implements `StageModel` (flat blocks, stem/layers/head functions, its loss) can be trained.
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("BatchDoesNotFitError", "ExecutorCache", "SchedulePlan", "plan_schedule",),
                    "scamp_jax.pipeline.budget"),
    **dict.fromkeys(("SHARED", "check_causality", "csp_schedule", "ideal_schedule",
                     "split_layers", "stage_param_keys",),
                    "scamp_jax.pipeline.csp"),
    **dict.fromkeys(("use_deterministic_gpu_ops", "use_fixed_cpu_threads",),
                    "scamp_jax.pipeline.determinism"),
    **dict.fromkeys(("PipelineExecutor",), "scamp_jax.pipeline.executor"),
    **dict.fromkeys(("StageExecutor",), "scamp_jax.pipeline.executor_base"),
    **dict.fromkeys(("StageModel",), "scamp_jax.pipeline.model"),
    **dict.fromkeys(("TickProgram", "build_program",), "scamp_jax.pipeline.program"),
    **dict.fromkeys(("Op", "Schedule", "gpipe_schedule", "sequential_schedule",
                     "validate_schedule",),
                    "scamp_jax.pipeline.schedules"),
    **dict.fromkeys(("OptimizerSpec", "StageSpec", "stage_tick",), "scamp_jax.pipeline.stage"),
    **dict.fromkeys(("SCHEDULES", "SupernetState", "TrainResult", "build_executor", "make_schedule",
                     "params_sha256", "split_microbatches", "supernet_state_bytes",
                     "train_supernet",),
                    "scamp_jax.pipeline.trainer"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
