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

Each trial's record (``results.json``) holds what the core was fed, so a finished study can be
replayed through it (`scamp_jax.scheduling.replay`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import jax

from scamp_jax.hpo.fused_engine import FusionService, fusion_cap
from scamp_jax.hpo.plan_service import PlanningService, TrialDeferred
from scamp_jax.hpo.runner import (
    RunResult,
    RunSpec,
    StepCache,
    TrialStatus,
    run_trial,
    trial_seed,
)
from scamp_jax.hpo.study import AskedTrial, AskLater, TrialOutcome, TrialSource
from scamp_jax.planning import planner
from scamp_jax.planning.plan_cache import PlanCache
from scamp_jax.scheduling.core import PlanOption, SchedulingCore, TrialPlan
from scamp_jax.scheduling.costs import attainable_flops
from scamp_jax.scheduling.elastic import Resize
from scamp_jax.scheduling.host import default_max_running
from scamp_jax.scheduling.placement import FixedPolicy, Placement, ScampPolicy, make_policy
from scamp_jax.space import SearchSpace, Task

log = logging.getLogger(__name__)
PlanFn = Callable[..., Any]


class BudgetTooSmallError(ValueError):
    """No candidate fits the device pool: the memory budget or the device count is too small."""


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
      lookahead: asked-but-unplaced trials to keep queued (None: number of devices).
      nofit_limit: consecutive candidates that fit nowhere, with none fitting before, after
        which the study stops with `BudgetTooSmallError`.
      seed: base seed of initialisation and data streams.
      rank: process rank recorded with each trial (0 on a single host).
      planner_threads: configurations planned at once (each plan is a few compiles).
      grow_last_wave: in a study's last wave (nothing left to ask), let ScaMP start a queued
        trial data-parallel on 2x, 4x, ... its planned devices when they would otherwise idle
        (needs ``reference_batch``: a larger global batch then means fewer steps). None: on for
        accelerators, off for CPU devices, which split one host's cores and so gain no speed
        from more of them (only extra compiles). The same switch lets ScaMP, once nothing is
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

    def __post_init__(self) -> None:
        fusion_cap(self.fuse)  # raises on a bad value
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


@dataclass(frozen=True)
class PlannedTrial:
    """An asked configuration with its plan, waiting for devices."""

    asked: AskedTrial
    plan: Any
    devices: int
    arrival: int
    replans: int = 0

    @property
    def number(self) -> int:
        """The study's trial number."""
        return self.asked.number


@dataclass(frozen=True)
class _Restart:
    """A running trial's restart on more devices: the new plan and placement, and what it ran
    on before (to fall back on if the new run fails before training a step)."""

    grown: PlannedTrial
    placement: Placement
    before: PlannedTrial
    old_placement: Placement
    old_plan: TrialPlan
    since: float = math.inf  # time.monotonic() when the new run was started


@dataclass(frozen=True)
class _Run:
    """A run in a worker thread: the trial, its stop event (Ctrl-C or a restart) and future."""

    planned: PlannedTrial
    stop: threading.Event
    future: cf.Future


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



def booked_bytes(plan: Any) -> int:
    """Bytes per device a trial of ``plan`` books: everything it holds at once (training step,
    prefetched batch, evaluation: `scamp_jax.planning.planner.Plan.predicted_peak_bytes`)."""
    return int(getattr(plan, "predicted_peak_bytes", plan.peak_bytes_per_device))

class SearchEngine(PlanningService, FusionService):
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
        on_update: Callable[[Sequence[TrialStatus], Any], None] | None = None,
        plan_cache: PlanCache | None = None,
        on_notice: Callable[[str], None] | None = None,
    ) -> None:
        self.space, self.task, self.source, self.config = space, task, source, config
        self.plan_cache = plan_cache
        self.on_notice = on_notice
        self.devices = list(devices if devices is not None else jax.devices())
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root else None
        self.plan_fn = plan_fn or planner.plan_mesh
        self.on_update = on_update
        self.capacity = [config.memory_per_device] * len(self.devices)
        if config.policy == "fixed":
            if config.devices_per_trial > len(self.devices):
                raise ValueError(
                    f"devices_per_trial={config.devices_per_trial} exceeds the pool of "
                    f"{len(self.devices)} devices; lower it or pass more devices"
                )
            self.policy: Any = FixedPolicy(config.devices_per_trial)
        else:
            self.policy = make_policy("scamp")
        self.cache = StepCache()
        self.statuses: dict[int, TrialStatus] = {}
        self._init_planning()
        self._init_fusion()
        self._oom_results: dict[int, RunResult] = {}
        grow = config.grow_last_wave
        self._grow = (grow if grow is not None
                      else any(d.platform != "cpu" for d in self.devices))
        self._ever_fit = False
        self._nofit: list[int] = []
        #: trials whose plan raised `TrialDeferred`: ``(asked, exception)``, in planning order.
        self.deferred: list[tuple[AskedTrial, TrialDeferred]] = []
        self._t0 = time.monotonic()
        #: the decisions (`scamp_jax.scheduling.SchedulingCore`); a fresh one per `run`.
        self.core = self._new_core()
        self.pool, self.usage = self.core.pool, self.core.usage

    def _new_core(self) -> SchedulingCore:
        """A scheduling core for this engine's pool, budget and policy. The devices' attainable
        FLOP/s (`scamp_jax.scheduling.costs`) anchor the busy fractions where the kind is
        known."""
        kinds = {d.device_kind for d in self.devices}
        peak = attainable_flops(kinds.pop()) if len(kinds) == 1 else None
        return SchedulingCore(self.policy, len(self.devices), self.config.memory_per_device,
                              self.config.safety_margin, self.config.restart_seconds,
                              peak_flops=peak, max_running=self._max_running())

    def _max_running(self) -> int | None:
        cap = self.config.max_running_trials
        return default_max_running(self.devices) if cap == "auto" else cap

    def _trial_plan(self, planned: PlannedTrial) -> TrialPlan:
        """``planned`` as the scheduling core sees it."""
        plan = planned.plan
        grow = (self._grow and isinstance(self.policy, ScampPolicy)
                and self.config.reference_batch is not None)
        flops = self._flops_of.get((planned.number, planned.devices, int(plan.batch_size)))
        return TrialPlan(
            key=planned.number, arrival=planned.arrival, devices=planned.devices,
            bytes_per_device=booked_bytes(plan),
            steps=self.config.steps_for(int(plan.batch_size)), flops_per_step=flops,
            data_parallel=int(plan.data_parallel), model_parallel=int(plan.model_parallel),
            batch_size=int(plan.batch_size),
            grow_bytes=int(plan.usable_bytes) if grow else 0,
        )

    # ---------------------------------------------------------------------------- the loop
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _notify(self) -> None:
        if self.on_update is not None:
            if self.fusing:
                self.on_update(list(self.statuses.values()), self.pool,
                               groups=self.fusion_groups())
            else:
                self.on_update(list(self.statuses.values()), self.pool)

    def _ask(self) -> bool:
        """Ask for one configuration and start planning it; False when there is none: the
        study is full (``_exhausted``) or the source said to ask again later (``_ask_at``)."""
        asked = self.source.ask()
        if isinstance(asked, AskLater):
            self._ask_at = time.monotonic() + asked.seconds
            self._later = asked
            return False
        if asked is None:
            self._exhausted = True
            return False
        self._later = None
        if self._noticed is not None and self.on_notice is not None:
            self._noticed = None
            self.on_notice("")  # the wait is over
        status = self.statuses.setdefault(asked.number, TrialStatus(asked.number, asked.params))
        status.state = "planning"
        self._timeline(asked.number).setdefault("asked_at", self._now())
        if self.fusing:
            ckpt = self.checkpoint_root / asked.checkpoint_key if self.checkpoint_root else None
            future = self._planner.submit(self._planned_for_fusion, asked.params, asked.number,
                                          ckpt)
        else:
            future = self._planner.submit(self._planned_with_cost, asked.params, asked.number)
        self._planning[future] = asked
        self._notify()
        return True

    def _enqueue(self, asked: AskedTrial, planned: cf.Future) -> None:
        status = self.statuses[asked.number]
        try:
            plan = planned.result()
        except TrialDeferred as deferred:
            status.state, status.reason = "deferred", str(deferred)
            self.deferred.append((asked, deferred))
            self._notify()
            return
        except planner.DoesNotFitError as err:
            status.state, status.reason = "failed", f"does not fit: {err}"
            if self._ever_fit:
                self._tell(TrialOutcome(asked.number, "failed", reason=status.reason,
                                        attrs=self._attrs(status, 0.0)))
                return
            # Until one candidate fits, a misfit may mean the budget is wrong, not the candidate:
            # hold it back so that a too-small budget stops the study without spending trials.
            self._nofit.append(asked.number)
            if len(self._nofit) >= self.config.nofit_limit:
                self._budget_too_small(err)
            return
        except Exception as err:  # noqa: BLE001 - a candidate that cannot even be built
            status.state, status.reason = "failed", f"{type(err).__name__}: {err}"[:300]
            self._tell(TrialOutcome(asked.number, "failed", reason=status.reason,
                                    attrs=self._attrs(status, 0.0)))
            return
        if not self._ever_fit:
            self._ever_fit = True
            for number in self._nofit:
                status = self.statuses[number]
                self._tell(TrialOutcome(number, "failed", reason=status.reason,
                                        attrs=self._attrs(status, 0.0)))
            self._nofit.clear()
        # Arrival is the ask order, so placement stays first-come first-served whatever order
        # the plans finish in.
        self._admit(PlannedTrial(asked, plan, self._devices_of(plan), asked.number))

    def _budget_too_small(self, err: Exception) -> None:
        for number in self._nofit:  # not their fault: a run with a bigger budget retries them
            self.source.interrupt(number)
        count = len(self._nofit)
        self._nofit.clear()
        raise BudgetTooSmallError(
            f"none of the first {count} candidates fits the pool of {len(self.devices)} "
            f"devices with {self.config.memory_per_device} bytes each (last: {err}); raise "
            "--memory-per-device or --devices, or shrink the search space"
        ) from err

    def _show_plan(self, number: int, plan: Any) -> None:
        """Record ``plan``'s degrees, batch and predicted peak in trial ``number``'s status."""
        status = self.statuses[number]
        status.model_parallel = int(plan.model_parallel)
        status.batch_size = int(plan.batch_size)
        status.predicted_peak_bytes = booked_bytes(plan)
        status.steps = self.config.steps_for(status.batch_size)

    def _queue_planned(self, planned: PlannedTrial) -> None:
        """Event: ``planned`` waits for devices."""
        self.statuses[planned.number].state = "queued"
        self._show_plan(planned.number, planned.plan)
        self._planned[planned.number] = planned
        now = self._now()
        tp = self._trial_plan(planned)
        self._timeline(planned.number).setdefault("planned_at", now)
        self._timeline(planned.number)["plan"] = tp.as_dict()
        if planned.replans:
            self.core.requeue(now, tp)
        else:
            self.core.planned(now, tp)
        self._set_last_wave(now, decide=False)  # this may have been the last plan
        self._decide(now)

    def _timeline(self, number: int) -> dict[str, Any]:
        return self._times.setdefault(number, {"placements": [], "pace": []})

    def _set_last_wave(self, now: float | None = None, decide: bool = True) -> None:
        """Event: nothing more to ask or plan (the study's last wave), at ``now`` (the time of
        the event that made it so: the replay applies both before deciding)."""
        last = (self._exhausted and not self._planning and not self._replanning
                and not self._fusion_pending(forming_only=True))
        if last and self._last_wave_at is None:
            self._last_wave_at = self._now() if now is None else now
            self.core.set_arrivals_pending(False)
            if decide:
                self._decide(self._last_wave_at)

    def _feed_pace(self) -> None:
        """Events: measured seconds per step of the running trials (at 2, 4, 8, ... steps into
        each run, so a long study records a few dozen measurements per trial)."""
        for number in list(self.core.running):
            status = self.statuses[number]
            done = status.step - status.first_step
            if status.state != "training" or done < 2 or math.isnan(status.training_since):
                continue
            if done < self._next_pace.get(number, 2):
                continue
            self._next_pace[number] = 2 * done
            mono = time.monotonic()
            spu = (mono - status.training_since) / done
            now = mono - self._t0
            since = status.training_since - self._t0
            self.core.step_measured(now, number, status.step, spu, since)
            self._timeline(number)["pace"].append([now, status.step, spu, since])
            self._decide(now)

    def _decide(self, now: float) -> None:
        """Ask the core what to start at ``now`` (the time of the event just fed) and act."""
        for action in self.core.decide(now):
            if isinstance(action, PlanOption):
                planned = self._planned[action.key]
                future = self._planner.submit(self._planned_with_cost, planned.asked.params,
                                              action.key, devices=action.devices)
                self._option_plans[future] = action
                continue
            if action.key in self._units:
                self._start_group(action, now)
                continue
            planned = self._planned.pop(action.key)
            if action.plan.devices != planned.devices:
                plan = self._grown_plans.pop((action.key, action.plan.devices))
                self._show_plan(action.key, plan)
                planned = replace(planned, plan=plan, devices=action.plan.devices)
            self._start(Placement(action.key, action.device_ids), planned, now)

    def _option_planned(self, future: cf.Future, action: PlanOption) -> None:
        """Event: the plan of a queued trial on more devices is in (or did not fit)."""
        try:
            plan = future.result()
        except (planner.DoesNotFitError, TrialDeferred):
            plan = None
        planned = self._planned.get(action.key)
        if planned is None:
            return
        tp = None
        if plan is not None and self._devices_of(plan) == action.devices:
            grown = replace(planned, plan=plan, devices=action.devices)
            self._grown_plans[(action.key, action.devices)] = plan
            tp = self._trial_plan(grown)
        self.core.option_planned(action.key, action.devices, tp)
        self._decide(self._now())

    def _attrs(self, status: TrialStatus, wall: float) -> dict[str, Any]:
        times = self._times.get(status.number, {})
        return {
            "devices": list(status.devices),
            "model_parallel": status.model_parallel,
            "batch_size": status.batch_size,
            "predicted_peak_bytes": status.predicted_peak_bytes,
            "steps": status.step,
            "wall_seconds": round(wall, 3),
            "replans": status.replans,
            "resizes": status.resizes,
            "rank": self.config.rank,
            "final_loss": None if math.isnan(status.loss) else status.loss,
            # Seconds since this run's start (full precision: they order the replay's events).
            "asked_at": times.get("asked_at"),
            "planned_at": times.get("planned_at"),
            "started_at": times.get("started_at"),
            "finished_at": times.get("finished_at"),
            "placements": times.get("placements", []),
            "pace": times.get("pace", []),
            "plan": times.get("plan"),
            **self._fusion_attrs(status.number),
        }

    def _tell(self, outcome: TrialOutcome) -> None:
        self.source.tell(outcome)
        self._outcomes.append(outcome)
        self._notify()

    def _resize_tail(self) -> None:
        """Restart running trials on idle devices at the end of the study
        (`scamp_jax.scheduling.elastic`).

        The core decides from the measured paces; a restart decided here is planned for its
        new device count in the planner threads (a few compiles that must not stall this loop);
        once its plan is ready, a later call books the new devices, asks the trial to stop (it
        checkpoints) and the loop starts it again on them when it returns. If another restart
        took those devices meanwhile, it is decided afresh (its plan is cached by then).
        """
        if not self._grow or self.checkpoint_root is None:
            return
        for future, decision in list(self._resize_plans.items()):
            if future.done():
                del self._resize_plans[future]
                if decision.key in self._runs and decision.key not in self._resizing:
                    self._book_resize(decision, future)
        if self._resize_plans:
            return  # decided devices are not booked before their plan is ready: wait for it
        reshapes = {}
        for number, run in self._runs.items():
            if number in self._resizing or run.stop.is_set():
                continue
            plan = run.planned.plan
            dp, mp, batch = int(plan.data_parallel), int(plan.model_parallel), int(plan.batch_size)
            reshapes[number] = [p * mp for p in range(dp + 1, len(self.devices) // mp + 1)
                                if batch % p == 0]
        for r in self.core.resizes(self._now(), reshapes):
            planned = self._runs[r.key].planned
            future = self._planner.submit(self.plan, planned.asked.params,
                                          devices=r.option.devices,
                                          max_batch=int(planned.plan.batch_size))
            self._resize_plans[future] = r

    def _book_resize(self, r: Resize, future: cf.Future) -> None:
        """Book restart ``r`` of a running trial with its compiled plan and stop the trial."""
        run = self._runs[r.key]
        planned = run.planned
        n, batch = r.option.devices, int(planned.plan.batch_size)
        try:
            plan = future.result()
        except Exception as err:  # noqa: BLE001 - no plan for that count: the trial runs on
            log.info("trial %d: no plan on %d devices at batch %d (%s)", r.key, n, batch, err)
            plan = None
        if plan is None or self._devices_of(plan) != n or int(plan.batch_size) != batch:
            self.core.withdraw(r.key, n)  # the planner found no such plan: not again
            return
        # The trial trained on while its plan compiled: is the restart still worth it?
        if not self.core.still_worth(r.key, n) or not self.core.restart_fits(r.key, r.device_ids):
            return
        before = self.core.plan_of(r.key)
        old_ids = self.core.running[r.key]
        grown = replace(planned, plan=plan, devices=n)
        if not self.core.restarted(self._now(), r.key, r.device_ids, self._trial_plan(grown)):
            return  # the compiled plan needs more than the prediction left free
        self._resizing[r.key] = _Restart(grown, Placement(r.key, r.device_ids), planned,
                                         Placement(r.key, old_ids), before)
        self.statuses[r.key].state = "resizing"
        self._show_plan(r.key, plan)
        log.info("trial %d: restarting on %d devices (was %d), batch %d", r.key, n,
                 planned.devices, batch)
        run.stop.set()

    def _start(self, placement: Placement, planned: PlannedTrial, now: float) -> None:
        """Start a run of ``planned`` on ``placement``'s devices (booked in the core at
        ``now``)."""
        ids = placement.device_ids[: planned.devices]
        plan = planned.plan.with_devices([self.devices[i] for i in ids])
        status = self.statuses[planned.number]
        status.devices = tuple(placement.device_ids)
        status.state = "starting"
        times = self._timeline(planned.number)
        times.setdefault("started_at", now)
        times["placements"].append([now, list(placement.device_ids)])
        self._next_pace.pop(planned.number, None)
        checkpoint_dir = (
            self.checkpoint_root / planned.asked.checkpoint_key if self.checkpoint_root else None
        )
        spec = RunSpec(
            number=planned.number,
            params=planned.asked.params,
            plan=plan,
            steps=self.config.steps_for(int(plan.batch_size)),
            memory_per_device=self.config.memory_per_device,
            booked_bytes=booked_bytes(plan),
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=self.config.checkpoint_every,
            eval_every=self.config.eval_every,
            log_every=self.config.log_every,
            seed=trial_seed(self.config.seed, planned.asked.checkpoint_key),
        )
        stop = threading.Event()
        future = self._executor.submit(run_trial, spec, self.space, self.task,
                                       report=self.source.report, status=status, stop=stop,
                                       cache=self.cache)
        self._runs[planned.number] = _Run(planned, stop, future)

    def run(self) -> SearchResult:
        """Run trials until the study has its total; returns this run's usage figures.

        Raises `BudgetTooSmallError` if no candidate fits the pool. On ``KeyboardInterrupt``
        running trials are checkpointed and marked interrupted (a re-run resumes them), then the
        interrupt propagates; finished trials are already in the study.
        """
        self._t0 = time.monotonic()
        self.core = self._new_core()
        self.pool, self.usage = self.core.pool, self.core.usage
        self._outcomes: list[TrialOutcome] = []
        self._times: dict[int, dict[str, Any]] = {}
        self._next_pace: dict[int, int] = {}
        self._planned: dict[int, PlannedTrial] = {}
        self._grown_plans: dict[tuple[int, int], Any] = {}
        self._planning: dict[cf.Future, AskedTrial] = {}
        self._option_plans: dict[cf.Future, PlanOption] = {}
        self._replanning: dict[cf.Future, PlannedTrial] = {}
        self._resize_plans: dict[cf.Future, Resize] = {}
        self._runs: dict[int, _Run] = {}
        self._resizing: dict[int, _Restart] = {}
        self._restarted: dict[int, _Restart] = {}
        self._earlier_wall: dict[int, float] = {}
        self._oom_results = {}
        self._exhausted = False
        self._ask_at = 0.0  # monotonic time before which the source said not to ask again
        self._later: AskLater | None = None  # the source's last "ask again later"
        self._noticed: tuple[int, ...] | None = None  # the trials the last notice named
        self._last_wave_at: float | None = None
        self._init_fusion_run()
        lookahead = self.config.lookahead or len(self.devices)
        self._executor = cf.ThreadPoolExecutor(max_workers=max(4, 4 * len(self.devices)),
                                               thread_name_prefix="trial")
        # Planning compiles; planner threads overlap it with training and with each other.
        self._planner = cf.ThreadPoolExecutor(max_workers=self.config.planner_threads,
                                              thread_name_prefix="planner")
        try:
            while True:
                while (not self._exhausted and time.monotonic() >= self._ask_at
                       and len(self.core.queued) + len(self._planning)
                       + len(self._replanning) < lookahead):
                    if not self._ask():
                        break
                self._form_groups()
                self._set_last_wave()
                busy = (self.core.queued or self._runs or self._planning or self._replanning
                        or self._fusion_pending())
                if not busy:
                    if self._exhausted:
                        break
                    # Nothing of its own to do, but the study may still need work (another
                    # process's trial may go stale): ask again when the source said to.
                    later = self._later
                    if (self.on_notice is not None and later is not None
                            and later.trials != self._noticed):
                        self._noticed = later.trials
                        self.on_notice(
                            f"waiting for trial(s) {list(later.trials)} of another process: "
                            "they finish there, or are run again here once their heartbeat is "
                            "stale (a process that died)")
                    time.sleep(max(0.0, self._ask_at - time.monotonic()))
                    continue
                self._feed_pace()
                if self._last_wave_at is not None and not self.core.queued and self._runs:
                    self._resize_tail()
                self._notify()
                waiting = [*self._planning, *self._replanning,
                           *(f for f in self._option_plans if not f.done()),
                           *(f for f in self._resize_plans if not f.done()),
                           *self._fusion_waiting()]
                runs = {run.future: number for number, run in self._runs.items()}
                groups = self._group_futures()
                if not runs and not groups and not waiting and not any(
                        f.done() for f in (*self._option_plans, *self._resize_plans)):
                    # Nothing runs and nothing is being planned, yet trials wait: a policy bug.
                    raise RuntimeError(
                        f"placement started none of {len(self.core.queued)} queued trials on an "
                        "idle pool; check the trials' device counts against the pool")
                done, _ = cf.wait([*runs, *groups, *waiting, *self._option_plans], timeout=0.5,
                                  return_when=cf.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: self._order_of(f, {**runs, **groups})):
                    if future in self._planning:
                        self._enqueue(self._planning.pop(future), future)
                        self._set_last_wave()  # if its plan did not queue it
                    elif future in self._option_plans:
                        self._option_planned(future, self._option_plans.pop(future))
                    elif future in self._replanning:
                        self._replanned(self._replanning.pop(future), future)
                        self._set_last_wave()
                    elif future in runs:
                        self._run_ended(runs[future], future.result())
                    elif future in groups:
                        self._group_ended(groups[future], future.result())
                    elif self._fusion_event(future):
                        self._set_last_wave()  # if that was the last group being sized
                self._notify()
        except BaseException:
            for run in self._runs.values():
                run.stop.set()
            self._interrupt_fusion()
            for number, run in list(self._runs.items()):
                # The runner checkpoints and returns when it sees `stop`; whatever it says, the
                # trial is unfinished and goes back to the study.
                cf.wait([run.future])
                self.source.interrupt(number)
            for asked in self._planning.values():
                self.source.interrupt(asked.number)
            for planned in self._replanning.values():
                self.source.interrupt(planned.number)
            for number in self.core.queued:
                self.source.interrupt(number)
            for asked, _ in self.deferred:
                self.source.interrupt(asked.number)
            self._planner.shutdown(wait=True, cancel_futures=True)
            self._executor.shutdown(wait=True)
            raise
        self._planner.shutdown(wait=True)
        self._executor.shutdown(wait=True)
        if self._nofit:
            self._budget_too_small(planner.DoesNotFitError(
                self.statuses[self._nofit[-1]].reason, 0, self.config.memory_per_device))
        end = self._now()
        intervals = tuple(
            tuple((iv.key, iv.start, float(iv.end if iv.end is not None else end), iv.bytes)
                  for iv in device)
            for device in self.usage.busy_intervals(end)
        )
        return SearchResult(
            policy=self.policy.name,
            elapsed_s=end,
            usage=self.usage.summary(end),
            memory_series=self.usage.memory_utilization_series(),
            intervals=intervals,
            outcomes=tuple(self._outcomes),
            compile_cache={"hits": self.cache.hits, "misses": self.cache.misses},
            scheduling=self.scheduling_info(),
        )

    def scheduling_info(self) -> dict[str, Any]:
        """What the replay of this run needs besides the trials' own records: the budget, the
        booked share, the policy parts that were active and when the last wave began."""
        policy = self.policy
        parts: dict[str, Any] = {"policy": policy.name}
        if isinstance(policy, ScampPolicy):
            parts.update({f.name: getattr(policy, f.name) for f in fields(policy) if f.init})
            parts["grow_last_wave"] = self._grow and self.config.reference_batch is not None
            parts["resize_running"] = (policy.resize_running and self._grow
                                       and self.checkpoint_root is not None)
        else:
            parts["devices_per_trial"] = policy.devices_per_trial
        return {
            "memory_per_device": self.config.memory_per_device,
            "safety_margin": self.config.safety_margin,
            "usable_bytes_per_device": self.core.capacity,
            "peak_flops": self.core.peak_flops,
            "restart_seconds": self.config.restart_seconds,
            "pool_devices": len(self.devices),
            "max_running": self.core.max_running,
            "policy_parts": parts,
            "last_wave_at": self._last_wave_at,
        }

    def _order_of(self, future: cf.Future, runs: Mapping[cf.Future, int]) -> tuple[int, int]:
        """Handle finished futures in a fixed order: plans by trial number, then run ends."""
        if future in self._planning:
            return (0, self._planning[future].number)
        if future in self._option_plans:
            return (1, self._option_plans[future].key)
        if future in self._replanning:
            return (2, self._replanning[future].number)
        return (3, runs.get(future, -1))

    def _replanned(self, planned: PlannedTrial, future: cf.Future | None) -> None:
        """Event: an out-of-memory trial's next plan is in (None: it fails)."""
        status = self.statuses[planned.number]
        retry = future.result() if future is not None else None
        if retry is None:
            self._report(planned, replace(self._oom_results.pop(planned.number),
                                          state="failed", reason=status.reason
                                          + "; no smaller plan fits"))
            return
        self._oom_results.pop(planned.number, None)
        log.info("trial %d out of memory (%s); re-planned", planned.number, status.reason)
        status.replans = retry.replans
        self._queue_planned(retry)

    def _run_ended(self, number: int, result: RunResult) -> None:
        """Event: trial ``number``'s run returned ``result``."""
        run = self._runs.pop(number)
        planned = run.planned
        self._earlier_wall[number] = self._earlier_wall.get(number, 0.0) + result.wall_seconds
        restart = self._resizing.pop(number, None)
        if restart is not None and result.state == "interrupted":
            self.statuses[number].resizes += 1
            self._restarted[number] = replace(restart, since=time.monotonic())
            self._start(restart.placement, restart.grown, self._now())
            return
        restart = self._restarted.pop(number, None)
        if (restart is not None and result.state in ("oom", "failed")
                and not self.statuses[number].training_since > restart.since):
            # The restarted run never trained: go back to the plan that did.
            log.info("trial %d: restart on %d devices failed (%s); back on %d", number,
                     planned.devices, result.reason, restart.before.devices)
            now = self._now()
            self.core.move_back(now, number, restart.old_placement.device_ids,
                                restart.old_plan)
            self._show_plan(number, restart.before.plan)
            self._start(restart.old_placement, restart.before, now)
            return
        now = self._now()
        self._timeline(number)["finished_at"] = now
        status = self.statuses[number]
        if result.state == "oom":
            status.reason = result.reason
            request = self.core.out_of_memory(
                now, number, result.bytes_needed, min_batch=self.config.min_batch_size or 1,
                may_grow=self.config.policy == "scamp")
            self._oom_results[number] = result
            if request is None or planned.replans >= self.config.max_replans:
                self._replanned(planned, None)
            else:
                self._replanning[self._planner.submit(self._plan_again, planned,
                                                      request)] = planned
                status.state = "planning"
            self._decide(now)
            return
        self.core.finished(now, number)
        self._report(planned, result)
        self._decide(now)

    def _report(self, planned: PlannedTrial, result: RunResult) -> None:
        status = self.statuses[planned.number]
        if result.state == "interrupted":
            self.source.interrupt(planned.number)
            return
        metric = result.metrics.get(self.task.metric)
        wall = self._earlier_wall.pop(planned.number, 0.0)
        attrs = self._attrs(status, wall)
        attrs["metrics"] = dict(result.metrics)
        attrs["checkpoint"] = str(result.checkpoint) if result.checkpoint else None
        attrs["resumed_from"] = result.resumed_from
        status.state = result.state
        status.reason = result.reason
        self._tell(TrialOutcome(planned.number, result.state,
                                value=metric if result.state == "complete" else None,
                                reason=result.reason, attrs=attrs))
