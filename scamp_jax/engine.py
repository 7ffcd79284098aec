"""The search loop: ask, plan, queue, place, run concurrently, tell.

One `SearchEngine.run` call drives a study to its total number of trials:

1. ask the `TrialSource` for configurations (a few more than can run, so placement has choice);
2. plan each one abstractly (`planner.plan_mesh`): device count, model-parallel degree, the
   largest batch that fits, the predicted peak per device (plans are cached per architecture);
3. let the placement policy (`ScampPolicy` packs by memory, `FixedPolicy` is the fixed-resources
   baseline) decide which queued trials start now and on which devices;
4. run each started trial in a worker thread on its own sub-mesh (`runner.run_trial`);
5. when a trial ends, release its devices, record its usage and tell the study. An out-of-memory
   trial is re-planned (smaller batch first, then more devices) and queued again;
6. at the end of the study (nothing queued or left to ask), on accelerators, restart running
   trials from a checkpoint on the devices that fell idle, with the same global batch
   (`scamp_jax.elastic`).

Only the runner touches devices; the loop itself is bookkeeping around pure decisions.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from scamp_jax import planner
from scamp_jax.elastic import Resize, RunningTrial, resizes
from scamp_jax.placement import (
    DeviceOption,
    FixedPolicy,
    Placement,
    ScampPolicy,
    TrialRequest,
    make_policy,
)
from scamp_jax.pool import DevicePool
from scamp_jax.runner import (
    RunResult,
    RunSpec,
    StepCache,
    TrialStatus,
    make_optimizer,
    run_trial,
    trial_seed,
)
from scamp_jax.space import SearchSpace, Task
from scamp_jax.study import AskedTrial, TrialOutcome, TrialSource
from scamp_jax.train_step import split_model
from scamp_jax.usage import UsageRecorder

log = logging.getLogger(__name__)
PlanFn = Callable[..., Any]


class BudgetTooSmallError(ValueError):
    """No candidate fits the device pool: the memory budget or the device count is too small."""


class TrialDeferred(Exception):  # noqa: N818 - a hand-over, not an error
    """Raised by `SearchEngine.plan` for a trial this engine hands to someone else to run.

    The engine neither fails nor places it: it is listed in `SearchEngine.deferred` with this
    exception, whose ``payload`` says what the caller needs to run it (e.g. the MPI engine's
    trials that span ranks). Deferred trials stay open in the study until the caller tells them.
    """

    def __init__(self, message: str, payload: Any = None) -> None:
        super().__init__(message)
        self.payload = payload


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
        global batch on its devices plus idle ones (`scamp_jax.elastic`; needs a checkpoint
        root).
      restart_seconds: predicted cost of such a restart (checkpoint, compile, restore),
        seconds; None: the trial's own start-up time in its current run.
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

    def __post_init__(self) -> None:
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
    old_request: TrialRequest
    since: float = math.inf  # time.monotonic() when the new run was started


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
    """

    policy: str
    elapsed_s: float
    usage: Mapping[str, float]
    memory_series: tuple[tuple[float, ...], tuple[float, ...]]
    intervals: tuple[tuple[tuple[int, float, float, int], ...], ...]
    outcomes: tuple[TrialOutcome, ...]
    compile_cache: Mapping[str, int] = field(default_factory=dict)


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
    ) -> None:
        self.space, self.task, self.source, self.config = space, task, source, config
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
        self.pool = DevicePool(self.capacity)
        self.cache = StepCache()
        self.statuses: dict[int, TrialStatus] = {}
        self._plans: dict[Any, Any] = {}
        self._plans_lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}
        self._fixed_lock = threading.Lock()
        self._fixed_batch: int | None = config.fixed_batch_size
        #: (trial number, device count) options whose plan did not fit: not offered again.
        self._no_grow: set[tuple[int, int]] = set()
        #: running trials being stopped to restart on more devices: the new plan and placement.
        self._resizing: dict[int, _Restart] = {}
        #: trials restarted on more devices, until their new run trains (to fall back on).
        self._restarted: dict[int, _Restart] = {}
        #: wall seconds of a trial's earlier runs (before a restart), added to its record.
        self._earlier_wall: dict[int, float] = {}
        #: queued trials' growth options being planned: (trial number, devices) -> plan future.
        self._grow_plans: dict[tuple[int, int], cf.Future] = {}
        #: restarts decided and being planned for their new device count.
        self._resize_plans: dict[int, tuple[cf.Future, Resize]] = {}
        grow = config.grow_last_wave
        self._grow = (grow if grow is not None
                      else any(d.platform != "cpu" for d in self.devices))
        self._ever_fit = False
        self._nofit: list[int] = []
        #: trials whose plan raised `TrialDeferred`: ``(asked, exception)``, in planning order.
        self.deferred: list[tuple[AskedTrial, TrialDeferred]] = []
        self._t0 = time.monotonic()
        self.usage = UsageRecorder(self.capacity)

    # ----------------------------------------------------------------------------- planning
    def _abstract(self, params: Mapping[str, Any]) -> Any:
        return nnx.eval_shape(lambda: self.space.build(params, nnx.Rngs(0)))

    def _call_planner(
        self, model: Any, n_devices: int, max_batch: int | None, memory: int | None = None
    ) -> Any:
        return self.plan_fn(
            model,
            self.task.sample_batch(1),
            devices=self.devices[:n_devices],
            memory_per_device=memory or self.config.memory_per_device,
            optimizer=make_optimizer({}),
            loss_fn=self.task.loss_fn,
            safety_margin=self.config.safety_margin,
            max_batch_size=max_batch,
        )

    def fixed_batch_size(self) -> int:
        """The fixed policy's batch: the largest the space's largest candidate fits."""
        with self._fixed_lock:
            return self._fixed_batch_size_locked()

    def _fixed_batch_size_locked(self) -> int:
        if self._fixed_batch is None:
            if not self.space.largest:
                raise ValueError(
                    f"search space {self.space.name!r} names no largest candidate; give the "
                    "fixed policy a batch size (fixed_batch_size=)"
                )
            model = self._abstract(self.space.largest)
            plan = self._call_planner(
                model, self.config.devices_per_trial, self.config.max_batch_size
            )
            self._fixed_batch = int(plan.batch_size)
        return self._fixed_batch

    def _smallest_fitting_plan(self, model: Any, max_batch: int | None) -> Any:
        """Plan on the fewest devices (1, 2, 4, ..., the whole pool) that hold ``model`` at a
        batch of at least ``min_batch_size``."""
        total = len(self.devices)
        counts = sorted({2**k for k in range(total.bit_length()) if 2**k <= total} | {total})
        floor = self.config.min_batch_size or 1
        last_error: Exception | None = None
        for n in counts:
            try:
                plan = self._call_planner(model, n, max_batch)
            except planner.DoesNotFitError as err:
                last_error = err
                continue
            if plan.batch_size >= floor:
                return plan
            last_error = planner.DoesNotFitError(
                f"{type(model).__name__} fits at most a global batch of {plan.batch_size} on "
                f"{n} device(s), below min_batch_size={floor}; use more devices, more "
                "memory_per_device, or a lower min_batch_size",
                bytes_needed=int(plan.peak_bytes_per_device * floor / max(plan.batch_size, 1)),
                bytes_available=int(plan.usable_bytes),
            )
        assert last_error is not None
        raise last_error

    def plan(self, params: Mapping[str, Any], *, devices: int | None = None,
             max_batch: int | None = None) -> Any:
        """Plan one configuration: fewest devices that hold it, largest batch (``max_batch`` cap).

        Under the fixed policy the device count is ``devices_per_trial`` and the batch the
        policy's one batch size. Plans are cached per architecture (the graph definition), so
        trials that differ only in optimizer hyperparameters are planned once.
        Raises ``planner.DoesNotFitError`` if the configuration fits on no device count, and
        `TrialDeferred` (cached like a plan) if a subclass hands the architecture elsewhere.
        """
        model = self._abstract(params)
        graphdef = split_model(model)[0]
        cap: int | None
        if self.config.policy == "fixed":
            devices = self.config.devices_per_trial
            cap = self.fixed_batch_size() if max_batch is None else max_batch
        else:
            cap = self.config.max_batch_size if max_batch is None else max_batch
        key = (graphdef, devices, cap)
        # Several planner threads compile at once (XLA compiles outside the GIL); one lock per
        # architecture makes a second trial of it wait for the first plan instead of redoing it.
        with self._plans_lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            if key not in self._plans:
                try:
                    if devices is not None:
                        self._plans[key] = self._call_planner(model, devices, cap)
                    else:
                        self._plans[key] = self._smallest_fitting_plan(model, cap)
                except TrialDeferred as deferred:
                    self._plans[key] = deferred  # a property of the architecture, like a plan
            plan = self._plans[key]
        if isinstance(plan, TrialDeferred):
            raise TrialDeferred(str(plan), plan.payload)
        return plan

    # ---------------------------------------------------------------------------- the loop
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _notify(self) -> None:
        if self.on_update is not None:
            self.on_update(list(self.statuses.values()), self.pool)

    def _ask(self, planner_pool: cf.Executor, planning: dict[cf.Future, AskedTrial]) -> bool:
        """Ask for one configuration and start planning it; False when the study is full."""
        asked = self.source.ask()
        if asked is None:
            return False
        status = self.statuses.setdefault(asked.number, TrialStatus(asked.number, asked.params))
        status.state = "planning"
        planning[planner_pool.submit(self.plan, asked.params)] = asked
        self._notify()
        return True

    def _enqueue(self, asked: AskedTrial, planned: cf.Future, queue: list[PlannedTrial]) -> None:
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
        self._queue_planned(PlannedTrial(asked, plan, self._devices_of(plan), asked.number),
                            queue)

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

    def _devices_of(self, plan: Any) -> int:
        return int(plan.data_parallel * plan.model_parallel)

    def _show_plan(self, number: int, plan: Any) -> None:
        """Record ``plan``'s degrees, batch and predicted peak in trial ``number``'s status."""
        status = self.statuses[number]
        status.model_parallel = int(plan.model_parallel)
        status.batch_size = int(plan.batch_size)
        status.predicted_peak_bytes = int(plan.peak_bytes_per_device)
        status.steps = self.config.steps_for(status.batch_size)

    def _queue_planned(self, planned: PlannedTrial, queue: list[PlannedTrial]) -> None:
        self.statuses[planned.number].state = "queued"
        self._show_plan(planned.number, planned.plan)
        queue.append(planned)
        self._notify()

    def _request(self, planned: PlannedTrial, last_wave: bool = False) -> TrialRequest:
        """The placement request of ``planned``.

        ``seconds`` is a relative work estimate for longest-first ordering (the engine has no
        time model): steps x per-replica batch x the plan's activation bytes per sample. In a
        study's ``last_wave`` (nothing left to ask or plan) a ScaMP trial also offers, as
        uncosted options, 2x, 4x, ... its devices, each reserving the plan's usable bytes (the
        planner's bound on any plan's peak); the engine plans the chosen count only when the
        policy picks it (`_as_placed`). Only with ``reference_batch`` does a larger batch on
        more devices mean fewer steps, so only then are options offered.
        """
        plan = planned.plan
        batch = int(plan.batch_size)
        work = (self.config.steps_for(batch) * batch / max(1, int(plan.data_parallel))
                * float(plan.memory_model.bytes_per_sample))
        options: list[DeviceOption] = []
        policy = self.policy
        if (last_wave and self._grow and isinstance(policy, ScampPolicy) and policy.elastic
                and self.config.reference_batch is not None):
            n = planned.devices * 2
            while n <= len(self.devices):
                if (planned.number, n) not in self._no_grow:
                    options.append(DeviceOption(n, int(plan.usable_bytes), 0.0))
                n *= 2
        return TrialRequest(
            key=planned.number,
            devices=planned.devices,
            bytes_per_device=int(plan.peak_bytes_per_device),
            arrival=planned.arrival,
            seconds=max(0.0, work),
            options=tuple(options),
        )

    def _as_placed(self, planned: PlannedTrial, devices: int,
                   planner_pool: cf.Executor) -> PlannedTrial | None:
        """``planned`` on the ``devices`` its placement gives it: planned again (cached per
        architecture) when ScaMP grew it onto more devices. None while that plan is compiled
        in the planner threads (the trial stays queued; the placement is decided again), or if
        it does not fit (the option is then withdrawn and the trial waits for its own plan's
        devices)."""
        if devices == planned.devices or not isinstance(self.policy, ScampPolicy):
            return planned  # the fixed policy's devices_per_trial may exceed the plan's
        key = (planned.number, devices)
        future = self._grow_plans.get(key)
        if future is None:
            self._grow_plans[key] = planner_pool.submit(self.plan, planned.asked.params,
                                                        devices=devices)
            return None
        if not future.done():
            return None
        del self._grow_plans[key]
        try:
            plan = future.result()
        except (planner.DoesNotFitError, TrialDeferred):
            plan = None
        if plan is None or self._devices_of(plan) != devices:
            self._no_grow.add((planned.number, devices))
            return None
        self._show_plan(planned.number, plan)
        return replace(planned, plan=plan, devices=devices)

    def _attrs(self, status: TrialStatus, wall: float) -> dict[str, Any]:
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
        }

    def _tell(self, outcome: TrialOutcome) -> None:
        self.source.tell(outcome)
        self._outcomes.append(outcome)
        self._notify()

    def _running_view(self, planned: PlannedTrial, started: float) -> RunningTrial | None:
        """``planned`` as `scamp_jax.elastic.resizes` sees it, or None while its pace is
        unknown (still compiling, or fewer than 2 steps trained in this run).

        The engine has no time model: the remaining time is this run's seconds per step times
        the steps left, and on ``p`` data-parallel replicas instead of ``d`` it assumes
        ``d / p`` of that (a linear speed-up), plus the restart (``restart_seconds``, else the
        start-up this run took). Offered device counts keep the global batch divisible.
        """
        status = self.statuses[planned.number]
        done = status.step - status.first_step
        if status.state != "training" or done < 2 or math.isnan(status.training_since):
            return None
        now = time.monotonic()
        remaining = (now - status.training_since) / done * max(0, status.steps - status.step)
        restart = self.config.restart_seconds
        if restart is None:
            restart = max(0.0, status.training_since - (self._t0 + started))
        plan = planned.plan
        dp, mp, batch = int(plan.data_parallel), int(plan.model_parallel), int(plan.batch_size)
        options = tuple(
            DeviceOption(p * mp, int(plan.peak_bytes_per_device), remaining * dp / p + restart)
            for p in range(dp + 1, len(self.devices) // mp + 1)
            if batch % p == 0 and (planned.number, p * mp) not in self._no_grow
        )
        return RunningTrial(planned.number, self.pool.running[planned.number].device_ids,
                            self.pool.request_of(planned.number).bytes_per_device, remaining,
                            options)

    def _resize_tail(
        self,
        running: Mapping[cf.Future, tuple[PlannedTrial, float, threading.Event]],
        planner_pool: cf.Executor,
    ) -> None:
        """Restart running trials on idle devices at the end of the study (`scamp_jax.elastic`).

        A restart decided here is planned for its new device count in the planner threads (a
        few compiles that must not stall this loop); once its plan is ready, a later call books
        the new devices, asks the trial to stop (it checkpoints) and ``run`` starts it again
        on them when it returns. If another restart took those devices meanwhile, it is decided
        afresh (its plan is cached by then).
        """
        if not self._grow or self.checkpoint_root is None:
            return
        entries = {p.number: (p, started, stop) for p, started, stop in running.values()
                   if p.number not in self._resizing and not stop.is_set()}
        for key, (future, decision) in list(self._resize_plans.items()):
            if future.done():
                del self._resize_plans[key]
                if key in entries:  # else it ended while its new plan was compiled
                    self._book_resize(entries[key], decision, future)
        if self._resize_plans:
            return  # decided devices are not booked before their plan is ready: wait for it
        views = [v for p, started, _ in entries.values()
                 if (v := self._running_view(p, started)) is not None]
        if not views:
            return
        for r in resizes(self.policy, self.pool.snapshot(), views, queue_empty=True,
                         arrivals_pending=False):
            planned = entries[r.key][0]
            future = planner_pool.submit(self.plan, planned.asked.params,
                                         devices=r.option.devices,
                                         max_batch=int(planned.plan.batch_size))
            self._resize_plans[r.key] = (future, r)

    def _book_resize(self, entry: tuple[PlannedTrial, float, threading.Event], r: Resize,
                     future: cf.Future) -> None:
        """Book restart ``r`` of a running trial with its compiled plan and stop the trial."""
        planned, started, stop = entry
        n, batch = r.option.devices, int(planned.plan.batch_size)
        try:
            plan = future.result()
        except Exception as err:  # noqa: BLE001 - no plan for that count: the trial runs on
            log.info("trial %d: no plan on %d devices at batch %d (%s)", r.key, n, batch, err)
            plan = None
        if plan is None or self._devices_of(plan) != n or int(plan.batch_size) != batch:
            self._no_grow.add((r.key, n))  # the planner found no such plan: not again
            return
        # The trial trained on while its plan compiled: is the restart still worth it?
        view = self._running_view(planned, started)
        option = next((o for o in view.options if o.devices == n), None) if view else None
        if option is None or option.seconds > (
                (1.0 - self.policy.min_resize_gain) * view.remaining_seconds):
            return
        current = self.pool.running[r.key].device_ids
        snapshot = self.pool.snapshot()
        if tuple(r.device_ids[: len(current)]) != tuple(current) or not all(
                snapshot.is_empty(d) for d in r.device_ids[len(current):]):
            return  # the idle devices went to another restart meanwhile
        grown = replace(planned, plan=plan, devices=n)
        placement = Placement(r.key, r.device_ids)
        old_request = self.pool.request_of(r.key)
        old_placement = self.pool.release(r.key)
        try:
            self.pool.allocate(placement, self._request(grown))
        except ValueError:  # the compiled plan needs more than the prediction left free
            self.pool.allocate(old_placement, old_request)
            self._no_grow.add((r.key, n))
            return
        now = self._now()
        self.usage.move(now, placement, int(plan.peak_bytes_per_device))
        self._resizing[r.key] = _Restart(grown, placement, planned, old_placement, old_request)
        self.statuses[r.key].state = "resizing"
        self._show_plan(r.key, plan)
        log.info("trial %d: restarting on %d devices (was %d), batch %d", r.key, n,
                 planned.devices, batch)
        stop.set()

    def _start(self, placement: Placement, planned: PlannedTrial, executor: cf.Executor,
               stop: threading.Event) -> cf.Future:
        ids = placement.device_ids[: planned.devices]
        plan = planned.plan.with_devices([self.devices[i] for i in ids])
        status = self.statuses[planned.number]
        status.devices = tuple(placement.device_ids)
        status.state = "starting"
        checkpoint_dir = (
            self.checkpoint_root / planned.asked.checkpoint_key if self.checkpoint_root else None
        )
        spec = RunSpec(
            number=planned.number,
            params=planned.asked.params,
            plan=plan,
            steps=self.config.steps_for(int(plan.batch_size)),
            memory_per_device=self.config.memory_per_device,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=self.config.checkpoint_every,
            eval_every=self.config.eval_every,
            log_every=self.config.log_every,
            seed=trial_seed(self.config.seed, planned.asked.checkpoint_key),
        )
        return executor.submit(run_trial, spec, self.space, self.task,
                               report=self.source.report, status=status, stop=stop,
                               cache=self.cache)

    def _replan(self, planned: PlannedTrial, result: RunResult) -> PlannedTrial | None:
        """A smaller batch on the same device count, else the same batch on twice the devices."""
        if planned.replans >= self.config.max_replans:
            return None
        plan = planned.plan
        batch, dp = int(plan.batch_size), int(plan.data_parallel)
        params = planned.asked.params
        model = self._abstract(params)
        half = (batch // 2 // dp) * dp
        floor = self.config.min_batch_size or 1
        try:
            if half >= dp and half >= floor:
                # The planner picks the largest batch up to half the failed one that fits.
                new = self._call_planner(model, planned.devices, half)
            elif planned.devices * 2 <= len(self.devices) and self.config.policy == "scamp":
                new = self._call_planner(model, planned.devices * 2, batch)
            else:
                return None
        except planner.DoesNotFitError:
            return None
        return replace(planned, plan=new, devices=self._devices_of(new),
                       replans=planned.replans + 1)

    def run(self) -> SearchResult:
        """Run trials until the study has its total; returns this run's usage figures.

        Raises `BudgetTooSmallError` if no candidate fits the pool. On ``KeyboardInterrupt``
        running trials are checkpointed and marked interrupted (a re-run resumes them), then the
        interrupt propagates; finished trials are already in the study.
        """
        self._t0 = time.monotonic()
        self.usage = UsageRecorder(self.capacity, t0=0.0)
        self._outcomes: list[TrialOutcome] = []
        lookahead = self.config.lookahead or len(self.devices)
        queue: list[PlannedTrial] = []
        planning: dict[cf.Future, AskedTrial] = {}
        # future -> (trial, start time, its stop event: Ctrl-C, or a restart on more devices)
        running: dict[cf.Future, tuple[PlannedTrial, float, threading.Event]] = {}
        executor = cf.ThreadPoolExecutor(max_workers=max(4, 4 * len(self.devices)),
                                         thread_name_prefix="trial")
        # Planning compiles; planner threads overlap it with training and with each other.
        planner_pool = cf.ThreadPoolExecutor(max_workers=self.config.planner_threads,
                                             thread_name_prefix="planner")
        exhausted = False
        try:
            while True:
                while not exhausted and len(queue) + len(planning) < lookahead:
                    exhausted = not self._ask(planner_pool, planning)
                if not queue and not running and not planning:
                    break
                by_key = {p.number: p for p in queue}
                last_wave = exhausted and not planning
                placements = self.policy.decide(
                    self.pool.snapshot(), [self._request(p, last_wave) for p in queue],
                    arrivals_pending=not last_wave,
                )
                held_back = False  # a placement waits for, or lost, its grown plan
                for placement in placements:
                    queued = by_key[placement.key]
                    grown = self._as_placed(queued, len(placement.device_ids), planner_pool)
                    if grown is None:
                        held_back = True  # its plan for that count is compiling, or was refused
                        continue
                    planned = grown
                    request = self._request(planned)
                    self.pool.allocate(placement, request)
                    self.usage.start(self._now(), placement, request.bytes_per_device)
                    queue.remove(queued)
                    stop = threading.Event()
                    future = self._start(placement, planned, executor, stop)
                    running[future] = (planned, self._now(), stop)
                if last_wave and not queue and running:
                    self._resize_tail(running, planner_pool)
                self._notify()
                # Plans of growth options and restarts: a finished one wakes the loop too.
                replanning = [f for f in (*self._grow_plans.values(),
                                          *(f for f, _ in self._resize_plans.values()))
                              if not f.done()]
                if not running and not planning and not replanning:
                    if queue and not held_back:  # nothing runs, nothing can start: a policy bug
                        raise RuntimeError(
                            f"placement started none of {len(queue)} queued trials on an idle "
                            "pool; check the trials' device counts against the pool"
                        )
                    continue
                done, _ = cf.wait([*running, *planning, *replanning], timeout=0.5,
                                  return_when=cf.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: planning[f].number
                                     if f in planning else -1):
                    if future in planning:
                        self._enqueue(planning.pop(future), future, queue)
                    elif future in running:
                        planned, _, _ = running.pop(future)
                        result = future.result()
                        again = self._next_run(planned, result)
                        if again is None:
                            self._finish(planned, result, queue)
                            continue
                        planned, placement = again
                        stop = threading.Event()
                        future = self._start(placement, planned, executor, stop)
                        running[future] = (planned, self._now(), stop)
                self._notify()
        except BaseException:
            for _, _, stop in running.values():
                stop.set()
            for future, (planned, _, _) in list(running.items()):
                # The runner checkpoints and returns when it sees `stop`; whatever it says, the
                # trial is unfinished and goes back to the study.
                cf.wait([future])
                self.source.interrupt(planned.number)
            for asked in planning.values():
                self.source.interrupt(asked.number)
            for planned in queue:
                self.source.interrupt(planned.number)
            for asked, _ in self.deferred:
                self.source.interrupt(asked.number)
            planner_pool.shutdown(wait=True, cancel_futures=True)
            executor.shutdown(wait=True)
            raise
        planner_pool.shutdown(wait=True)
        executor.shutdown(wait=True)
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
        )

    def _next_run(self, planned: PlannedTrial, result: RunResult
                  ) -> tuple[PlannedTrial, Placement] | None:
        """What runs next for a trial whose run ended with ``result``, if it goes on at once:
        its restart on more devices (it stopped for one), or, if that restarted run failed
        before training a step, its plan and devices from before. None: the run is finished
        (`_finish`)."""
        number = planned.number
        restart = self._resizing.pop(number, None)
        if restart is not None and result.state == "interrupted":
            self.statuses[number].resizes += 1
            self._restarted[number] = replace(restart, since=time.monotonic())
            nxt = restart.grown, restart.placement
        elif ((restart := self._restarted.pop(number, None)) is not None
              and result.state in ("oom", "failed")
              and not self.statuses[number].training_since > restart.since):
            # The restarted run never trained: go back to the plan that did.
            log.info("trial %d: restart on %d devices failed (%s); back on %d", number,
                     planned.devices, result.reason, restart.before.devices)
            self._no_grow.add((number, planned.devices))
            self.pool.release(number)
            self.pool.allocate(restart.old_placement, restart.old_request)
            self.usage.move(self._now(), restart.old_placement,
                            restart.old_request.bytes_per_device)
            self._show_plan(number, restart.before.plan)
            nxt = restart.before, restart.old_placement
        else:
            return None
        self._earlier_wall[number] = self._earlier_wall.get(number, 0.0) + result.wall_seconds
        return nxt

    def _finish(self, planned: PlannedTrial, result: RunResult, queue: list[PlannedTrial]) -> None:
        self.pool.release(planned.number)
        self.usage.finish(self._now(), planned.number)
        status = self.statuses[planned.number]
        if result.state == "oom":
            retry = self._replan(planned, result)
            if retry is not None:
                log.info("trial %d out of memory (%s); re-planned", planned.number, result.reason)
                status.replans = retry.replans
                self._queue_planned(retry, queue)
                return
            result = replace(result, state="failed",
                             reason=f"{result.reason}; no smaller plan fits")
        if result.state == "interrupted":
            self.source.interrupt(planned.number)
            return
        metric = result.metrics.get(self.task.metric)
        wall = result.wall_seconds + self._earlier_wall.pop(planned.number, 0.0)
        attrs = self._attrs(status, wall)
        attrs["metrics"] = dict(result.metrics)
        attrs["checkpoint"] = str(result.checkpoint) if result.checkpoint else None
        attrs["resumed_from"] = result.resumed_from
        status.state = result.state
        status.reason = result.reason
        self._tell(TrialOutcome(planned.number, result.state,
                                value=metric if result.state == "complete" else None,
                                reason=result.reason, attrs=attrs))
