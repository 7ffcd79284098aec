"""scamp-jax: memory-aware parallel deep-learning search (HPO and NAS) in JAX.

The names a user calls: `run_study` (a whole study: plan, pack, train, report, resume) over a
`SearchSpace` and a `Task` (`FunctionTask`, `ChunkedEvalTask`), configured by `SearchSettings`;
the planner (`plan_mesh` -> `Plan`, cached in a `PlanCache`; `estimate_memory`); `load_model`
for a finished study's ``best_model/``; device set-up (`configure_for_search`); and the NAS
pipeline's `train_supernet`. Everything else lives in the subpackages, each with its own
``__all__``: `scamp_jax.planning`, `scamp_jax.scheduling`, `scamp_jax.hpo`, `scamp_jax.sim`,
`scamp_jax.pipeline` and `scamp_jax.distributed`.

Names load their module on first use: ``import scamp_jax`` imports neither JAX nor Optuna.
"""

from scamp_jax._lazy import exports as _exports

__version__ = "0.1.0"

_NAMES = {
    # a whole study
    "run_study": "scamp_jax.hpo.session",
    "run_search": "scamp_jax.hpo.session",
    "SearchSettings": "scamp_jax.hpo.settings",
    "SearchSpace": "scamp_jax.space",
    "Task": "scamp_jax.space",
    "FunctionTask": "scamp_jax.space",
    "ChunkedEvalTask": "scamp_jax.planning.evaluation",
    "open_study": "scamp_jax.hpo.study",
    "load_model": "scamp_jax.hpo.runner",
    "replay_study": "scamp_jax.sim.measured",
    "BudgetTooSmallError": "scamp_jax.hpo.engine",
    "StudySettingsError": "scamp_jax.hpo.study",
    "RepeatedFailureError": "scamp_jax.hpo.failures",
    # planning one trial
    "plan_mesh": "scamp_jax.planning.planner",
    "Plan": "scamp_jax.planning.planner",
    "DoesNotFitError": "scamp_jax.planning.planner",
    "PlanCache": "scamp_jax.planning.plan_cache",
    "estimate_memory": "scamp_jax.planning.memory",
    "MemoryEstimate": "scamp_jax.planning.memory",
    # devices and sizes
    "configure_for_search": "scamp_jax.devices",
    "configure_cpu_devices": "scamp_jax.devices",
    "configure_device_memory": "scamp_jax.devices",
    "parse_bytes": "scamp_jax._units",
    "format_bytes": "scamp_jax._units",
    # neural architecture search: the pipelined supernet
    "train_supernet": "scamp_jax.pipeline.trainer",
}
__all__ = sorted(_NAMES)
_SUBPACKAGES = ("planning", "scheduling", "hpo", "sim", "pipeline", "distributed")
__getattr__, __dir__ = _exports(
    __name__, {**_NAMES, **{name: f"{__name__}.{name}" for name in _SUBPACKAGES}})
