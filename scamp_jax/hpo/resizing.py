"""Restarts of running trials on idle devices at the end of a study, for the search loop.

The scheduling core decides from the measured paces (`scamp_jax.scheduling.elastic`); this
helper carries its decisions out off the loop's thread: a restart decided is planned for its new
device count in the planner threads (a few compiles that must not stall the loop); once its plan
is ready, a later `TailResizer.tick` books the new devices, asks the trial to stop (it
checkpoints) and records the restart on the trial's record, and the loop starts it again on
them when its run returns. If another restart took those devices meanwhile, it is decided afresh
(its plan is cached by then).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.trial import PlannedTrial
from scamp_jax.scheduling.core import SchedulingCore, TrialPlan
from scamp_jax.scheduling.elastic import Resize
from scamp_jax.scheduling.placement import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restart:
    """A running trial's restart on more devices: the new plan and placement, and what it ran
    on before (to fall back on if the new run fails before training a step)."""

    grown: PlannedTrial
    placement: Placement
    before: PlannedTrial
    old_placement: Placement
    old_plan: TrialPlan
    since: float = math.inf  # time.monotonic() when the new run was started


class TailResizer:
    """Restarts of running solo trials onto idle devices (see the module doc).

    Args:
      core: the engine's scheduling core (decides and books).
      planning: the engine's planning service (plans the new device counts).
      devices: the pool's device count.
      submit: ``submit(fn, *args, **kw) -> Future`` on the engine's planner threads.
      trial_plan: ``trial_plan(planned) -> TrialPlan``, a plan as the core sees it.
      now: seconds since the engine's run began.
      refresh: ``refresh(plan)``: ``plan`` booking the allowance learnt so far, None when it
        then exceeds the usable bytes (`scamp_jax.hpo.calibration.Calibration.refresh`): a
        restart's plan was asked with the allowance of its time.
    """

    def __init__(self, core: SchedulingCore, planning: PlanningService, devices: int,
                 submit: Callable[..., cf.Future], trial_plan: Callable[[PlannedTrial], TrialPlan],
                 now: Callable[[], float],
                 refresh: Callable[[Any], Any | None] = lambda plan: plan) -> None:
        self.core, self.planning, self.devices = core, planning, devices
        self.submit, self.trial_plan, self.now, self.refresh = submit, trial_plan, now, refresh
        self.plans: dict[cf.Future, Resize] = {}

    def futures(self) -> list[cf.Future]:
        """The restart plans being compiled (the loop waits on them too)."""
        return [f for f in self.plans if not f.done()]

    def tick(self, running: Mapping[int, Any]) -> None:
        """Book the restarts whose plans are ready, then (when none is being planned) ask the
        core for new ones. ``running``: the records of the running solo trials, by number
        (each with ``run``, ``resizing`` and ``status``)."""
        for future, decision in list(self.plans.items()):
            if future.done():
                del self.plans[future]
                record = running.get(decision.key)
                if record is not None and record.resizing is None:
                    self._book(decision, future, record)
        if self.plans:
            return  # decided devices are not booked before their plan is ready: wait for it
        reshapes = {}
        for number, record in running.items():
            if record.resizing is not None or record.run.stop.is_set():
                continue
            plan = record.run.members[0].plan
            dp, mp, batch = int(plan.data_parallel), int(plan.model_parallel), int(plan.batch_size)
            reshapes[number] = [p * mp for p in range(dp + 1, self.devices // mp + 1)
                                if batch % p == 0]
        for r in self.core.resizes(self.now(), reshapes):
            planned = running[r.key].run.members[0]
            future = self.submit(self.planning.plan, planned.asked.params,
                                 devices=r.option.devices, max_batch=int(planned.plan.batch_size))
            self.plans[future] = r

    def _book(self, r: Resize, future: cf.Future, record: Any) -> None:
        """Book restart ``r`` of a running trial with its compiled plan and stop the trial."""
        planned = record.run.members[0]
        n, batch = r.option.devices, int(planned.plan.batch_size)
        try:
            plan = future.result()
        except Exception as err:  # noqa: BLE001 - no plan for that count: the trial runs on
            log.info("trial %d: no plan on %d devices at batch %d (%s)", r.key, n, batch, err)
            plan = None
        if plan is not None:
            plan = self.refresh(plan)  # the allowance learnt while it compiled
        if (plan is None or PlanningService.devices_of(plan) != n
                or int(plan.batch_size) != batch):
            record.log("withdrawn", self.now(), n)
            self.core.withdraw(r.key, n)  # the planner found no such plan: not again
            return
        # The trial trained on while its plan compiled: is the restart still worth it?
        if not self.core.still_worth(r.key, n) or not self.core.restart_fits(r.key, r.device_ids):
            return
        before = self.core.plan_of(r.key)
        old_ids = self.core.running[r.key]
        grown = replace(planned, plan=plan, devices=n)
        now, tp = self.now(), self.trial_plan(grown)
        if not self.core.restarted(now, r.key, r.device_ids, tp):
            return  # the compiled plan needs more than the prediction left free
        record.log("restarted", now, list(r.device_ids), tp.as_dict())
        record.resizing = Restart(grown, Placement(r.key, r.device_ids), planned,
                                  Placement(r.key, old_ids), before)
        record.status.state = "resizing"
        record.show_plan(plan)
        log.info("trial %d: restarting on %d devices (was %d), batch %d", r.key, n,
                 planned.devices, batch)
        record.run.stop.set()
