"""Scheduling: which trial runs where and when, as pure decisions (no threads, clocks or I/O).

`SchedulingCore` (events in, actions out) owns the device pool's books and calls the placement
policies (`scamp_jax.scheduling.placement`) and tail restarts (`scamp_jax.scheduling.elastic`). The
HPO engine and the cluster simulator both drive it, and both form fused groups with `form_groups`.
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("PlanOption", "SchedulingCore", "Start", "TrialPlan"),
                    "scamp_jax.scheduling.core"),
    **dict.fromkeys(("FusionCandidate", "form_groups"), "scamp_jax.scheduling.grouping"),
    **dict.fromkeys(("DeviceOption", "FixedPolicy", "Placement", "PoolSnapshot", "ScampPolicy",
                     "TrialRequest", "check_feasible", "make_policy"),
                    "scamp_jax.scheduling.placement"),
    **dict.fromkeys(("DevicePool",), "scamp_jax.scheduling.pool"),
    **dict.fromkeys(("replay",), "scamp_jax.scheduling.replay"),
    **dict.fromkeys(("UsageRecorder",), "scamp_jax.scheduling.usage"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
