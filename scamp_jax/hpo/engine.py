"""The search loop: ask, plan, let the scheduling core decide, run concurrently, tell.

Every placement decision is made by a `scamp_jax.scheduling.SchedulingCore` (pure: events in,
actions out; the cluster simulator drives the same core). This module is the loop around it:

1. ask the `TrialSource` for configurations (a few more than can run, so placement has choice);
   an `AskLater` answer (other processes' trials may still need retries) is asked again after
   its seconds, and the loop ends only once the source answers ``None``;
2. plan each one in the planner threads (`planner.plan_mesh`, cached per architecture): device
   count, model-parallel degree, the largest batch that fits, the predicted peak per device, and
   the step's FLOPs per device from ``cost_analysis()`` of the lowered step;
3. feed the core its events: a plan ready, a run's measured seconds per step, a run ended, the
   last wave begun; the core books the pool (usable bytes per device) and answers with trials to
   start on device ids, or larger plans to compile first (last-wave growth);
4. run each started trial in a worker thread on its own sub-mesh (`runner.run_trial`);
5. when a trial ends, tell the study. An out-of-memory trial is re-planned in the planner
   threads (never on this loop's thread) at a batch scaled by the bytes its run measured, or on
   twice the devices, and queued again;
6. at the end of the study, on accelerators, restart running trials from a checkpoint on the
   devices that fell idle, with the same global batch (the core's `resizes`);
7. with ``EngineConfig.fuse``, group planned trials of one architecture into fused groups, each
   one scheduled unit (`scamp_jax.hpo.fused_engine`).

The engine is composed, not mixed: it holds a `PlanningService` (plans, their cache and costs,
in the planner threads), a `FusionService` (grouping, with ``fuse``) and a `TailResizer`
(restarts at the end, on accelerators), and while it runs one `TrialRecord` per trial (its
status, plan while queued, run, timeline, restarts) and one map of the work in flight (`Work`:
plans, re-plans, runs, groups being sized).

Each trial's record (``results.json``) holds what the core was fed, so a finished study can be
replayed through it (`scamp_jax.scheduling.replay`).
"""


from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import jax

from scamp_jax.hpo.calibration import Calibration
from scamp_jax.hpo.endings import Endings
from scamp_jax.hpo.fused_engine import FusionService
from scamp_jax.hpo.intake import BudgetTooSmallError, Intake
from scamp_jax.hpo.launch import Launcher, Run
from scamp_jax.hpo.out_of_memory import plan_again
from scamp_jax.hpo.plan_service import PlanningService
from scamp_jax.hpo.resizing import Restart, TailResizer
from scamp_jax.hpo.runner import StepCache
from scamp_jax.hpo.study.trials import AskedTrial, TrialOutcome, TrialSource
from scamp_jax.hpo.trial import (
    PlannedTrial,
    RunResult,
    TrialDeferred,
    TrialStatus,
    booked_bytes,
    fusion_cap,
)
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.plan_cache import PlanCache
from scamp_jax.scheduling.core import PlanOption, SchedulingCore, Start, TrialPlan
from scamp_jax.scheduling.costs import attainable_flops
from scamp_jax.scheduling.host import default_max_running
from scamp_jax.scheduling.placement import FixedPolicy, Placement, ScampPolicy, make_policy
from scamp_jax.space import SearchSpace, Task

__all__ = ["BudgetTooSmallError", "EngineConfig", "PlanFn", "PlannedTrial", "SearchEngine",
           "SearchResult", "TrialDeferred", "TrialRecord"]

log = logging.getLogger(__name__)
PlanFn = Callable[..., Any]


@dataclass(frozen=True)
class EngineConfig:
    """How the engine trains and places trials.

    Attributes:
      steps: training steps per trial (at ``reference_batch`` when that is set).
      memory_per_device: device budget in bytes that plans and compiled steps must respect.
      policy: ``"scamp"`` (memory-aware packing, planner's batch) or ``"fixed"`` (baseline).
      devices_per_trial: devices every trial gets under the fixed policy.
      max_batch_size: upper bound on any trial's global batch (None: as large as memory allows).
      min_batch_size: smallest global batch a ScaMP plan may train with (None: any). A
        configuration whose largest fitting batch on the whole pool is smaller does not fit
        (under MPI it spans ranks instead, see `scamp_jax.distributed.engine`); out-of-memory
        re-plans never halve a batch below it.
      reference_batch: if set, a trial at global batch ``b`` trains
        ``ceil(steps * reference_batch / b)`` steps, so every trial sees the same number of
        samples whatever batch its plan allows.
      fixed_batch_size: the fixed policy's one batch size; None: the largest batch the space's
        ``largest`` candidate fits on ``devices_per_trial`` devices.
      safety_margin: fraction of the budget the planner keeps free for estimation error.
      checkpoint_every: steps between orbax checkpoints (0: only at the end).
      eval_every: steps between intermediate evaluations reported to the pruner (0: none).
      log_every: steps between loss read-backs.
      max_replans: out-of-memory re-plans of one trial before it is failed.
      lookahead: asked-but-unplaced trials to keep queued (None: number of devices); a fused
        proposal's siblings are asked with it even past this.
      nofit_limit: consecutive candidates that fit nowhere, with none fitting before, after
        which the study stops with `BudgetTooSmallError`.
      seed: base seed of initialisation and data streams.
      rank: process rank recorded with each trial (0 on a single host).
      planner_threads: configurations planned at once (each plan is a few compiles).
      grow_last_wave: in a study's last wave (nothing left to ask), let ScaMP start a queued
        trial data-parallel on 2x, 4x, ... its planned devices when they would otherwise idle
        (needs ``reference_batch``: a larger global batch then means fewer steps). None: on for
        accelerators, off for CPU devices, where ScaMP plans each trial from the start on the
        devices its share of the host's cores gives it (`cpu_trial_devices` in
        `scamp_jax.scheduling.host`, measured there); twice those devices gained about 1.1x
        more, not worth a trial's extra compiles. The same switch lets ScaMP, once nothing is
        queued or left to ask, stop a running trial at a checkpoint and restart it with the same
        global batch on its devices plus idle ones (`scamp_jax.scheduling.elastic`; needs a
        checkpoint root).
      restart_seconds: predicted cost of such a restart (checkpoint, compile, restore),
        seconds; None: the trial's own start-up time in its current run.
      fuse: horizontal fusion (`scamp_jax.hpo.fused_engine`): None (off), ``K`` (queued trials of
        one architecture train in fused groups of at most ``K``, as wide as fits) or
        ``"auto"`` (as wide as fits, capped).
      max_running_trials: most trials (or fused groups) training at once, the rest queued:
        ``"auto"`` (on CPU devices, which share the host's cores, one per two cores as
        measured in `scamp_jax.scheduling.host`; no cap on accelerators), a positive int, or
        None (as many as the pool's memory holds).
      device_overlap: how much trials sharing one device overlap, in [0, 1], for the
        scheduling core's busy fractions (`scamp_jax.scheduling.costs.shared_load`; the cluster
        simulator's ``ClusterModel.overlap``): 0, strict turns (JAX programs of several threads
        on one GPU mostly take turns on its queue, so the last wave packs no trial beside a
        measured one); 1, free overlap. None: 0 on accelerators, 1 on CPU devices, where
        ``max_running_trials`` already bounds how many trials share the host's cores.
    """

    steps: int
    memory_per_device: int
    policy: str = "scamp"
    devices_per_trial: int = 2
    max_batch_size: int | None = None
    min_batch_size: int | None = None
    reference_batch: int | None = None
    fixed_batch_size: int | None = None
    safety_margin: float = 0.1
    checkpoint_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    max_replans: int = 3
    lookahead: int | None = None
    nofit_limit: int = 3
    seed: int = 0
    rank: int = 0
    planner_threads: int = 2
    grow_last_wave: bool | None = None
    restart_seconds: float | None = None
    fuse: int | str | None = None
    max_running_trials: int | str | None = "auto"
    device_overlap: float | None = None

    def __post_init__(self) -> None:
        fusion_cap(self.fuse)  # raises on a bad value
        if self.device_overlap is not None and not 0 <= self.device_overlap <= 1:
            raise ValueError(f"device_overlap={self.device_overlap} must be in [0, 1] (0: "
                             "strict turns on a device, 1: free overlap) or None")
        cap = self.max_running_trials
        if cap != "auto" and cap is not None and (
                isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_running_trials={cap!r} must be 'auto', a positive int or "
                             "None (no cap)")
        if self.restart_seconds is not None and self.restart_seconds < 0:
            raise ValueError(f"restart_seconds={self.restart_seconds} must be >= 0 or None")
        if self.planner_threads < 1:
            raise ValueError(f"planner_threads={self.planner_threads} must be at least 1")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1")
        if self.memory_per_device <= 0:
            raise ValueError(f"memory_per_device={self.memory_per_device} bytes must be positive")
        if self.policy not in ("scamp", "fixed"):
            raise ValueError(f"unknown policy {self.policy!r}; choose 'scamp' or 'fixed'")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be at least 1 or None")
        if self.min_batch_size is not None:
            if self.min_batch_size < 1:
                raise ValueError(
                    f"min_batch_size={self.min_batch_size} must be at least 1 or None")
            if self.max_batch_size is not None and self.min_batch_size > self.max_batch_size:
                raise ValueError(
                    f"min_batch_size={self.min_batch_size} exceeds max_batch_size="
                    f"{self.max_batch_size}; raise the cap or lower the floor")

    def steps_for(self, batch_size: int) -> int:
        """Training steps of a trial at global ``batch_size`` (see ``reference_batch``)."""
        if self.reference_batch is None:
            return self.steps
        return max(1, math.ceil(self.steps * self.reference_batch / batch_size))



#: Handling order of work that finishes at once: plans by trial number, then runs.
_ORDER = {"plan": 0, "option": 1, "replan": 2, "verify": 2, "run": 3, "group": 3, "size": 3}


@dataclass(frozen=True)
class Work:
    """What a future in flight is: ``plan`` (an `AskedTrial` being planned), ``option`` (a
    `PlanOption`), ``replan`` (a `PlannedTrial` after out of memory), ``run`` / ``group`` (the
    key of a running unit), ``size`` (the members of a group sized at its own width) or
    ``verify`` (a `PlannedTrial` whose provisional plan is planned again to train alone)."""

    kind: str
    payload: Any

    def order(self) -> tuple[int, int]:
        """Sort key among futures done at once (a fixed order, whatever finished first)."""
        p = self.payload
        key = {"plan": lambda: p.number, "replan": lambda: p.number,
               "verify": lambda: p.number, "option": lambda: p.key,
               "run": lambda: p, "group": lambda: p}.get(self.kind, lambda: -1)()
        return _ORDER[self.kind], key


@dataclass
class TrialRecord:
    """Everything the search loop knows of one trial while it runs (one record per trial).

    ``planned``: its plan while it waits in the core's queue; ``grown``: its plans on more
    devices the core asked for (by device count); ``run``: the unit it runs in; ``times``: its
    timeline (planned/started/finished, placements, measured paces, the core's plan);
    ``next_pace``: steps at which its pace is next fed; ``earlier_wall``: seconds of its earlier
    runs (restarts); ``oom``: its out-of-memory result while it is re-planned; ``resizing`` /
    ``restarted``: a restart on more devices decided / started; ``group``, ``width``: its fused
    group (None: alone); ``solo_only``: its group ran out of memory, it runs alone;
    ``booked_allowance``: the allowance its run's booking carries; ``calibrated``: the last
    measured peak the loop learnt from (`scamp_jax.hpo.calibration`).
    """

    status: TrialStatus
    asked: AskedTrial
    steps_for: Callable[[int], int] = lambda batch: 0
    planned: PlannedTrial | None = None
    grown: dict[int, Any] = field(default_factory=dict)
    run: Run | None = None
    times: dict[str, Any] = field(default_factory=lambda: {"placements": [], "pace": []})
    next_pace: int = 2
    earlier_wall: float = 0.0
    oom: RunResult | None = None
    resizing: Restart | None = None
    restarted: Restart | None = None
    group: int | None = None
    width: int = 1
    solo_only: bool = False
    booked_allowance: int = 0
    calibrated: int | None = None

    def show_plan(self, plan: Any) -> None:
        """Record ``plan``'s degrees, batch, booking and steps in the status."""
        status = self.status
        status.model_parallel = int(plan.model_parallel)
        status.batch_size = int(plan.batch_size)
        status.predicted_peak_bytes = booked_bytes(plan)
        status.steps = self.steps_for(status.batch_size)

    def queued(self, now: float, plan: TrialPlan, kind: str = "planned") -> None:
        """Event: the scheduling core holds this trial (or its group, keyed by it) as ``plan``
        (``kind``: ``"planned"``, or ``"requeued"`` after an out-of-memory re-plan)."""
        self.times.setdefault("planned_at", now)
        self.times["plan"] = plan.as_dict()
        self.log(kind, now, plan.as_dict())

    def log(self, kind: str, now: float, *data: Any) -> None:
        """Record an event the scheduling core was fed for this trial (or its group):
        ``[kind, seconds since the run's start, *data]`` (`scamp_jax.scheduling.replay`)."""
        self.times.setdefault("core", []).append([kind, now, *data])

    def placed(self, now: float, device_ids: Sequence[int]) -> None:
        """Event: a run of this trial starts at ``now`` on ``device_ids``."""
        self.status.devices = tuple(device_ids)
        self.status.state = "starting"
        self.times.setdefault("started_at", now)
        self.times["placements"].append([now, list(device_ids)])
        self.next_pace = 2

    def pace(self, t0: float) -> tuple[float, int, float, float] | None:
        """``(now, step, seconds per step, since)`` of this trial's run, seconds since ``t0``,
        at 2, 4, 8, ... steps into the run (so a long study records a few dozen measurements
        per trial); None when no measurement is due."""
        status = self.status
        done = status.step - status.first_step
        if status.state != "training" or done < max(2, self.next_pace):
            return None
        if math.isnan(status.training_since):
            return None
        self.next_pace = 2 * done
        mono = time.monotonic()
        pace = (mono - t0, status.step, (mono - status.training_since) / done,
                status.training_since - t0)
        self.times["pace"].append(list(pace))
        return pace

    def attrs(self, rank: int, wall: float) -> dict[str, Any]:
        """The trial's attributes in the study (its ``results.json`` record)."""
        status, times = self.status, self.times
        return {
            "devices": list(status.devices),
            "model_parallel": status.model_parallel,
            "batch_size": status.batch_size,
            "predicted_peak_bytes": status.predicted_peak_bytes,
            "steps": status.step,
            "wall_seconds": round(wall, 3),
            "replans": status.replans,
            "resizes": status.resizes,
            "booked_bytes": status.booked_bytes,
            "measured_peak_bytes": status.measured_peak_bytes,
            "rank": rank,
            "final_loss": None if math.isnan(status.loss) else status.loss,
            # Seconds since this run's start (full precision: they order the replay's events).
            "asked_at": times.get("asked_at"),
            "planned_at": times.get("planned_at"),
            "started_at": times.get("started_at"),
            "finished_at": times.get("finished_at"),
            "placements": times.get("placements", []),
            "pace": times.get("pace", []),
            "plan": times.get("plan"),
            "fused_group": self.group,
            "fusion_width": self.width,
            "core_events": times.get("core", []),
            "run_started": times.get("run_started"),
        }


@dataclass(frozen=True)
class SearchResult:
    """What one engine run did (finished trials live in the study; this is this run's usage).

    Attributes:
      policy: placement policy name.
      elapsed_s: wall seconds from the first ask to the last trial's end.
      usage: `UsageRecorder.summary` figures (memory utilisation, idle device-seconds, ...).
      memory_series: ``(times_s, fractions)`` of reserved memory over time.
      intervals: per device, ``(trial number, start_s, end_s, bytes)`` of every trial it held.
      outcomes: how each trial of this run ended, in finishing order.
      compile_cache: ``{"hits": n, "misses": m}`` of the shared step cache.
      scheduling: `SearchEngine.scheduling_info` (budget, booked share, policy parts, when the
        last wave began), what a replay of the run needs besides the trials' records.
    """

    policy: str
    elapsed_s: float
    usage: Mapping[str, float]
    memory_series: tuple[tuple[float, ...], tuple[float, ...]]
    intervals: tuple[tuple[tuple[int, float, float, int], ...], ...]
    outcomes: tuple[TrialOutcome, ...]
    compile_cache: Mapping[str, int] = field(default_factory=dict)
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
    may return its own), a `FusionService` (``fusion``, None without ``config.fuse``) and, while
    it runs, one `TrialRecord` per trial (``records``) and the work in flight (`Work`).
    """

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
        self.policy: Any = engine_policy(config, len(self.devices))
        grow = config.grow_last_wave
        self._grow = grow if grow is not None else any(d.platform != "cpu" for d in self.devices)
        self.cache = StepCache()
        self.planning = self.make_planning()
        cap = fusion_cap(config.fuse)
        self.fusion = None if cap is None else FusionService(
            space, task, cap, self.planning, config.steps_for, plan_cache)
        self.records: dict[int, TrialRecord] = {}
        self.intake = Intake(source, config.nofit_limit,
                             (len(self.devices), config.memory_per_device),
                             lambda number: self.endings.tell_failed(number), on_notice)
        self._t0 = time.monotonic()
        self.budget = Budget.of_devices(self.devices, config.memory_per_device,
                                        safety_margin=config.safety_margin)
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

    @property
    def statuses(self) -> dict[int, TrialStatus]:
        """Every trial's live status, by number."""
        return {n: r.status for n, r in self.records.items()}

    # ---------------------------------------------------------------------------- the loop
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _notify(self) -> None:
        if self.on_update is not None:
            statuses = [r.status for r in self.records.values()]
            groups = {n: (r.group, r.width) for n, r in self.records.items() if r.group is not None}
            self.on_update(statuses, self.pool, **({"groups": groups} if self.fusion else {}))

    def _submit(self, kind: str, payload: Any, fn: Callable[..., Any], *args: Any,
                **kw: Any) -> None:
        self.work[self._planner.submit(fn, *args, **kw)] = Work(kind, payload)

    def _in_flight(self, *kinds: str) -> list[Any]:
        return [w.payload for w in self.work.values() if w.kind in kinds]

    def _ask(self) -> bool:
        """Ask for one configuration and start planning it; False when there is none now."""
        asked = self.intake.ask()
        if asked is None:
            return False
        # The source hands a proposal's held siblings to this engine next (a queued retry may
        # come first: then one sibling fewer is asked past the lookahead).
        self._siblings_due = asked.siblings or max(0, self._siblings_due - 1)
        record = self.records.setdefault(
            asked.number, TrialRecord(TrialStatus(asked.number, asked.params), asked,
                                      self.config.steps_for))
        record.status.state = "planning"
        record.times.setdefault("asked_at", self._now())
        record.times["run_started"] = self._run_started
        if self.fusion is not None:
            ckpt = self.checkpoint_root / asked.checkpoint_key if self.checkpoint_root else None
            self._submit("plan", asked, self.fusion.prepare, asked.params, asked.number, ckpt,
                         self.fusion.family_width(asked))
        else:
            self._submit("plan", asked, self.planning.planned_with_cost, asked.params,
                         asked.number)
        self._notify()
        return True

    def _enqueue(self, asked: AskedTrial, future: cf.Future) -> None:
        """Event: trial ``asked``'s plan is in (or it does not fit, or it is deferred)."""
        plan = self.intake.sort(asked, future, self.records[asked.number].status)
        if plan is None:
            self._notify()
            return
        # Arrival is the ask order, so placement stays first-come first-served whatever order
        # the plans finish in.
        self._admit(PlannedTrial(asked, plan, PlanningService.devices_of(plan), asked.number))

    def _admit(self, planned: PlannedTrial) -> None:
        """Event: ``planned`` is planned; it waits for a group (fusion) or for devices."""
        record = self.records[planned.number]
        if self.fusion is None or record.solo_only:
            self._queue_planned(planned)
            return
        record.status.state = "grouping"
        record.show_plan(planned.plan)
        # Grouped by the loop's next `_form_groups`, after it has asked for more trials (the
        # members this one may wait for).
        self.fusion.admit(planned)

    def _form_groups(self) -> None:
        """Hand the groups the grouping service decides to the scheduling core."""
        if self.fusion is None:
            return
        planning = self._in_flight("plan")
        stalled = not planning and (self.intake.exhausted or not self._running())
        formed = self.fusion.form((a.params for a in planning), stalled)
        for planned in formed.alone:
            self.records[planned.number].group, self.records[planned.number].width = None, 1
            self._queue_planned(planned)
        for members in formed.to_size:
            # A group narrower than its architecture's plan is sized at its own width first,
            # so it books what it holds.
            self._submit("size", members, self.fusion.narrower, members)
        for members, fusion in formed.units:
            self._queue_unit(members, fusion)

    def _queue_unit(self, members: tuple[PlannedTrial, ...], fusion: Any) -> None:
        """Event: a group and its plan are decided; the scheduling core gets it as one trial
        (booking the allowance learnt so far; its members run alone if that does not fit)."""
        assert self.fusion is not None
        fusion = self.calibration.refresh(fusion)
        if fusion is None:
            for m in members:
                self.endings.oom.member_ended(m)
            return
        for m in members:
            record = self.records[m.number]
            record.group, record.width = members[0].number, len(members)
            record.status.state = "queued"
        tp = self.fusion.queue(members, fusion)
        now = self._now()  # per group: queueing a trial above fed the core a later time
        self.records[tp.key].queued(now, tp)
        self.core.planned(now, tp)
        self._decide(now)

    def _queue_planned(self, planned: PlannedTrial) -> None:
        """Event: ``planned`` waits for devices (a provisional plan, made for a fused group,
        is planned again first: a trial trains alone only on a compiled plan)."""
        record = self.records[planned.number]
        if getattr(planned.plan, "provisional", False):
            record.status.state = "planning"
            self._submit("verify", planned, self.planning.planned_with_cost,
                         planned.asked.params, planned.number)
            return
        plan = self.calibration.refresh(planned.plan)  # the allowance learnt so far
        if plan is None:
            self.endings.oom.no_longer_fits(planned)
            return
        planned = replace(planned, plan=plan)
        record.status.state = "queued"
        record.show_plan(planned.plan)
        record.planned = planned
        now = self._now()
        tp = self.planning.core_plan(planned)
        record.queued(now, tp, "requeued" if planned.replans else "planned")
        if planned.replans:
            self.core.requeue(now, tp)
        else:
            self.core.planned(now, tp)
        self._set_last_wave(now, decide=False)  # this may have been the last plan
        self._decide(now)

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
            unit = self.fusion.units.pop(key, None) if self.fusion is not None else None
            if unit is not None:
                self._queue_unit(unit.members, unit.fusion)
                continue
            planned, self.records[key].planned = self.records[key].planned, None
            assert planned is not None
            self._queue_planned(planned)

    def _verified(self, planned: PlannedTrial, future: cf.Future) -> None:
        """Event: the compiled plan of ``planned`` (provisional before) is in, or it fits
        nowhere alone (then it ends as a misfit does)."""
        plan = self.intake.sort(planned.asked, future, self.records[planned.number].status)
        if plan is not None:
            self._queue_planned(replace(planned, plan=plan,
                                        devices=PlanningService.devices_of(plan)))
        self._set_last_wave()

    def _set_last_wave(self, now: float | None = None, decide: bool = True) -> None:
        """Event: nothing more to ask or plan (the study's last wave), at ``now`` (the time of
        the event that made it so: the replay applies both before deciding)."""
        last = (self.intake.exhausted
                and not self._in_flight("plan", "replan", "size", "verify")
                and not (self.fusion is not None and self.fusion.forming))
        if last and self._last_wave_at is None:
            self._last_wave_at = self._now() if now is None else now
            self.core.set_arrivals_pending(False)
            if decide:
                self._decide(self._last_wave_at)

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

    def _decide(self, now: float) -> None:
        """Ask the core what to start at ``now`` (the time of the event just fed) and act."""
        for action in self.core.decide(now):
            if isinstance(action, PlanOption):
                planned = self.records[action.key].planned
                assert planned is not None
                self.records[action.key].log("option_asked", now, action.devices)
                self._submit("option", action, self.planning.planned_with_cost,
                             planned.asked.params, action.key, devices=action.devices)
                continue
            if self.fusion is not None and action.key in self.fusion.units:
                self._start_group(action, now)
                continue
            record = self.records[action.key]
            planned, record.planned = record.planned, None
            assert planned is not None
            if action.plan.devices != planned.devices:
                plan = record.grown.pop(action.plan.devices)
                record.show_plan(plan)
                planned = replace(planned, plan=plan, devices=action.plan.devices)
            self._start(Placement(action.key, action.device_ids), planned, now)

    def _option_planned(self, future: cf.Future, action: PlanOption) -> None:
        """Event: the plan of a queued trial on more devices is in (or did not fit)."""
        try:
            plan = future.result()
        except (planner.DoesNotFitError, TrialDeferred):
            plan = None
        record = self.records[action.key]
        if record.planned is None:
            return
        tp = None
        if plan is not None and PlanningService.devices_of(plan) == action.devices:
            grown = replace(record.planned, plan=plan, devices=action.devices)
            record.grown[action.devices] = plan
            tp = self.planning.core_plan(grown)
        now = self._now()
        record.log("option", now, action.devices, None if tp is None else tp.as_dict())
        self.core.option_planned(action.key, action.devices, tp)
        self._decide(now)

    def _start(self, placement: Placement, planned: PlannedTrial, now: float) -> None:
        """Start a run of ``planned`` on ``placement``'s devices (booked in the core at
        ``now``)."""
        record = self.records[planned.number]
        record.placed(now, placement.device_ids)
        record.status.booked_bytes = self.pool.request_of(planned.number).bytes_per_device
        record.booked_allowance = int(getattr(planned.plan, "allowance_bytes", 0))
        record.run = self._launch.solo(planned, placement.device_ids, record.status)
        self.work[record.run.future] = Work("run", planned.number)

    def _start_group(self, action: Start, now: float) -> None:
        """Start the group ``action.key`` on its placement's devices."""
        assert self.fusion is not None
        unit = self.fusion.units.pop(action.key)
        ids = action.device_ids[: unit.members[0].devices]
        spec = self.fusion.group_spec(unit, [self.devices[i] for i in ids], self.config,
                                      self.checkpoint_root)
        records = [self.records[m.number] for m in unit.members]
        for record in records:
            record.placed(now, action.device_ids)
            record.status.booked_bytes = self.pool.request_of(unit.key).bytes_per_device
            record.booked_allowance = int(getattr(unit.fusion.plan, "allowance_bytes", 0))
        run = self._launch.group(unit, spec, [r.status for r in records])
        for record in records:
            record.run = run
        self.work[run.future] = Work("group", unit.key)

    def run(self) -> SearchResult:
        """Run trials until the study has its total; returns this run's usage figures.

        Raises `BudgetTooSmallError` if no candidate fits the pool. On ``KeyboardInterrupt``
        running trials are checkpointed and marked interrupted (a re-run resumes them), then the
        interrupt propagates; finished trials are already in the study.
        """
        self._t0 = time.monotonic()
        # Wall-clock start: which run of a resumed study a trial's record belongs to.
        self._run_started = round(time.time(), 6)
        self.core = new_core(self.policy, self.devices, self.config, self.budget)
        self.pool, self.usage = self.core.pool, self.core.usage
        self.records = {}
        self.work: dict[cf.Future, Work] = {}
        self.endings = Endings(
            self.source, self.task.metric, self.config, self.core, self.records, self._now,
            self._decide, self._start, self._queue_planned,
            lambda p, request: self._submit("replan", p, plan_again, self.planning, p, request),
            self._notify)
        self.intake.reset()
        self._siblings_due = 0  # siblings of the last proposal not asked yet
        self._last_wave_at: float | None = None
        if self.fusion is not None:
            self.fusion.reset()
        lookahead = self.config.lookahead or len(self.devices)
        self._launch = Launcher(self.space, self.task, self.config, self.devices,
                                self.checkpoint_root, self.source.report, self.cache,
                                workers=max(4, 4 * len(self.devices)))
        # Planning compiles; planner threads overlap it with training and with each other.
        self._planner = cf.ThreadPoolExecutor(max_workers=self.config.planner_threads,
                                              thread_name_prefix="planner")
        self.resizer = None if not (self._grow and self.checkpoint_root) else TailResizer(
            self.core, self.planning, len(self.devices), self._planner.submit,
            self.planning.core_plan, self._now)
        try:
            while self._turn(lookahead):
                pass
        except BaseException as err:
            self._give_back(interrupted=isinstance(err, KeyboardInterrupt))
            raise
        self._planner.shutdown(wait=True)
        self._launch.close()
        self.intake.finish()
        return search_result(self.policy.name, self._now(), self.usage, self.endings.outcomes,
                             self.cache, self.scheduling_info())

    def _turn(self, lookahead: int) -> bool:
        """One turn of the loop: ask, group, wait for the next events and handle them; False
        once the study has nothing more for this engine."""
        # A proposal's siblings are asked with it, past the lookahead: their architecture is
        # decided and planned once for the family, and its group waits for all of them.
        while (self.intake.may_ask()
               and (self._siblings_due > 0 or len(self.core.queued)
                    + len(self._in_flight("plan", "replan")) < lookahead)):
            if not self._ask():
                self._siblings_due = 0
                break
        self._form_groups()
        self._set_last_wave()
        forming = self.fusion is not None and bool(self.fusion.forming)
        if not (self.core.queued or self.work or forming):
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
            work = self.work.pop(future)
            if work.kind == "plan":
                self._enqueue(work.payload, future)
                self._set_last_wave()  # if its plan did not queue it
            elif work.kind == "option":
                self._option_planned(future, work.payload)
            elif work.kind == "replan":
                self.endings.oom.replanned(work.payload, future.result())
                self._set_last_wave()
            elif work.kind == "run":
                self.endings.run_ended(work.payload, future.result())
            elif work.kind == "group":
                self.endings.group_ended(work.payload, future.result().members)
            elif work.kind == "size":
                self._queue_unit(work.payload, future.result())
                self._set_last_wave()  # if that was the last group being sized
            elif work.kind == "verify":
                self._verified(work.payload, future)
        self._notify()
        return True

    def _give_back(self, interrupted: bool = False) -> None:
        """On an interrupt: stop every run (they checkpoint) and give every unfinished trial
        of this engine back to the study (whatever a stopped run says, its trial is
        unfinished). ``interrupted``: by Ctrl-C, which the user is told what happens to."""
        runs = [r.run for r in self._running().values() if r.run is not None]
        for run in runs:
            run.stop.set()
        if interrupted and runs and self.on_notice is not None:
            trials = sum(len(run.members) for run in runs)  # a fused group's members each
            self.on_notice(f"stopping: {trials} running trial(s) end at their next step "
                           "(with a checkpoint where checkpoints are on) and go back to the "
                           "study, where a re-run resumes them; Ctrl-C again stops at once")
        cf.wait([run.future for run in runs])
        waiting = [m.number for run in runs for m in run.members]
        for work in self.work.values():
            if work.kind in ("plan", "replan", "verify"):
                waiting.append(work.payload.number)
            elif work.kind == "size":
                waiting.extend(m.number for m in work.payload)
        waiting += [*self.core.queued, *(self.fusion.waiting() if self.fusion else ()),
                    *(asked.number for asked, _ in self.deferred)]
        for number in dict.fromkeys(waiting):  # once each: a queued group's key is a member's
            self.source.interrupt(number)
        self._planner.shutdown(wait=True, cancel_futures=True)
        self._launch.close()

    def scheduling_info(self) -> dict[str, Any]:
        """What the replay of this run needs besides the trials' own records
        (`scheduling_info`)."""
        return {**scheduling_info(self.policy, self.config, self.core, self._grow,
                                  self.checkpoint_root is not None,
                                  getattr(self, "_last_wave_at", None), len(self.devices)),
                "allowance_bytes": self.calibration.by_kind,
                "run_started": getattr(self, "_run_started", None)}


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
    return {
        "memory_per_device": config.memory_per_device,
        "safety_margin": config.safety_margin,
        "usable_bytes_per_device": core.capacity,
        "peak_flops": core.peak_flops,
        "restart_seconds": config.restart_seconds,
        "pool_devices": devices,
        "max_running": core.max_running,
        "overlap": core.overlap,
        "policy_parts": parts,
        "last_wave_at": last_wave_at,
    }


def search_result(policy: str, end: float, usage: Any, outcomes: Sequence[TrialOutcome],
                  cache: StepCache, scheduling: Mapping[str, Any]) -> SearchResult:
    """A run's `SearchResult` from its usage recorder at ``end`` (seconds since its start)."""
    intervals = tuple(
        tuple((iv.key, iv.start, float(iv.end if iv.end is not None else end), iv.bytes)
              for iv in device)
        for device in usage.busy_intervals(end)
    )
    return SearchResult(
        policy=policy, elapsed_s=end, usage=usage.summary(end),
        memory_series=usage.memory_utilization_series(), intervals=intervals,
        outcomes=tuple(outcomes), compile_cache={"hits": cache.hits, "misses": cache.misses},
        scheduling=scheduling,
    )


def engine_policy(config: EngineConfig, devices: int) -> Any:
    """The placement policy of ``config`` on a pool of ``devices``."""
    if config.policy != "fixed":
        return make_policy("scamp")
    if config.devices_per_trial > devices:
        raise ValueError(
            f"devices_per_trial={config.devices_per_trial} exceeds the pool of {devices} "
            "devices; lower it or pass more devices")
    return FixedPolicy(config.devices_per_trial)


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


def max_running(config: EngineConfig, devices: Sequence[Any]) -> int | None:
    """Most trials running at once under ``config`` on ``devices`` (None: no cap)."""
    cap = config.max_running_trials
    return default_max_running(devices) if cap == "auto" else cap
