"""Planning: what a trial needs and how it is laid out, from compiled programs.

The memory of a device (`budget`), the memory model and its compiles (`memory`), sharding
rules (`sharding`), the training step (`train_step`), the planner (`planner`: `plan_mesh`) and
its cache (`plan_cache`), evaluation chunking (`evaluation`), fused groups (`fusion`) and GPU
targets planned for without the GPU (`targets`).
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("Budget", "pool_bytes"), "scamp_jax.planning.budget"),
    **dict.fromkeys(("CompileCounter",), "scamp_jax.planning.compile_events"),
    **dict.fromkeys(("ChunkedEvalTask", "EvalPlan", "plan_eval"),
                    "scamp_jax.planning.evaluation"),
    **dict.fromkeys(("FusionPlan", "jit_fused_step", "make_fused_step", "plan_fusion",
                     "group_held_bytes"), "scamp_jax.planning.fusion"),
    **dict.fromkeys(("MemoryEstimate", "MemoryModel", "estimate_memory", "fit_memory_model"),
                    "scamp_jax.planning.memory"),
    **dict.fromkeys(("PlanCache",), "scamp_jax.planning.plan_cache"),
    **dict.fromkeys(("CompiledStep", "DoesNotFitError", "Plan", "plan_mesh", "min_devices",
                     "min_devices_plan", "plan_budget", "resolve_devices"),
                    "scamp_jax.planning.planner"),
    **dict.fromkeys(("make_mesh", "param_partition_specs"), "scamp_jax.planning.sharding"),
    **dict.fromkeys(("GpuCompilerMissingError", "GpuSpec", "Target", "resolve_target"),
                    "scamp_jax.planning.targets"),
    **dict.fromkeys(("StepShardings", "abstract_state", "default_loss", "default_optimizer",
                     "jit_train_step", "make_train_step", "place_train_state", "split_model"),
                    "scamp_jax.planning.train_step"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
