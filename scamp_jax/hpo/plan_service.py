"""The planning service of the search loop: plans, their cache and their costs, off the loop.

`PlanningService` is an object the engine (`scamp_jax.hpo.engine.SearchEngine`) and its grouping
service (`scamp_jax.hpo.fused_engine.FusionService`) hold; its methods run in the engine's
planner threads (XLA compiles outside the GIL), never on the loop's thread:

- `plan`: the fewest devices that hold a configuration and the largest batch (``plan_mesh``,
  one call site: `call_planner`), cached per architecture in memory;
- `step_flops`: FLOPs per device of a plan's training step, from the step's total (the
  plan's own, from its executable, else `total_flops`: ``cost_analysis()`` of the step's
  lowering, no compile, one per architecture and batch), for the scheduling core's costs;
  `planned_with_cost` plans and costs a trial and keeps its figure for `flops_of`
  (`keep_cost`: the same for a plan made elsewhere, an out-of-memory re-plan,
  `scamp_jax.hpo.out_of_memory.plan_again`).

A subclass may override `smallest_fitting_plan` (the MPI engine hands configurations that fit
no local device count to several ranks by raising `TrialDeferred`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax import nnx

from scamp_jax._once import OncePerKey
from scamp_jax.hpo.program_key import ProgramKey
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.hpo.trial import TrialDeferred
from scamp_jax.planning import planner
from scamp_jax.planning.evaluation import supports_chunked_eval
from scamp_jax.planning.memory import with_batch_size
from scamp_jax.planning.train_step import step_flops
from scamp_jax.scheduling.host import cpu_trial_devices

log = logging.getLogger(__name__)


class PlanningService:
    """Plans for the search loop (see the module doc).

    Args:
      space, task: the search space and the task (its sample batch, loss and evaluation).
      config: the `scamp_jax.hpo.settings.EngineConfig` (budget, margin, batch bounds, policy).
      devices: the engine's device pool; a plan on ``n`` devices is made on its first ``n``.
      plan_fn: the planner (``planner.plan_mesh`` signature).
      batch_multiple: the placement policy's batch multiple (ScaMP: so a trial can later grow
        with the same batch).
      may_grow: a queued trial may start on more devices than planned (the last wave's growth):
        what the scheduling core is fed of it (`scamp_jax.hpo.units.SoloUnit.trial_plan`)
        offers the usable bytes per device to grow into.
      max_running: most trials the engine runs at once (None: no cap); on CPU devices
        `smallest_fitting_plan` plans a trial on at least the devices its share of the host's
        cores gives it (`scamp_jax.scheduling.host.cpu_trial_devices`).

    Attributes:
      allowance: ``allowance() -> bytes``: the allowance every plan books now (the engine's
        `scamp_jax.hpo.calibration.Calibration`); None: the planner's own (the plan cache's).
    """

    def __init__(self, space: Any, task: Any, config: Any, devices: Sequence[Any],
                 plan_fn: Callable[..., Any], batch_multiple: int = 1,
                 may_grow: bool = False, max_running: int | None = None) -> None:
        self.space, self.task, self.config = space, task, config
        self.devices, self.plan_fn, self.batch_multiple = list(devices), plan_fn, batch_multiple
        self.may_grow, self.max_running = may_grow, max_running
        self.allowance: Callable[[], int] | None = None
        #: plans (or `TrialDeferred`) by program key
        self._plans: OncePerKey[Any] = OncePerKey()
        self._fixed_lock = threading.Lock()
        self._fixed_batch: int | None = self.config.fixed_batch_size
        #: FLOPs of the lowered step over all its devices by (architecture, injected
        #: hyperparameters, batch) (`total_flops`), and per device by (trial, devices, batch)
        #: for the plans handed to the core.
        self._flops: OncePerKey[float | None] = OncePerKey()
        self._flops_of: dict[tuple[int, int, int], float | None] = {}
        #: a trial's own batch cap (`cap_batch`: a retry's checkpoints' batch), by number
        self._caps: dict[int, int] = {}

    @staticmethod
    def devices_of(plan: Any) -> int:
        """Devices a plan runs on (data-parallel x model-parallel degree)."""
        return int(plan.data_parallel * plan.model_parallel)

    # ----------------------------------------------------------------------------- planning
    def abstract(self, params: Mapping[str, Any]) -> Any:
        """The abstract model of ``params`` (``nnx.eval_shape``: nothing allocated)."""
        return nnx.eval_shape(lambda: self.space.model(params, nnx.Rngs(0)))

    def call_planner(
        self, model: Any, n_devices: int, max_batch: int | None, memory: int | None = None,
        run_ready: bool = True, params: Mapping[str, Any] | None = None,
        provisional: bool = False,
    ) -> Any:
        """``plan_fn`` for ``model`` on the first ``n_devices`` devices at most ``max_batch``;
        ``run_ready=False``: no run-grade step for the runner (``compile_for_run=False``);
        ``provisional``: the cap from shapes where they put it in reach (``plan_mesh``'s
        ``provisional``: no step compiled; for a fused group's member).
        ``params``: the configuration, whose optimizer (`make_optimizer`: which
        hyperparameters are data) the plan's step and shardings are made for."""
        # A task that can evaluate in chunks has its evaluation planned with the step, so the
        # plan's predicted peak covers evaluation too.
        extra: dict[str, Any] = (
            {"eval_task": self.task} if supports_chunked_eval(self.task) else {})
        # The policy's batch multiple (ScaMP: so a trial can later grow with the same batch).
        if self.batch_multiple > 1:
            extra["batch_multiple"] = self.batch_multiple
        if not run_ready:
            extra["compile_for_run"] = False
        if provisional:
            extra["provisional"] = True
        if self.allowance is not None:
            extra["allowance_bytes"] = self.allowance()
        budget = self.config.need_budget()
        return self.plan_fn(
            model,
            self.task.sample_batch(1),
            devices=self.devices[:n_devices],
            memory_per_device=memory or budget.memory_per_device,
            optimizer=make_optimizer(params or {}),
            loss_fn=self.task.loss_fn,
            safety_margin=budget.safety_margin,
            max_batch_size=max_batch,
            **extra,
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
            model = self.abstract(self.space.largest)
            plan = self.call_planner(
                model, self.config.devices_per_trial, self.config.max_batch_size
            )
            self._fixed_batch = int(plan.batch_size)
        return self._fixed_batch

    def smallest_fitting_plan(self, model: Any, max_batch: int | None,
                              run_ready: bool = True,
                              params: Mapping[str, Any] | None = None,
                              provisional: bool = False) -> Any:
        """Plan on the fewest devices (`fewest_devices`, then doubling up to the whole pool) that
        hold ``model`` at a batch of at least ``min_batch_size`` (``params``: as
        `call_planner`)."""
        total = len(self.devices)
        fewest = self.fewest_devices(model, max_batch, params)
        counts = sorted({2**k for k in range(total.bit_length())
                         if fewest <= 2**k <= total} | {total})
        floor = self.config.min_batch_size or 1
        last_error: Exception | None = None
        for n in counts:
            try:
                plan = self.call_planner(model, n, max_batch, run_ready=run_ready,
                                         params=params, provisional=provisional)
            except planner.DoesNotFitError as err:
                last_error = err
                continue
            if plan.batch_size >= floor:
                return plan
            last_error = planner.DoesNotFitError(
                f"{type(model).__name__} fits at most a global batch of {plan.batch_size} on "
                f"{n} device(s), below min_batch_size={floor}; use more devices, more "
                "memory_per_device, or a lower min_batch_size",
                # as the planner's own error counts them: the step and its prefetched batch
                # at the floor, against what the margin and the allowance leave
                bytes_needed=int(plan.memory_model.predict(floor)
                                 + -(-int(plan.prefetch_bytes) * floor // max(1, plan.batch_size))),
                bytes_available=int(plan.usable_bytes) - int(plan.allowance_bytes),
            )
        assert last_error is not None
        raise last_error

    def fewest_devices(self, model: Any, max_batch: int | None,
                       params: Mapping[str, Any] | None = None) -> int:
        """Fewest devices to plan ``model`` on: 1, or on CPU devices its share of the host's
        cores (`cpu_trial_devices`), judged by its step's FLOPs at ``max_batch`` with the
        optimizer of ``params`` (a lowering, no compile; without a cap the batch fills memory
        and the step counts as heavy)."""
        share = cpu_trial_devices(self.devices, self.max_running, max_batch)
        if share == 1 or max_batch is None:
            return share
        flops = self.total_flops(model, params or {}, max_batch)
        return cpu_trial_devices(self.devices, self.max_running, max_batch, flops_per_step=flops)

    def plan(self, params: Mapping[str, Any], *, devices: int | None = None,
             max_batch: int | None = None, run_ready: bool = True,
             provisional: bool = False) -> Any:
        """Plan one configuration: fewest devices that hold it, largest batch (``max_batch`` cap).

        Under the fixed policy the device count is ``devices_per_trial`` and the batch the
        policy's one batch size. Plans are cached per architecture (the graph definition and its
        state's shapes, `ProgramKey.of_model`), so trials that differ only in optimizer
        hyperparameters are planned once.
        Raises ``planner.DoesNotFitError`` if the configuration fits on no device count, and
        `TrialDeferred` (cached like a plan) if a subclass hands the architecture elsewhere.
        ``run_ready=False`` (a trial that will train fused): the planner keeps no run-grade step
        (a solo run of the architecture then compiles its own). ``provisional=True`` (the same):
        the cap without compiling the step where the shapes put it in reach
        (`planner.plan_mesh`'s ``provisional``), cached apart from compiled plans.
        """
        model = self.abstract(params)
        cap: int | None
        if self.config.policy == "fixed":
            devices = self.config.devices_per_trial
            cap = self.fixed_batch_size() if max_batch is None else max_batch
        else:
            cap = self.config.max_batch_size if max_batch is None else max_batch
        allowance = self.allowance() if self.allowance is not None else None
        key = ProgramKey.of_model(model, params).plan(devices, cap, provisional, allowance)
        def make() -> Any:
            try:
                if devices is not None:
                    return self.call_planner(model, devices, cap, run_ready=run_ready,
                                             params=params, provisional=provisional)
                return self.smallest_fitting_plan(model, cap, run_ready, params, provisional)
            except TrialDeferred as deferred:
                return deferred  # a property of the architecture, like a plan

        # Several planner threads compile at once (XLA compiles outside the GIL); one lock per
        # architecture makes a second trial of it wait for the first plan instead of redoing it.
        plan = self._plans.get(key, make)[0]
        if isinstance(plan, TrialDeferred):
            raise TrialDeferred(str(plan), plan.payload)
        return plan

    # ------------------------------------------------------------------------ cost analysis
    def step_flops(self, params: Mapping[str, Any], plan: Any) -> float | None:
        """FLOPs one device runs per training step of ``plan``: the step's total at the plan's
        batch divided over the plan's devices (the planner's own figure, `Plan.step_flops`,
        else `total_flops`); None if XLA gives no figure."""
        total = getattr(plan, "step_flops", None)
        if total is None:
            total = self.total_flops(self.abstract(params), params, int(plan.batch_size))
        return total / self.devices_of(plan) if total else None

    def total_flops(self, model: Any, params: Mapping[str, Any], batch_size: int
                    ) -> float | None:
        """FLOPs of one training step of ``model`` (the configuration ``params``' optimizer) at
        a global batch of ``batch_size``, over all the devices it runs on: XLA's
        ``cost_analysis()`` of the lowered step (traced, not compiled), which counts the
        program before it is partitioned, so one figure serves every mesh. Cached per
        architecture, batch and injected hyperparameters: the CPU split (`fewest_devices`) of
        trials of one architecture lowers it once, and a plan without figures of its own
        (`step_flops`) at the same batch takes it."""
        key = ProgramKey.of_model(model, params).flops(batch_size)

        def make() -> float | None:
            try:
                return step_flops(model, make_optimizer(params), self.task.loss_fn,
                                  with_batch_size(self.task.sample_batch(1), int(batch_size)))
            except Exception as err:  # noqa: BLE001 - a cost is only an aid
                log.info("no cost analysis for %s: %s", type(model).__name__, err)
                return None

        # Trials of one architecture planned at once (a fused family) lower it once.
        return self._flops.get(key, make)[0]

    def cap_batch(self, number: int, batch: int | None) -> None:
        """Plan trial ``number`` at a global batch of at most ``batch`` from now on, in every
        plan `planned_with_cost` makes of it (alone, for a fused group, on more devices; None:
        the study's cap). A retry's cap: the batch its checkpoints were trained at
        (`scamp_jax.hpo.units.resume_cap`)."""
        if batch is None:
            self._caps.pop(number, None)
        else:
            self._caps[number] = int(batch)

    def planned_with_cost(self, params: Mapping[str, Any], number: int, **kw: Any) -> Any:
        """Plan (cached per architecture) and cost one configuration, at most at its own cap
        (`cap_batch`); runs in a planner thread."""
        cap = self._caps.get(number)
        if cap is not None:
            kw["max_batch"] = cap if kw.get("max_batch") is None else min(cap, kw["max_batch"])
        plan = self.plan(params, **kw)
        self.keep_cost(number, params, plan)
        return plan

    def keep_cost(self, number: int, params: Mapping[str, Any], plan: Any) -> None:
        """Cost trial ``number``'s ``plan`` (configuration ``params``) for `flops_of`."""
        flops = self.step_flops(params, plan)
        self._flops_of[(number, self.devices_of(plan), int(plan.batch_size))] = flops

    def flops_of(self, number: int, plan: Any) -> float | None:
        """FLOPs per device per step of trial ``number`` on ``plan`` (None: not costed)."""
        return self._flops_of.get((number, self.devices_of(plan), int(plan.batch_size)))
