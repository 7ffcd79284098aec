"""Scheduling: which trial runs where and when, as pure decisions (no threads, clocks or I/O).

`SchedulingCore` (events in, actions out) owns the device pool's books and calls the placement
policies (`scamp_jax.scheduling.placement`) and tail restarts (`scamp_jax.scheduling.elastic`). The
HPO engine and the cluster simulator both drive it.
"""

from scamp_jax.scheduling.core import (
    PlanOption,
    Replan,
    SchedulingCore,
    Start,
    TrialPlan,
    replan_after_oom,
    usable_capacity,
)

__all__ = ["PlanOption", "Replan", "SchedulingCore", "Start", "TrialPlan", "replan_after_oom",
           "usable_capacity"]
