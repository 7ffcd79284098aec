"""The cluster simulator: step costs from compiled programs and a discrete-event driver
of the scheduling core (`scamp_jax.scheduling`).
"""

from scamp_jax._lazy import exports as _exports

_NAMES = {
    **dict.fromkeys(("ClusterModel", "SimResult", "SimTrial", "StepCostModel", "TrialProfile",
                     "cluster_preset", "plan_profiles", "simulate"), "scamp_jax.sim.simulator"),
    **dict.fromkeys(("FusedCostModel", "fused_profiles", "measure_fused_costs"),
                    "scamp_jax.sim.sim_fusion"),
    **dict.fromkeys(("fixed_baseline", "measure_cost"), "scamp_jax.sim.step_costs"),
    **dict.fromkeys(("engine_figures", "read_results", "replay_study"), "scamp_jax.sim.measured"),
}
__all__ = sorted(_NAMES)
__getattr__, __dir__ = _exports(__name__, _NAMES)
