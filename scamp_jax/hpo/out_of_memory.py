"""Out of memory in the search loop: what follows when a unit's memory does not hold.

Detection is one mapping, `scamp_jax.hpo.trial.ending` (`scamp_jax.hpo.trial.is_oom_error`): a
run whose compiled programs exceed its booked share (the ledger check before its first step),
an allocation XLA refuses while the run trains, and one refused while its step compiles (XLA's
autotuner takes its buffers from the same pool: "Failed to get configs ... allocate") all end
the run ``oom``, never ``failed``. What follows is decided here, and only here:

- a solo trial: its devices are freed and it is planned again, in the planner threads
  (`plan_again`), at a batch scaled by the bytes its run needed, or the same batch on twice the
  devices (`next_request`); after ``max_replans`` such re-plans, or when no request is left or
  no plan fits, it fails;
- a fused group: each member runs alone from then on, planned as a solo trial;
- a queued trial whose plan no longer fits once the allowance learned while the study runs is
  booked with it (`scamp_jax.hpo.calibration`): planned again at most at its batch; that is not
  an out-of-memory re-plan and does not count against ``max_replans``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from scamp_jax.hpo.trial import PlannedTrial, RunResult, ending
from scamp_jax.planning import planner
from scamp_jax.scheduling.core import SchedulingCore, TrialPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replan:
    """Plan trial ``key`` again on ``devices`` devices at a global batch of at most
    ``max_batch``; ``counted``: an out-of-memory re-plan (counts against ``max_replans``)."""

    key: int
    devices: int
    max_batch: int
    counted: bool = True


def next_request(plan: TrialPlan, bytes_needed: int | None, usable_bytes: int, *,
                 devices: int, min_batch: int = 1, may_grow: bool = True) -> Replan | None:
    """How to plan ``plan`` again after its run needed ``bytes_needed`` per device (measured;
    None: unknown) where ``usable_bytes`` were usable, on a pool of ``devices`` devices.

    The next batch cap scales the failed batch by ``usable_bytes / bytes_needed`` (a step's
    peak grows at most linearly in the batch, so the cap errs small), and is at most half the
    failed batch; without a measurement, half. A cap below ``min_batch`` or the data-parallel
    degree moves the same batch to twice the devices (``may_grow``, within the pool). None: no
    such plan (the trial fails).
    """
    batch, dp = plan.batch_size, plan.data_parallel
    cap = batch // 2
    if bytes_needed:
        cap = min(cap, int(batch * usable_bytes / bytes_needed))
    cap -= cap % dp
    if cap >= max(dp, min_batch):
        return Replan(plan.key, plan.devices, cap)
    if may_grow and plan.devices * 2 <= devices:
        return Replan(plan.key, plan.devices * 2, batch)
    return None


def plan_again(planning: Any, planned: PlannedTrial, request: Replan) -> PlannedTrial | None:
    """``planned`` planned on ``request.devices`` devices at a batch of at most
    ``request.max_batch`` by the engine's `scamp_jax.hpo.plan_service.PlanningService`, costed
    as a new plan; None if nothing fits. A plan below ``min_batch_size`` does not count: the
    same request moves to twice the devices where the policy grows trials (ScaMP, within the
    pool), as `next_request` does. Runs in a planner thread."""
    params = planned.asked.params
    config, devices = planning.config, request.devices
    floor = config.min_batch_size or 1
    while True:
        try:
            new = planning.call_planner(planning.abstract(params), devices,
                                        request.max_batch, params=params)
        except planner.DoesNotFitError:
            return None
        if new.batch_size >= floor:
            break
        if config.policy != "scamp" or devices * 2 > len(planning.devices):
            return None
        devices *= 2
    planning.keep_cost(planned.number, params, new)
    return replace(planned, plan=new, devices=planning.devices_of(new),
                   replans=planned.replans + int(request.counted))


class OutOfMemory:
    """The loop's out-of-memory handling for one engine run (see the module doc).

    Args:
      config: the engine's `scamp_jax.hpo.settings.EngineConfig` (``max_replans``,
        ``min_batch_size``, ``policy``).
      core: this run's scheduling core.
      records: this run's `scamp_jax.hpo.engine.TrialRecord` per trial number.
      replan: ``replan(planned, request)``: carry out `plan_again` in a planner thread (its
        answer comes back to `replanned`).
      queue: ``queue(planned)``: a planned trial waits for devices again.
      report: ``report(planned, result)``: tell the study how a trial ended.
    """

    def __init__(self, config: Any, core: SchedulingCore, records: Mapping[int, Any],
                 replan: Callable[[PlannedTrial, Replan], None],
                 queue: Callable[[PlannedTrial], None],
                 report: Callable[[PlannedTrial, RunResult], None]) -> None:
        self.config, self.core, self.records = config, core, records
        self.replan, self.queue, self.report = replan, queue, report

    def run_ended(self, now: float, planned: PlannedTrial, result: RunResult) -> None:
        """Event: ``planned``'s solo run ended ``oom`` (``result``) at ``now``; its devices
        are freed and it is planned again, or it fails."""
        number = planned.number
        record = self.records[number]
        record.status.reason = result.reason
        min_batch, may_grow = self.config.min_batch_size or 1, self.config.policy == "scamp"
        record.log("oom", now, result.bytes_needed, min_batch, may_grow)
        plan = self.core.plan_of(number)
        self.core.finished(now, number)
        record.oom = result
        request = None
        if planned.replans < self.config.max_replans:
            request = next_request(plan, result.bytes_needed, self.core.capacity,
                                   devices=self.core.devices, min_batch=min_batch,
                                   may_grow=may_grow)
        if request is None:
            self.replanned(planned, None)
            return
        record.status.state = "planning"
        self.replan(planned, request)

    def member_ended(self, planned: PlannedTrial) -> None:
        """Event: ``planned``'s fused group ran out of memory (or does not fit once the learnt
        allowance is booked); the member runs alone."""
        record = self.records[planned.number]
        record.solo_only, record.group, record.width = True, None, 1
        self.queue(planned)

    def no_longer_fits(self, planned: PlannedTrial) -> None:
        """``planned``'s plan does not fit with the allowance learned since it was made: it is
        planned again at most at its batch (not counted as an out-of-memory re-plan)."""
        record = self.records[planned.number]
        record.status.state = "planning"
        record.oom = RunResult(planned.number, "failed", 0, 0.0, reason=(
            "its plan no longer fits once the allowance for memory XLA does not see is booked"))
        self.replan(planned, Replan(planned.number, planned.devices,
                                    int(planned.plan.batch_size), counted=False))

    def replanned(self, planned: PlannedTrial, retry: PlannedTrial | None,
                  error: BaseException | None = None) -> None:
        """Event: the next plan of ``planned`` is in (None: none fits, or none was tried, or
        planning raised ``error``)."""
        record = self.records[planned.number]
        ended, record.oom = record.oom, None
        assert ended is not None
        if retry is None:
            reason = ended.reason or record.status.reason
            floor = self.config.min_batch_size or 1
            at_least = f" at a batch of at least min_batch_size={floor}" if floor > 1 else ""
            why = (f"; no smaller plan fits{at_least}" if error is None
                   else f"; planning it again failed: {ending(error)[1]}")
            self.report(planned, replace(ended, state="failed", reason=reason + why))
            return
        log.info("trial %d re-planned (%s)", planned.number, ended.reason)
        record.status.replans = retry.replans
        # its next run starts over (or from a checkpoint, which it says): not at the step
        # where it ran out
        record.status.step, record.status.loss = 0, math.nan
        record.status.reason = ""  # said on its planning line; a later one is not for this
        self.queue(retry)
