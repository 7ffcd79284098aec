"""The search loop: ask, plan, let the scheduling core decide, run concurrently, tell.

Every placement decision is made by a `scamp_jax.scheduling.SchedulingCore` (pure: events in,
actions out; the cluster simulator drives the same core). This module is the loop around it:

1. ask the `TrialSource` for configurations (a few more than can run, so placement has choice);
   an `AskLater` answer (other processes' trials may still need retries) is asked again after
   its seconds, and the loop ends only once the source answers ``None``;
2. plan each one in the planner threads (`planner.plan_mesh`, cached per architecture): device
   count, model-parallel degree, the largest batch that fits, the predicted peak per device, and
   the step's FLOPs per device from ``cost_analysis()`` of the plan's compiled step (of the
   lowered step where the plan compiled none);
3. feed the core its events: a unit planned, a run's measured seconds per step, a run ended,
   the last wave begun; the core books the pool (usable bytes per device) and answers with
   units to start on device ids, or larger plans to compile first (last-wave growth);
4. run each started unit in a worker thread on its own sub-mesh (`scamp_jax.hpo.units`);
5. when a unit ends, tell the study. An out-of-memory trial is re-planned in the planner
   threads (never on this loop's thread) at a batch scaled by the bytes its run measured, or on
   twice the devices, and queued again (`scamp_jax.hpo.out_of_memory`);
6. at the end of the study, on accelerators, restart running trials from a checkpoint on the
   devices that fell idle, with the same global batch (the core's `resizes`).

What the core schedules is a *unit* (`scamp_jax.hpo.units.Unit`): a solo trial or a fused group
of trials of one architecture, each of which owns its queueing, run spec, start and end. How
asked trials become units is the engine's `scamp_jax.hpo.units.UnitKind`, chosen once from
``EngineConfig.fuse``: `scamp_jax.hpo.units.SoloTrials` or the grouping service
`scamp_jax.hpo.fused_engine.FusionService`.

The engine is composed, not mixed: it holds a `PlanningService` (plans, their cache and costs,
in the planner threads), its unit kind and a `TailResizer` (restarts at the end, on
accelerators), and while it runs one `TrialRecord` per trial (`scamp_jax.hpo.record`), the
queued units by key and the work in flight (`scamp_jax.hpo.work.Work`: plans, re-plans, runs,
groups being sized, each with the handler of its end).

Each trial's record (``results.json``) holds what the core was fed, so a finished study can be
replayed through it (`scamp_jax.scheduling.replay`).
"""


from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import jax

from scamp_jax._signals import stops_held
from scamp_jax._units import counted
from scamp_jax.hpo import work
from scamp_jax.hpo.calibration import Calibration
from scamp_jax.hpo.endings import Endings, second_ctrl_c
from scamp_jax.hpo.failures import RepeatedFailureError
from scamp_jax.hpo.fused_engine import FusionService
from scamp_jax.hpo.intake import BudgetTooSmallError, Intake
from scamp_jax.hpo.launch import Launcher
from scamp_jax.hpo.out_of_memory import plan_again
from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.record import TrialRecord
from scamp_jax.hpo.resizing import TailResizer
from scamp_jax.hpo.runner import StepCache
from scamp_jax.hpo.settings import EngineConfig
from scamp_jax.hpo.study.trials import AskedTrial, TrialOutcome, TrialSource
from scamp_jax.hpo.trial import PlannedTrial, TrialDeferred, TrialStatus, ending, fusion_cap
from scamp_jax.hpo.units import SoloTrials, SoloUnit, Unit, UnitKind, resume_cap
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.compile_options import cpu_rough_options
from scamp_jax.planning.compile_slots import COMPILE_SLOTS
from scamp_jax.planning.plan_cache import PlanCache
from scamp_jax.scheduling.core import PlanOption, SchedulingCore
from scamp_jax.scheduling.costs import attainable_flops
from scamp_jax.scheduling.host import default_max_running
from scamp_jax.scheduling.placement import FixedPolicy, ScampPolicy, make_policy
from scamp_jax.space import SearchSpace, Task

__all__ = ["BudgetTooSmallError", "EngineConfig", "PlanFn", "PlannedTrial", "SearchEngine",
           "SearchResult", "TrialDeferred", "TrialRecord"]

log = logging.getLogger(__name__)
PlanFn = Callable[..., Any]


@dataclass(frozen=True)
class SearchResult:
    """What one engine run did (finished trials live in the study; this is this run's usage).

    Attributes:
      policy: placement policy name.
      elapsed_s: wall seconds of the engine's run, from its start (before its first ask) to
        its end (after the last trial's, its planners shut down); the process's start-up and
        the report are ``run.overhead``'s ``startup_s`` and ``report_s``.
      usage: `UsageRecorder.summary` figures (memory utilisation, idle device-seconds, ...).
      memory_series: ``(times_s, fractions)`` of reserved memory over time.
      intervals: per device, ``(trial number, start_s, end_s, bytes)`` of every trial it held.
      outcomes: how each trial of this run ended, in finishing order.
      trial_times: ``asked_at``, ``planned_at`` and ``started_at`` (seconds on the clock of
        ``intervals``; None where not reached), and the ``devices`` of its plan (None: none of
        its own, e.g. a fused group's member), of every trial this run asked, ended or not.
      step_cache: ``{"hits": n, "misses": m}`` of the process's cache of trials' jitted steps
        (`scamp_jax.hpo.runner.StepCache`: a trial of an architecture, plan and devices seen
        before takes its step); not JAX's persistent compilation cache, whose loads
        ``run.overhead`` counts.
      scheduling: `SearchEngine.scheduling_info` (budget, booked share, policy parts, when the
        last wave began), what a replay of the run needs besides the trials' records.
    """

    policy: str
    elapsed_s: float
    usage: Mapping[str, float]
    memory_series: tuple[tuple[float, ...], tuple[float, ...]]
    intervals: tuple[tuple[tuple[int, float, float, int], ...], ...]
    outcomes: tuple[TrialOutcome, ...]
    trial_times: tuple[Mapping[str, float | None], ...] = ()
    step_cache: Mapping[str, int] = field(default_factory=dict)
    scheduling: Mapping[str, Any] = field(default_factory=dict)


class SearchEngine:
    """Drive a study: plan, place and run trials concurrently on a pool of devices.

    Args:
      space: the search space.
      task: data, loss and evaluation.
      source: where configurations come from and results go (`OptunaTrialSource` locally).
      config: training and placement settings.
      devices: the device pool (default: all of ``jax.devices()``).
      checkpoint_root: directory for per-trial checkpoints (None: no checkpoints).
      plan_fn: the planner (``planner.plan_mesh`` signature); replaceable for tests.
      on_update: called with the list of `TrialStatus` whenever something changes (live view).
      plan_cache: where fused plans are stored and looked up (``--fuse``): the study's
        ``plans.sqlite``, which ``plan_fn`` usually uses too; None: fused groups are planned
        (compiled) in every run.
      on_notice: called with a line for the user when the engine waits without work of its
        own (e.g. for another process's trials that may still need a retry here), and with
        ``""`` when that wait is over.

    The engine holds a `PlanningService` (``planning``; `make_planning` builds it, a subclass
    may return its own), its `UnitKind` (``kind``: `SoloTrials`, or a `FusionService` with
    ``config.fuse``) and, while it runs, one `TrialRecord` per trial (``records``), the queued
    units (``queue``) and the work in flight (`scamp_jax.hpo.work.Work`).
    """

    #: Whether a run that ends with nothing more to train stops on two runs of first tries
    #: that failed alike (`scamp_jax.hpo.failures`); a process that sees only its own runs of
    #: a study others run too (an MPI rank) keeps to the limit.
    guard_at_end = True

    def __init__(
        self,
        space: SearchSpace,
        task: Task,
        source: TrialSource,
        config: EngineConfig,
        *,
        devices: Sequence[jax.Device] | None = None,
        checkpoint_root: str | Path | None = None,
        plan_fn: PlanFn | None = None,
        on_update: Callable[..., None] | None = None,
        plan_cache: PlanCache | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.space, self.task, self.source, self.config = space, task, source, config
        self.on_notice, self.on_update = on_notice, on_update
        self.devices = list(devices if devices is not None else jax.devices())
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root else None
        self.plan_fn = plan_fn or planner.plan_mesh
        self._grow = grows_last_wave(config, self.devices)
        self.policy: Any = engine_policy(config, len(self.devices), self._grow)
        self.cache = StepCache()
        self.planning = self.make_planning()
        cap = fusion_cap(config.fuse)
        #: how asked trials become units: chosen once
        self.kind: UnitKind = SoloTrials(self.planning) if cap is None else FusionService(
            space, task, cap, self.planning, self.checkpoint_root, plan_cache,
            source.held_siblings)
        self.records: dict[int, TrialRecord] = {}
        self.intake = Intake(source, config.nofit_limit,
                             (len(self.devices), config.need_budget().memory_per_device),
                             lambda number: self.endings.tell_failed(number), on_notice)
        self._t0 = time.monotonic()
        self.budget = config.budget_of(self.devices)
        #: the allowance learnt from the allocator (`scamp_jax.hpo.calibration`), booked by
        #: every plan made from now on
        self.calibration = Calibration(self.budget, plan_cache)
        self.planning.allowance = lambda: self.calibration.allowance_bytes
        #: the decisions (`scamp_jax.scheduling.SchedulingCore`); a fresh one per `run`.
        self.core = new_core(self.policy, self.devices, self.config, self.budget)
        self.pool, self.usage = self.core.pool, self.core.usage

    def make_planning(self) -> PlanningService:
        """The planning service of this engine (a subclass may plan otherwise)."""
        return PlanningService(self.space, self.task, self.config, self.devices, self.plan_fn,
                               getattr(self.policy, "batch_multiple", 1), self._may_grow(),
                               max_running=max_running(self.config, self.devices))

    def _may_grow(self) -> bool:
        """Whether a queued ScaMP trial may start on more devices at the end of a study."""
        return (self._grow and isinstance(self.policy, ScampPolicy)
                and self.config.reference_batch is not None)

    def plan(self, params: Mapping[str, Any], **kw: Any) -> Any:
        """`PlanningService.plan` of this engine."""
        return self.planning.plan(params, **kw)

    def fixed_batch_size(self) -> int:
        """`PlanningService.fixed_batch_size` of this engine."""
        return self.planning.fixed_batch_size()

    @property
    def deferred(self) -> list[tuple[AskedTrial, TrialDeferred]]:
        """Trials whose plan raised `TrialDeferred`: ``(asked, exception)``, in planning
        order (the caller runs them, e.g. across MPI ranks)."""
        return self.intake.deferred

    # ---------------------------------------------------------------------------- the loop
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _notify(self) -> None:
        if self.on_update is not None:
            statuses = [r.status for r in self.records.values()]
            self.on_update(statuses, self.pool, **self.kind.view(self.records))

    def _checkpointed(self, number: int, step: int, seconds: float) -> None:
        """A run of trial ``number`` wrote a checkpoint ``seconds`` into the run (on its own
        thread): the study stores the trial's seconds so far, its earlier runs' included, so
        that an attempt whose process dies is counted up to the checkpoint its retry resumes
        from (`scamp_jax.hpo.report.trial_records`)."""
        record = self.records.get(number)
        earlier = 0.0 if record is None else record.earlier_wall
        try:
            self.source.progress(number, earlier + seconds)
        except Exception as err:  # noqa: BLE001 - a record of the seconds must not fail a trial
            log.warning("trial %d: its seconds so far were not stored (%s: %s); its outcome "
                        "stores them", number, type(err).__name__, err)

    def _submit(self, item: work.Work, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        # new trials' plans wait behind the work of trials planned before (`work.PlannerPool`)
        submit = self._planner.submit if item.stage == work.PLAN else self._planner.submit_first
        self.work[submit(fn, *args, **kw)] = item

    def run(self) -> SearchResult:
        """Run trials until the study has its total; returns this run's usage figures.

        Raises `BudgetTooSmallError` if no candidate fits the pool, and
        `scamp_jax.hpo.failures.RepeatedFailureError` when the run's first trials all fail with
        one error (``config.failure_limit`` of them; they go back to the study). On
        ``KeyboardInterrupt``
        running trials are checkpointed and marked interrupted (a re-run resumes them), then the
        interrupt propagates; finished trials are already in the study.
        """
        self._t0 = time.monotonic()
        # Wall-clock start: which run of a resumed study a trial's record belongs to.
        self._run_started = round(time.time(), 6)
        self.core = new_core(self.policy, self.devices, self.config, self.budget)
        self.pool, self.usage = self.core.pool, self.core.usage
        self.records = {}
        self.queue: dict[int, Unit] = {}  # the units in the core's queue, by key
        self.work: dict[cf.Future, work.Work] = {}
        self.endings = Endings(
            self.source, self.task.metric, self.config, self.core, self.records, self._now,
            self._decide, self._start, lambda planned: self._queue(SoloUnit(planned)),
            lambda p, request: self._submit(
                work.replanning(p.number, lambda f: self._replanned(p, f)),
                plan_again, self.planning, p, request),
            self._notify, self.checkpoint_root)
        self.intake.reset()
        self._proposal: int | None = None  # the last proposal with siblings held for it
        self._last_wave_at: float | None = None
        self.kind.reset()
        lookahead = queue_depth(self.config, self.devices)
        self._launch = Launcher(self.space, self.task, self.config, self.devices,
                                self.checkpoint_root, self.source.report, self.cache,
                                on_checkpoint=self._checkpointed)
        if self.devices and self.devices[0].platform == "cpu":
            # Which guidance compiles this XLA offers: a probe compile once per process, here
            # rather than in the first plan (it is not an architecture's)
            cpu_rough_options()
        # Planning compiles; planner threads overlap it with training and with each other.
        self._planner = work.PlannerPool(self.config.planner_threads,
                                         thread_name_prefix="planner")
        self.resizer = None if not (self._grow and self.checkpoint_root) else TailResizer(
            self.core, self.planning, len(self.devices), self._planner.submit,
            lambda planned: SoloUnit(planned).trial_plan(self.planning), self._now,
            self.calibration.refresh)
        try:
            # as many compiles at once as planner threads, trial threads' own included (and
            # one of a run's beyond them)
            with COMPILE_SLOTS.limited(self.config.planner_threads):
                while self._turn(lookahead):
                    pass
                if self.guard_at_end:  # all this run made failed alike
                    self.endings.check_failures(ended=True)
        except BaseException as err:
            self._give_back(interrupted=isinstance(err, KeyboardInterrupt | RepeatedFailureError),
                            discard=isinstance(err, RepeatedFailureError),
                            pressed=type(err) is KeyboardInterrupt)  # not SIGTERM's Terminated
            raise
        self._planner.shutdown(wait=True)
        self._launch.close()
        try:
            self.endings.finish()
        except BaseException:
            # the study refused a held failure's tell: it, those still held and every trial
            # still waiting here (misfits held back, deferred ones) go back
            self._give_back()
            raise
        self.intake.finish()
        return self.result_so_far()

    def result_so_far(self) -> SearchResult:
        """This run's figures up to now (its usage, timeline, outcomes): what `run` returns,
        and, after an interrupt, what the record of the interrupted run keeps."""
        return search_result(self.policy.name, self._now(), self.usage, self.endings.outcomes,
                             self.cache, self.scheduling_info(),
                             [r.times for r in self.records.values()])

    def _turn(self, lookahead: int) -> bool:
        """One turn of the loop: ask, group, wait for the next events and handle them; False
        once the study has nothing more for this engine."""
        # A proposal's siblings are asked with it, past the lookahead, while the study holds
        # any: their architecture is decided and planned once for the family, and its group
        # waits for those still held or being planned.
        while (self.intake.may_ask()
               and (self._siblings_due() > 0 or len(self.core.queued)
                    + sum(w.arriving for w in self.work.values()) < lookahead)):
            if not self._ask():
                self._proposal = None
                break
        self._form()
        self._set_last_wave()
        if not (self.core.queued or self.work or self.kind.forming):
            if self.intake.exhausted:
                return False
            self.intake.wait()
            return True
        self._feed_pace()
        self._calibrate()
        if self.resizer is not None and self._last_wave_at is not None and not self.core.queued:
            self.resizer.tick({n: r for n, r in self._running().items() if r.group is None})
        self._notify()
        waiting = [*self.work, *(self.resizer.futures() if self.resizer else ())]
        if not waiting:
            # Nothing runs and nothing is being planned, yet trials wait: a policy bug.
            raise RuntimeError(
                f"placement started none of {len(self.core.queued)} queued trials on an idle "
                "pool; check the trials' device counts against the pool")
        done, _ = cf.wait(waiting, timeout=0.5, return_when=cf.FIRST_COMPLETED)
        self._calibrate()  # runs that just ended measured their last peak
        for future in sorted((f for f in done if f in self.work),
                             key=lambda f: self.work[f].order()):
            # an event is handled whole: a Ctrl-C between a run's end and its tell (or a
            # trial's start and its listing as running) would lose its trial to both
            with stops_held():
                item = self.work.pop(future)
                try:
                    item.done(future)
                except BaseException:
                    self.work[future] = item  # its trials go back to the study with the rest
                    raise
        self.endings.check_failures()  # the first trials all failed alike: stop
        self._notify()
        return True

    # ------------------------------------------------------------------------ admission
    @stops_held()  # from the study's ask until the trial is listed: a Ctrl-C gives it back
    def _ask(self) -> bool:
        """Ask for one configuration and start planning it; False when there is none now."""
        asked = self.intake.ask()
        if asked is None:
            return False
        if asked.siblings:  # the source hands its held siblings to this engine next
            self._proposal = asked.number
        record = self.records.setdefault(
            asked.number, TrialRecord(TrialStatus(asked.number, asked.params,
                                                  retry_of=asked.retry_of), asked,
                                      self.config.steps_for))
        record.status.state = "planning"
        # a retry resumes its checkpoints: planned at most at their batch, however planned
        self.planning.cap_batch(asked.number,
                                resume_cap(asked, self.checkpoint_root, self.config))
        record.times.setdefault("asked_at", self._now())
        record.times["run_started"] = self._run_started
        self._submit(work.planning(asked.number, asked.params,
                                   lambda f: self._planned(asked, f)),
                     self.kind.plan_job(asked))
        self._notify()
        return True

    def _siblings_due(self) -> int:
        """Siblings of the last proposal the study still holds for this engine (a sibling it
        rejected, or gave up, is not due)."""
        if self._proposal is None:
            return 0
        due = self.source.held_siblings(self._proposal)
        if not due:
            self._proposal = None
        return due

    def _planned(self, asked: AskedTrial, future: cf.Future) -> None:
        """Event: trial ``asked``'s plan is in (or it does not fit, or it is deferred); the
        unit kind queues it or holds it for a group."""
        record = self.records[asked.number]
        plan = self.intake.sort(asked, future, record.status)
        if plan is None:
            self._notify()
        else:
            # Arrival is the ask order, so placement stays first-come first-served whatever
            # order the plans finish in.
            planned = PlannedTrial(asked, plan, PlanningService.devices_of(plan), asked.number)
            unit = self.kind.admit(planned, record)
            if unit is not None:
                self._queue(unit)
        self._set_last_wave()  # if its plan did not queue it

    @stops_held()
    def _form(self) -> None:
        """Queue the units the unit kind forms of the trials it holds (fused groups); a stop
        waits until every unit formed is queued or being sized (the trials have left the
        kind's buffer: a stop between two would leave the others in no list it gives back)."""
        planning = [w.params for w in self.work.values() if w.params is not None]
        stalled = not planning and (self.intake.exhausted or not self._running())
        formed = self.kind.form(planning, stalled)
        for numbers, job in formed.sizing:
            self._submit(work.sizing(numbers, self._sized), job)
        for unit in formed.units:
            self._queue(unit)

    def _sized(self, future: cf.Future) -> None:
        """Event: a group is sized at its own width."""
        self._queue(future.result())
        self._set_last_wave()  # if that was the last group being sized

    def _queue(self, unit: Unit) -> None:
        """Event: ``unit`` waits for devices, booking the allowance learnt so far (a
        provisional plan, made for a fused group, is planned again first: a trial trains
        alone only on a compiled plan)."""
        if unit.provisional:
            planned = unit.members[0]
            self.records[planned.number].status.state = "planning"
            self._submit(work.verifying(planned.number, lambda f: self._verified(planned, f)),
                         self.planning.planned_with_cost, planned.asked.params, planned.number)
            return
        fresh = unit.booked_with(self.calibration)
        if fresh is None:
            unit.misfit(self.endings.oom)
            return
        event = fresh.queued(self.records)
        self.queue[fresh.key] = fresh
        now = self._now()
        tp = fresh.trial_plan(self.planning)
        self.records[fresh.key].queued(now, tp, event)
        for member in fresh.members:  # a group's events are its key's; its plan is everyone's
            self.records[member.number].times.setdefault("planned_at", now)
        if event == "requeued":
            self.core.requeue(now, tp)
        else:
            self.core.planned(now, tp)
        self._set_last_wave(now, decide=False)  # this may have been the last plan
        self._decide(now)

    def _verified(self, planned: PlannedTrial, future: cf.Future) -> None:
        """Event: the compiled plan of ``planned`` (provisional before) is in, or it fits
        nowhere alone (then it ends as a misfit does)."""
        plan = self.intake.sort(planned.asked, future, self.records[planned.number].status)
        if plan is not None:
            self._queue(SoloUnit(replace(planned, plan=plan,
                                         devices=PlanningService.devices_of(plan))))
        self._set_last_wave()

    def _replanned(self, planned: PlannedTrial, future: cf.Future) -> None:
        """Event: ``planned``'s next plan is in (`scamp_jax.hpo.out_of_memory`), or planning
        it failed (a compile error: the trial fails, the study goes on)."""
        try:
            retry, error = future.result(), None
        except Exception as err:  # noqa: BLE001 - one trial's plan must not stop the study
            retry, error = None, err
        self.endings.oom.replanned(planned, retry, error)
        self._set_last_wave()

    @stops_held()  # from a unit's pop off the queue until it is queued again
    def _calibrate(self) -> None:
        """Event: running units measured the allocator's peak on their devices; an excess over
        the most the ledger booked there grows the allowance (`scamp_jax.hpo.calibration`),
        and every queued unit is then booked again with it."""
        if not self.calibration.learn(self._running(), self.core):
            return
        now, waiting = self._now(), self.core.queued
        for key in waiting:  # all out first: none starts on its old booking meanwhile
            self.core.unqueue(now, key)
            self.records[key].log("unqueued", now)
        for key in waiting:
            self._queue(self.queue.pop(key))

    def _set_last_wave(self, now: float | None = None, decide: bool = True) -> None:
        """Event: nothing more to ask or plan (the study's last wave), at ``now`` (the time of
        the event that made it so: the replay applies both before deciding)."""
        last = (self.intake.exhausted and not any(w.pending for w in self.work.values())
                and not self.kind.forming)
        if last and self._last_wave_at is None:
            self._last_wave_at = self._now() if now is None else now
            self.core.set_arrivals_pending(False)
            if decide:
                self._decide(self._last_wave_at)

    # ---------------------------------------------------------------------------- running
    def _running(self) -> dict[int, TrialRecord]:
        """The records of the running units (solo trials and groups' leaders), by key."""
        return {n: r for n, r in self.records.items()
                if r.run is not None and r.run.key == n}

    def _feed_pace(self) -> None:
        """Events: measured seconds per step of the running trials (`TrialRecord.pace`)."""
        for number in list(self.core.running):
            pace = self.records[number].pace(self._t0)
            if pace is not None:
                self.core.step_measured(pace[0], number, *pace[1:])
                self._decide(pace[0])

    @stops_held()  # from a unit's pop off the queue until its run is listed
    def _decide(self, now: float) -> None:
        """Ask the core what to start at ``now`` (the time of the event just fed) and act."""
        for action in self.core.decide(now):
            record = self.records[action.key]
            if isinstance(action, PlanOption):
                planned = self.queue[action.key].members[0]
                record.log("option_asked", now, action.devices)
                record.status.state = "planning"  # for more devices: said while it compiles
                self._submit(work.option(action.key, functools.partial(self._option, action)),
                             self.planning.planned_with_cost, planned.asked.params, action.key,
                             devices=action.devices)
                continue
            unit = self.queue.pop(action.key)
            if action.plan.devices != unit.devices:
                plan = record.grown.pop(action.plan.devices)
                record.show_plan(plan)
                unit = unit.grown(plan, action.plan.devices)
            self._start(unit, action.device_ids, now)

    def _option(self, action: PlanOption, future: cf.Future) -> None:
        """Event: the plan of a queued trial on more devices is in (or did not fit)."""
        try:
            plan = future.result()
        except (planner.DoesNotFitError, TrialDeferred):
            plan = None
        except Exception as err:  # noqa: BLE001 - an option is an offer: the trial waits as is
            log.warning("trial %d: planning it on %d devices failed (%s); it keeps its plan",
                        action.key, action.devices, ending(err)[1])
            plan = None
        unit = self.queue.get(action.key)
        if unit is None:
            return
        record, tp = self.records[action.key], None
        if record.status.state == "planning":
            record.status.state = "queued"
        if plan is not None and PlanningService.devices_of(plan) == action.devices:
            plan = self.calibration.refresh(plan)  # the allowance learnt while it compiled
        if plan is not None and PlanningService.devices_of(plan) == action.devices:
            record.grown[action.devices] = plan
            tp = unit.grown(plan, action.devices).trial_plan(self.planning)
        now = self._now()
        record.log("option", now, action.devices, None if tp is None else tp.as_dict())
        self.core.option_planned(action.key, action.devices, tp)
        self._decide(now)

    @stops_held()  # until the run is listed as running: a Ctrl-C then gives it back
    def _start(self, unit: Unit, device_ids: Sequence[int], now: float) -> None:
        """Start ``unit`` on the pool's devices ``device_ids`` (booked in the core at
        ``now``)."""
        records = [self.records[m.number] for m in unit.members]
        booked = self.pool.request_of(unit.key).bytes_per_device
        for record in records:
            record.placed(now, device_ids, [self.devices[i].id for i in device_ids])
            record.status.booked_bytes = booked
            record.booked_allowance = unit.allowance
        run = unit.start(self._launch, device_ids, [r.status for r in records])
        for record in records:
            record.run = run
        self.work[run.future] = work.running(
            unit.key, lambda f: unit.ended(self.endings, f.result()))

    def _give_back(self, interrupted: bool = False, discard: bool = False,
                   pressed: bool = False) -> None:
        """When the engine stops: every run stops (they checkpoint) and every unfinished trial
        of this engine goes back to the study (`Endings.give_back`); ``interrupted`` (a Ctrl-C,
        SIGTERM, or the study's repeated failures): the user is told what happens meanwhile
        (``pressed``: the stop was a Ctrl-C's, and another one stops at once);
        ``discard``: what the trials trained under a bug is deleted (`Endings.give_back`)."""
        runs = [r.run for r in self._running().values() if r.run is not None]
        waiting = [n for w in self.work.values() for n in w.trials]
        waiting += [m.number for unit in self.queue.values() for m in unit.members]
        waiting += [*self.kind.waiting(), *(asked.number for asked, _ in self.deferred)]
        waiting += self.intake.held_back()
        self.endings.give_back(runs, waiting, self.on_notice if interrupted else None,
                               discard=discard, pressed=pressed)
        # Plans under way cannot be cut short (a compile runs to its end); said, as a long
        # compile's silence would read as a hang. Those not begun are cancelled.
        compiling = sum(1 for future in self.work if future.running())
        if interrupted and compiling and self.on_notice is not None:
            self.on_notice(f"stopping: waiting for {counted(compiling, 'plan')} under way to "
                           "finish compiling (the trials are back in the study); "
                           f"{second_ctrl_c(pressed=pressed)}")
        self._planner.shutdown(wait=True, cancel_futures=True)
        self._launch.close()

    def scheduling_info(self) -> dict[str, Any]:
        """What the replay of this run needs besides the trials' own records
        (`scheduling_info`)."""
        return {**scheduling_info(self.policy, self.config, self.core, self._grow,
                                  self.checkpoint_root is not None,
                                  getattr(self, "_last_wave_at", None), len(self.devices)),
                "allowance_bytes": self.calibration.by_kind,
                "allowance_grew": list(self.calibration.observations),
                "run_started": getattr(self, "_run_started", None),
                "waited_for_held_trials_s": round(self.intake.waited_s, 3)}

def scheduling_info(policy: Any, config: EngineConfig, core: SchedulingCore, grow: bool,
                    checkpoints: bool, last_wave_at: float | None, devices: int,
                    ) -> dict[str, Any]:
    """What the replay of a run needs besides the trials' own records: the budget, the booked
    share, the policy parts that were active and when the last wave began."""
    parts: dict[str, Any] = {"policy": policy.name}
    if isinstance(policy, ScampPolicy):
        parts.update({f.name: getattr(policy, f.name) for f in fields(policy) if f.init})
        parts["grow_last_wave"] = grow and config.reference_batch is not None
        parts["resize_running"] = policy.resize_running and grow and checkpoints
    else:
        parts["devices_per_trial"] = policy.devices_per_trial
    budget = config.need_budget()
    return {
        "memory_per_device": budget.memory_per_device,
        "safety_margin": budget.safety_margin,
        "usable_bytes_per_device": core.capacity,
        "peak_flops": core.peak_flops,
        "restart_seconds": config.restart_seconds,
        "pool_devices": devices,
        "max_running": core.max_running,
        "overlap": core.overlap,
        "planner_threads": config.planner_threads,
        "policy_parts": parts,
        "last_wave_at": last_wave_at,
        "search": config.run_record(),
    }


def search_result(policy: str, end: float, usage: Any, outcomes: Sequence[TrialOutcome],
                  cache: StepCache, scheduling: Mapping[str, Any],
                  times: Sequence[Mapping[str, Any]] = ()) -> SearchResult:
    """A run's `SearchResult` from its usage recorder at ``end`` (seconds since its start);
    ``times``: the `TrialRecord.times` of the trials it asked."""
    intervals = tuple(
        tuple((iv.key, iv.start, float(iv.end if iv.end is not None else end), iv.bytes)
              for iv in device)
        for device in usage.busy_intervals(end)
    )
    return SearchResult(
        policy=policy, elapsed_s=end, usage=usage.summary(end),
        memory_series=usage.memory_utilization_series(), intervals=intervals,
        outcomes=tuple(outcomes),
        trial_times=tuple({**{k: t.get(k) for k in ("asked_at", "planned_at", "started_at")},
                           "devices": (t.get("plan") or {}).get("devices")} for t in times),
        step_cache={"hits": cache.hits, "misses": cache.misses},
        scheduling=scheduling,
    )


def grows_last_wave(config: EngineConfig, devices: Sequence[Any]) -> bool:
    """Whether the study's last wave may put idle devices to work (``--elastic``): as
    ``config`` says, else (auto) on accelerators and not on CPU devices, which share one host's
    cores."""
    grow = config.grow_last_wave
    return grow if grow is not None else any(d.platform != "cpu" for d in devices)


def engine_policy(config: EngineConfig, devices: int, grow: bool = True) -> Any:
    """The placement policy of ``config`` on a pool of ``devices``; ``grow``: the last wave
    may grow (`grows_last_wave`), else ScaMP's elastic steps are off."""
    if config.policy != "fixed":
        return make_policy("scamp", elastic=grow)
    check_pool(config, devices)
    return FixedPolicy(config.devices_per_trial)


def check_pool(config: EngineConfig, devices: int) -> None:
    """Raise ``ValueError`` where ``config`` cannot place a trial on a pool of ``devices``
    (``policy="fixed"`` with more devices per trial than the pool has); a study checks it
    before it is opened (`scamp_jax.hpo.session.StudySession`), so a refused run stores
    nothing."""
    if config.policy == "fixed" and config.devices_per_trial > devices:
        raise ValueError(
            f"devices_per_trial={config.devices_per_trial} exceeds the pool of {devices} "
            f"devices; lower devices_per_trial to {devices} or less, or pass "
            f"devices={config.devices_per_trial} (a larger pool)")


def new_core(policy: Any, devices: Sequence[Any], config: EngineConfig,
             budget: Budget) -> SchedulingCore:
    """A scheduling core for a pool of ``devices`` of ``budget`` each, under ``config`` and
    ``policy``. The devices' attainable FLOP/s (`scamp_jax.scheduling.costs`) anchor the busy
    fractions where the kind is known."""
    kinds = {d.device_kind for d in devices}
    peak = attainable_flops(kinds.pop()) if len(kinds) == 1 else None
    overlap = config.device_overlap
    if overlap is None:
        overlap = 1.0 if all(d.platform == "cpu" for d in devices) else 0.0
    return SchedulingCore(policy, len(devices), budget, config.restart_seconds, peak_flops=peak,
                          max_running=max_running(config, devices), overlap=overlap)


def queue_depth(config: EngineConfig, devices: Sequence[Any]) -> int:
    """Asked-but-unplaced trials the engine keeps queued under ``config`` on ``devices``: its
    ``lookahead``, else one per device, but no more than may run at once (`max_running` runs,
    each a fused group of up to `fusion_cap` trials where the study fuses): a trial asked past
    that waits here while another process of the study could train it."""
    if config.lookahead:
        return config.lookahead
    runs = max_running(config, devices)
    if runs is None:
        return max(1, len(devices))
    return max(1, min(len(devices), runs * (fusion_cap(config.fuse) or 1)))


def max_running(config: EngineConfig, devices: Sequence[Any]) -> int | None:
    """Most trials running at once under ``config`` on ``devices`` (None: no cap)."""
    cap = config.max_running_trials
    if isinstance(cap, str):  # "auto", the one word `EngineConfig` takes
        return default_max_running(devices)
    return cap
