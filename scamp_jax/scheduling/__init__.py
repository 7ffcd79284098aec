"""Scheduling: which trial runs where and when, as pure decisions (no threads, clocks or I/O).

`SchedulingCore` (events in, actions out) owns the device pool's books and calls the placement
policies (`scamp_jax.scheduling.placement`) and tail restarts (`scamp_jax.scheduling.elastic`). The
HPO engine and the cluster simulator both drive it, and both form fused groups with `form_groups`.
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
from scamp_jax.scheduling.grouping import FusionCandidate, form_groups

__all__ = ["FusionCandidate", "PlanOption", "Replan", "SchedulingCore", "Start", "TrialPlan",
           "form_groups", "replan_after_oom", "usable_capacity"]
