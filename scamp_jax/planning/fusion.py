"""Horizontal fusion: ``K`` trials of one architecture trained by one compiled program.

Trials that share a device by running side by side take turns on its compute; small candidates
leave most of it idle. Fusing ``K`` trials of the same architecture into one step (as HFTA,
MLSys 2021, does for PyTorch) turns ``K`` small programs into one ``K`` times wider program.

The fused step is ``jax.vmap`` of the project's own training step
(`scamp_jax.planning.train_step.make_train_step`) over a leading *member* axis:

- parameters, optimizer state and other model state (RNG counters) are stacked, shape
  ``(K, ...)`` per leaf;
- per-member hyperparameters (``learning_rate``, ``weight_decay``, ``b1``, ``b2``) live in the
  stacked optimizer state (``optax.inject_hyperparams``), so they are vmapped data, not constants;
- every member draws its own seeded data stream; the batch is ``(K, B, ...)`` per leaf, ``B``
  (samples per member) shared by the group;
- an ``active`` mask of shape ``(K,)`` keeps a stopped member's state unchanged (a pruned or
  failed member stops learning while the others go on).

Because every member's computation is the solo step's, a member trained in a group follows its
solo run: same initial parameters (same seed), same batches, same updates, up to the rounding of
vmapped kernels (the test measures it). Convolutions are the one operation run differently from
``jax.vmap``'s own rule: on CPU one per member, each the solo run's, elsewhere one grouped
convolution (`scamp_jax.planning.member_ops` says why).

Planning (`plan_fusion`) sizes a group as the planner sizes a trial: from compiling the fused
step on abstract arguments and reading XLA's memory analysis: the widest ``K`` (up to a cap) that
fits the device budget, then the largest per-member batch at that width. With a
`scamp_jax.planning.plan_cache.PlanCache` (``cache=``) a fused plan is stored next to the member
plans: planned again (a resumed study, another process, a narrower group of the same
architecture) it compiles nothing, and every compiled ``(width, batch)`` point seeds later fused
searches of the same program on the same mesh and shardings.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from scamp_jax._units import counted, format_bytes
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.compile_options import (
    Purpose,
    answer_is_runnable,
    device_options,
    platform_of,
)
from scamp_jax.planning.member_ops import convolution_form, member_program
from scamp_jax.planning.memory import MemoryEstimate
from scamp_jax.planning.plan_cache import PlanCache, cache_key, device_identity, program_signature
from scamp_jax.planning.planner import (
    CompiledStep,
    DoesNotFitError,
    Plan,
    _estimate_record,
    plan_mesh,
    resolve_devices,
)
from scamp_jax.planning.reuse import compile_lowered, lowered_fingerprint
from scamp_jax.planning.train_step import (
    LossFn,
    StepShardings,
    StepSource,
    abstract_state,
    default_loss,
    default_optimizer,
    make_train_step,
    placed,
    split_model,
    stack_shardings,
)
from scamp_jax.scheduling.booking import group_bytes

PyTree = Any
#: ``fused(params, opt_state, rest, batch, active) -> (params, opt_state, rest, losses)``.
FusedStep = Callable[
    [PyTree, PyTree, PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, PyTree, jax.Array]
]
#: Name of the leading member axis in docs and errors (it is not a mesh axis).
MEMBER_AXIS_DOC = "member"


# --------------------------------------------------------------------------- the fused step


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or ``ShapeDtypeStruct``) holds typed PRNG keys."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keep(active: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """``new`` where the member is active, else ``old`` (leading axis = members)."""
    if is_key(new):
        data = _keep(active, jax.random.key_data(new), jax.random.key_data(old))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(new))
    mask = active.reshape((active.shape[0],) + (1,) * (new.ndim - 1))
    return jnp.where(mask, new, old)


#: Part of every cached fused point's key: bumped when the fused step's program changes, so a
#: plan cache never answers with the memory of an older fused step.
FUSED_STEP_VERSION = 2


def make_fused_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn = default_loss,
) -> FusedStep:
    """The pure fused step: `make_train_step`'s step vmapped over the leading member axis, its
    convolutions run by `scamp_jax.planning.member_ops.member_program` (on CPU one per member,
    the solo step's own; elsewhere one grouped convolution). Every other operation is
    ``jax.vmap``'s, so a member's losses match its solo run's to float rounding
    (``python -m benchmarks.fusion_precision --ops`` measures it op by op).

    ``fused(params, opt_state, rest, batch, active)`` takes every state leaf stacked ``(K, ...)``,
    every batch leaf ``(K, B, ...)`` and ``active`` a ``(K,)`` bool array, and returns the updated
    ``(params, opt_state, rest)`` (inactive members unchanged) and the ``(K,)`` float32 losses
    before the update (an inactive member's loss is computed but means nothing).
    """
    vstep = jax.vmap(member_program(make_train_step(graphdef, optimizer, loss_fn)))

    def fused(params: PyTree, opt_state: PyTree, rest: PyTree, batch: PyTree,
              active: jax.Array):
        new_params, new_opt, new_rest, losses = vstep(params, opt_state, rest, batch)
        keep = lambda new, old: _keep(active, new, old)  # noqa: E731
        return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state),
                jax.tree.map(keep, new_rest, rest), losses)

    return fused


def jit_fused_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    shardings: StepShardings,
) -> jax.stages.Wrapped:
    """`make_fused_step` jitted with a member's ``shardings`` (stacked by `stack_shardings`).

    ``params`` and ``opt_state`` are donated; ``active`` and the losses are replicated.
    """
    stacked = stack_shardings(shardings)
    replicated = shardings.replicated()
    return jax.jit(
        make_fused_step(graphdef, optimizer, loss_fn),
        in_shardings=(stacked.params, stacked.opt_state, stacked.rest, stacked.batch, replicated),
        out_shardings=(stacked.params, stacked.opt_state, stacked.rest, replicated),
        donate_argnums=(0, 1),
    )


def stack_abstract(tree: PyTree, width: int) -> PyTree:
    """``ShapeDtypeStruct`` tree of ``tree`` with a leading member axis of ``width``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((width, *x.shape), x.dtype), tree)


def stack_batches(batches: Sequence[PyTree]) -> PyTree:
    """One ``(K, B, ...)`` numpy batch from the members' ``(B, ...)`` batches, in member order."""
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def hyperparam_arrays(
    optimizer_keys: Sequence[str], configs: Sequence[Mapping[str, Any]]
) -> dict[str, np.ndarray]:
    """Per-member optimizer hyperparameters as ``(K,)`` float32 arrays, by name.

    A key is taken if any configuration sets it; then every configuration must set it (the
    group's members share one optimizer structure, and a default would differ from their
    solo runs only silently).
    """
    out: dict[str, np.ndarray] = {}
    for name in optimizer_keys:
        have = [name in c for c in configs]
        if not any(have):
            continue
        if not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            raise ValueError(
                f"hyperparameter {name!r} is set by some group members but not by members "
                f"{missing}; give every member a value (or none) so they share one optimizer"
            )
        out[name] = np.asarray([float(c[name]) for c in configs], np.float32)
    return out


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class FusionPlan:
    """How to train a group of ``width`` members of one architecture on a plan's devices.

    Attributes:
      plan: a member's `Plan` (mesh, degrees, shardings); its ``batch_size`` is the solo plan's.
      width: members in the group, ``K``.
      batch_size: samples per member per step (``B``, a multiple of ``plan.data_parallel``).
      peak_bytes_per_device: compiled peak of the fused step at ``(width, batch_size)``, bytes.
      estimate: the memory breakdown of that compile (per-device bytes of all members).
      compiled_peaks: ``(width, batch, peak bytes)`` of every compiled point the search used, in
        search order (compiled now or found in a plan cache).
      planning_seconds, compiles: what fused planning cost (seconds; fused compiles, on top of
        the member plan's own; points from a plan cache are not compiles).
      predicted_peak_bytes: the most the group holds on a device at any time, bytes: training
        (compiled fused step + every member's prefetched batch) or evaluating one member (the
        member plan's evaluation peak + the stacked state + the prefetched batches), whichever
        is larger; what a scheduler books for the group (None: the step's peak).
      cached: True when every point came from a `PlanCache`: nothing was compiled.
      compiled_step: the fused step at ``(width, batch_size)`` compiled with default XLA options
        on the plan's devices (`scamp_jax.planning.planner.CompiledStep`), for the group's run
        to take as is, or on other CPU devices to load onto its own
        (`scamp_jax.planning.reuse.ExecutableCache`); None: not kept (``compile_for_run=False``).
      step_source: the jitted fused step the planner lowered (a
        `scamp_jax.planning.train_step.StepSource` of `jit_fused_step`), for a run that would
        make the same step to take instead of tracing its own.
    """

    plan: Plan
    width: int
    batch_size: int
    peak_bytes_per_device: int
    estimate: MemoryEstimate
    compiled_peaks: tuple[tuple[int, int, int], ...] = ()
    planning_seconds: float = field(default=0.0, compare=False)
    compiles: int = field(default=0, compare=False)
    predicted_peak_bytes: int | None = None
    cached: bool = field(default=False, compare=False)
    compiled_step: CompiledStep | None = field(default=None, compare=False, repr=False)
    step_source: StepSource | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.predicted_peak_bytes is None:
            object.__setattr__(self, "predicted_peak_bytes", self.peak_bytes_per_device)

    @property
    def step_shardings(self) -> StepShardings:
        """A member's shardings (stack them with `stack_shardings` for the fused arrays)."""
        return self.plan.step_shardings

    @property
    def usable_bytes(self) -> int:
        """Bytes per device the group may use (the member plan's budget less its margin)."""
        return self.plan.usable_bytes

    def with_devices(self, devices: Sequence[jax.Device]) -> FusionPlan:
        """The same group decision on other devices of the same count (`Plan.with_devices`);
        the compiled step stays, for the devices it was compiled for."""
        return replace(self, plan=self.plan.with_devices(devices))

    def describe(self) -> str:
        """A short human-readable summary."""
        return (f"fused group of {self.width} x batch {self.batch_size} on "
                f"{len(self.plan.devices)} device(s) (data {self.plan.data_parallel} x model "
                f"{self.plan.model_parallel}): peak {format_bytes(self.peak_bytes_per_device)} of "
                f"{format_bytes(self.usable_bytes)} usable per device; "
                f"{counted(self.compiles, 'compile')}, {self.planning_seconds:.2f} s")


class FusedStepCompiler:
    """Compiles the fused step on abstract arguments for a member plan; allocates nothing.

    With a `PlanCache` (``cache``) every compiled ``(width, batch)`` point is stored under the
    program's signature, the devices, the mesh shape and the shardings (`FUSED_STEP_VERSION` and
    the JAX versions included), and a point found there is not compiled again.
    """

    def __init__(
        self,
        model: nnx.Module,
        sample_batch: PyTree,
        plan: Plan,
        optimizer: optax.GradientTransformation | None = None,
        loss_fn: LossFn | None = None,
        cache: PlanCache | None = None,
    ) -> None:
        self.plan = plan
        self.sample_batch = sample_batch
        self.optimizer = optimizer if optimizer is not None else default_optimizer()
        self.graphdef = split_model(model)[0]
        self.params, self.opt_state, self.rest = abstract_state(model, self.optimizer)
        self.shardings = plan.step_shardings
        self.loss_fn = loss_fn if loss_fn is not None else default_loss
        self._step = jit_fused_step(self.graphdef, self.optimizer, self.loss_fn, self.shardings)
        self.compiler_options = device_options(plan.devices, Purpose.GUIDE)
        self.run_options = device_options(plan.devices, Purpose.RUN)  # run-grade compiles
        self.seen: dict[tuple[int, int], MemoryEstimate] = {}
        self.asked: dict[tuple[int, int], int] = {}  # the points this search used: their peaks
        self.compiled = 0  # fused steps compiled by this object (points from the cache excluded)
        #: run-grade (default XLA options) executables and their lowerings, by (width, batch)
        self.run_grade: dict[tuple[int, int], tuple[Any, jax.stages.Lowered]] = {}
        self.from_cache: set[tuple[int, int]] = set()  # points read from the plan cache
        self.cache = cache
        self._cache_parts: dict[str, Any] | None = None
        self._loaded: set[int] = set()  # widths whose cached points are in ``seen``
        if cache is not None:
            specs = jax.tree.map(lambda s: str(getattr(s, "spec", s)), self.shardings,
                                 is_leaf=lambda x: isinstance(x, NamedSharding))
            self._cache_parts = {
                "kind": "fused_peaks", "fused_step": FUSED_STEP_VERSION,
                "convolutions": convolution_form(),
                "signature": program_signature(model, sample_batch, self.optimizer, loss_fn),
                "devices": device_identity(plan.devices),
                "mesh": [plan.data_parallel, plan.model_parallel],
                "shardings": hashlib.sha256(str(specs).encode()).hexdigest(),
            }

    def _width_key(self, width: int) -> str:
        assert self._cache_parts is not None
        return cache_key({**self._cache_parts, "width": width})

    def _load(self, width: int) -> None:
        """Put the cache's compiled points of ``width`` members into ``seen`` (once)."""
        if self.cache is None or width in self._loaded:
            return
        self._loaded.add(width)
        for batch, (estimate, _) in self.cache.get_estimates(self._width_key(width)).items():
            if (width, batch) not in self.seen:
                self.seen[(width, batch)] = estimate
                self.from_cache.add((width, batch))

    @property
    def data_parallel(self) -> int:
        """The member plan's data-parallel degree (per-member batches are multiples of it)."""
        return self.plan.data_parallel

    def estimate(self, width: int, batch_size: int, run_grade: bool = False) -> MemoryEstimate:
        """Per-device memory of the fused step for ``width`` members of ``batch_size`` samples.

        ``MemoryEstimate.batch_size`` is the per-member batch; byte fields hold all members.
        ``run_grade``: compile with default XLA options (what a run compiles) and keep the
        executable in ``run_grade``; a point compiled here at planning grade is compiled again
        for that, a point from the plan cache is not (a cached plan compiles nothing).
        """
        self._load(width)
        point = (width, batch_size)
        if point in self.seen and (not run_grade or point in self.run_grade
                                   or point in self.from_cache):
            estimate = self.seen[(width, batch_size)]
            self.asked[(width, batch_size)] = estimate.peak
            return estimate
        dp = self.data_parallel
        if width < 1 or batch_size < 1 or batch_size % dp:
            raise ValueError(
                f"{width=} must be >= 1 and {batch_size=} a positive multiple of the "
                f"data-parallel degree {dp}; use {max(1, -(-batch_size // dp)) * dp}"
            )
        stacked = stack_shardings(self.shardings)
        # Abstract arguments placed as the run's arrays are: the run's lowering of the same
        # step is then JAX's cache hit (`StepSource`).
        params = placed(stack_abstract(self.params, width), stacked.params)
        opt_state = placed(stack_abstract(self.opt_state, width), stacked.opt_state)
        rest = placed(stack_abstract(self.rest, width), stacked.rest)
        batch = placed(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((width, batch_size, *x.shape[1:]), x.dtype),
            self.sample_batch,
        ), stacked.batch)
        active = jax.ShapeDtypeStruct((width,), jnp.bool_, sharding=self.shardings.replicated())
        start = time.perf_counter()
        lowered = self._step.lower(params, opt_state, rest, batch, active)
        options = self.run_options if run_grade else self.compiler_options
        compiled = compile_lowered(lowered, options)
        seconds = time.perf_counter() - start
        if run_grade:
            self.run_grade[(width, batch_size)] = (compiled, lowered)
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError(
                f"XLA on {self.plan.devices[0].platform} gives no memory analysis, so a fused "
                "group cannot be sized there; plan on a backend that does (CPU, GPU, TPU)"
            )
        temp, argument = int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes)
        output, alias = int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes)
        peak = temp + argument + output - alias
        p_bytes = sh.bytes_per_device(params, stacked.params)
        o_bytes = sh.bytes_per_device(opt_state, stacked.opt_state)
        r_bytes = sh.bytes_per_device(rest, stacked.rest)
        inputs = sh.bytes_per_device(batch, stacked.batch)
        estimate = MemoryEstimate(
            batch_size=batch_size, params=p_bytes, grads=p_bytes, opt_state=o_bytes,
            rest=r_bytes, inputs=inputs,
            activations_and_temps=peak - p_bytes - o_bytes - r_bytes - inputs, peak=peak,
            temp=temp, argument=argument, output=output, alias=alias, compile_seconds=seconds,
        )
        self.seen[(width, batch_size)] = estimate
        self.asked[(width, batch_size)] = estimate.peak
        self.compiled += 1
        if self.cache is not None:
            self.cache.put_peaks(self._width_key(width), {batch_size: _estimate_record(estimate)})
        return estimate


def _largest_fitting(peak: Callable[[int], int], lo: int, cap: int, unit: int,
                     usable: int) -> int:
    """Largest multiple of ``unit`` in ``[lo, cap]`` whose ``peak`` fits ``usable``.

    ``lo`` must fit. Memory is close to affine in the width and in the batch, so the cap is tried
    first, then false-position guesses through the bracket's ends, alternating with bisection
    so that a kink in the curve cannot stall the search.
    """
    if peak(cap) <= usable:
        return cap
    hi = cap
    secant = True
    while hi - lo > unit:
        p_lo, p_hi = peak(lo), peak(hi)
        guess = lo + ((hi - lo) // unit // 2) * unit
        if secant and p_hi > p_lo:
            line = lo + int((usable - p_lo) * (hi - lo) / (p_hi - p_lo))
            guess = min(max((line // unit) * unit, lo + unit), hi - unit)
        secant = not secant
        lo, hi = (guess, hi) if peak(guess) <= usable else (lo, guess)
    return lo


def _widest_group(peak: Callable[..., int], cap: int, usable: int, solo: int | None,
                  floor: int = 1) -> int:
    """The widest group whose ``peak`` (bytes at ``k`` members) fits ``usable``, given that
    ``cap`` members do not (compiled); 0 when not even ``floor`` members fit (narrower groups
    are not compiled: the caller has no use for them).

    A group's memory is close to affine in its width, so the first width tried is where the
    line through one member and the cap crosses the budget, one member taken from ``solo``
    (what the member plan holds alone, compiled for solo training: a guide, never a decision)
    or, without it, as the cap's share. While a width does not fit, the next comes from the line
    through it and the cap; once one fits, `_largest_fitting` brackets the answer. Every
    decision is a compiled point: a guess that lands costs two compiles (the width, and one
    more member to show it is the widest), where starting from one member cost three or more.
    The first guess is compiled as the answer (``peak(k, True)``: as a run compiles it, where
    the caller keeps the answer's executable), since it usually is, unless it is one member (a
    group of one is no group: a study trains that member alone).
    """
    top = peak(cap)
    # one member: the solo figure, unless it says nothing (a cap figure no larger than it)
    one = solo if solo is not None and 0 < solo < top else top / cap
    if cap <= floor:
        return 0
    slope = (top - one) / (cap - 1)
    width = cap - 1 if slope <= 0 else int(1 + (usable - one) // slope)
    width = min(max(width, floor), cap - 1)
    hi = cap
    peak(width, width > 1)
    while peak(width) > usable:
        if width == floor:
            return 0
        hi = width
        over, at_hi = peak(width), peak(cap)
        step = (at_hi - over) / (cap - width) if cap > width else 0.0
        below = width - (math.ceil((over - usable) / step) if step > 0 else width // 2)
        width = min(max(below, floor), width - 1)
    return _largest_fitting(peak, width, hi, 1, usable)


def plan_fusion(
    model: nnx.Module,
    sample_batch: PyTree,
    *,
    max_width: int,
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | float | str | None = None,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: LossFn | None = None,
    safety_margin: float | None = None,
    batch_size: int | None = None,
    max_batch_size: int | None = None,
    plan: Plan | None = None,
    cache: PlanCache | None = None,
    compile_for_run: bool = False,
    min_width: int = 1,
) -> FusionPlan:
    """Size a fused group of ``model``: the widest group up to ``max_width``, then its batch.

    Args:
      model: a Flax NNX module, real or abstract (``nnx.eval_shape``).
      sample_batch: one member's batch shapes ``(B, ...)`` (only per-sample shapes are used).
      max_width: the most members wanted in the group (``K`` cap), >= 1.
      devices, memory_per_device, optimizer, loss_fn, safety_margin: as for
        `scamp_jax.planning.planner.plan_mesh`, which makes the member plan (mesh, model-parallel
        degree, shardings) unless ``plan`` is given.
      batch_size: fix the per-member batch (e.g. the study's batch, so members match their solo
        runs); None: the largest batch that fits at the chosen width, up to the member plan's.
      max_batch_size: cap of the member plan's batch (``plan_mesh``'s).
      plan: a member plan to reuse (skips ``plan_mesh``).
      cache: a `PlanCache` (e.g. the study's ``plans.sqlite``): the member plan is looked up
        there too, and every compiled fused point is stored and reused, so the same group
        planned again (a resumed study, another process) compiles nothing.
      compile_for_run: keep the answer's fused step compiled with default XLA options as
        ``compiled_step`` for the group's run (which then compiles no step on the planned
        devices). With a fixed ``batch_size`` the points likely to be the answer (``max_width``,
        and where that does not fit the width its line predicts, if more than one) are
        compiled so at once, so a group that fits at the cap costs one compile, not a planning
        compile and then the run's; otherwise the answer is compiled once more. An answer from
        the plan cache is not compiled (the run compiles it).
        On CPU a run-grade compile is slower than the planning ones (LLVM level 0), so leave
        it off when the plan only informs (a simulator, a cost model). On GPUs (and GPU
        targets) it keeps nothing: every planning compile there is made with the autotuner off
        (`scamp_jax.planning.compile_options`), and the run compiles its step, autotuned.
      min_width: the narrowest group wanted (a study's is 2: one member trains alone); when
        not even that many fit, `DoesNotFitError` without compiling narrower groups.

    Returns:
      A `FusionPlan`: the widest ``K <= max_width`` whose compiled fused step fits at
      ``batch_size`` (or at one sample per data-parallel group when not fixed), then the largest
      per-member batch at that ``K``.

    Raises:
      DoesNotFitError: not even ``min_width`` members (one by default) fit at that batch.
      ValueError: bad arguments.
    """
    start = time.perf_counter()
    if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
        raise ValueError(f"{max_width=} must be a positive int (the most members in a group)")
    if not 1 <= min_width <= max_width:
        raise ValueError(f"{min_width=} must be between 1 and {max_width=} (the fewest and the "
                         "most members wanted in a group)")
    if plan is None:
        devs = resolve_devices(devices)
        cap = batch_size if batch_size is not None else max_batch_size
        plan = plan_mesh(model, sample_batch, devices=devs, memory_per_device=memory_per_device,
                         optimizer=optimizer, loss_fn=loss_fn, safety_margin=safety_margin,
                         max_batch_size=cap, cache=cache)
    dp = plan.data_parallel
    if batch_size is not None and (batch_size < 1 or batch_size % dp):
        raise ValueError(f"{batch_size=} must be a positive multiple of the data-parallel degree "
                         f"{dp}; use {max(1, -(-batch_size // dp)) * dp}")
    if batch_size is not None and batch_size > plan.batch_size:
        # the member plan's fit at that batch, with its prefetched batch and allowance
        need = (plan.memory_model.predict(batch_size)
                + -(-int(plan.prefetch_bytes) * batch_size // max(1, plan.batch_size))
                + int(plan.allowance_bytes))
        if need <= plan.usable_bytes:  # the plan stopped below what memory allows
            raise ValueError(
                f"{batch_size=} is above the member plan's batch {plan.batch_size}, which "
                "stopped below what memory allows (at its max_batch_size or batch_multiple, "
                "or where its evaluation's prefetched batch fits); pass no plan to plan the "
                f"member at {batch_size}, or lower the batch to {plan.batch_size}")
        raise DoesNotFitError(
            f"a single member needs more than the budget at {batch_size=}: about {need} bytes "
            f"({format_bytes(need)}) per device, of which {plan.usable_bytes} are usable; the "
            f"member plan fits at most {plan.batch_size} samples; lower the batch to "
            f"{plan.batch_size} or use more devices",
            bytes_needed=need, bytes_available=plan.usable_bytes)
    usable = plan.usable_bytes
    compiler = FusedStepCompiler(model, sample_batch, plan, optimizer, loss_fn, cache=cache)

    def held(width: int, batch: int, run_grade: bool = False) -> int:
        return group_held_bytes(compiler.estimate(width, batch, run_grade), plan, width, batch)

    first_batch = batch_size if batch_size is not None else dp
    # With a fixed batch, a point the search takes for the answer is compiled as the run
    # compiles it, when the answer's executable is kept for the run: where planning and the
    # run compile alike (CPU). On GPUs every planning compile keeps the autotuner off, and the
    # group's run compiles its own step, autotuned once, as a solo plan's run does.
    keep_step = compile_for_run and answer_is_runnable(platform_of(plan.devices))
    run_grade = keep_step and batch_size is not None
    # The cap usually fits (small candidates): then one compile decides the width.
    if held(max_width, first_batch, run_grade) <= usable:
        width = max_width
    else:
        solo = None  # one member as the member plan holds it, where it planned this batch
        if plan.batch_size == first_batch and not getattr(plan, "provisional", False):
            solo = group_held_bytes(plan.estimate, plan, 1, first_batch)
        width = _widest_group(lambda k, answer=False: held(k, first_batch, answer and run_grade),
                              max_width, usable, solo, min_width)
        if width == 0:
            need = held(min_width, first_batch)
            who = ("one fused member needs" if min_width == 1 else
                   f"a fused group of {min_width} members needs")
            raise DoesNotFitError(
                f"{who} {need} bytes ({format_bytes(need)}) per device at batch {first_batch} "
                f"but {usable} ({format_bytes(usable)}) are usable; use more devices or more "
                "memory_per_device",
                bytes_needed=need, bytes_available=usable)
    batch = first_batch
    if batch_size is None:
        batch = _largest_fitting(lambda b: held(width, b), dp, plan.batch_size, dp, usable)
    estimate = compiler.estimate(width, batch, keep_step)
    compiled_step = None
    if (width, batch) in compiler.run_grade:
        executable, lowered = compiler.run_grade[(width, batch)]
        compiled_step = CompiledStep(executable, lowered_fingerprint(lowered),
                                     tuple(d.id for d in plan.mesh.devices.flat))
    return FusionPlan(
        plan=plan, width=width, batch_size=batch, peak_bytes_per_device=estimate.peak,
        estimate=estimate,
        compiled_peaks=tuple((k, b, peak) for (k, b), peak in compiler.asked.items()),
        planning_seconds=time.perf_counter() - start, compiles=compiler.compiled,
        predicted_peak_bytes=held(width, batch),
        cached=cache is not None and compiler.compiled == 0,
        compiled_step=compiled_step,
        step_source=StepSource(compiler._step, compiler.graphdef, compiler.optimizer,
                               compiler.loss_fn, compiler.shardings),
    )


def group_held_bytes(estimate: MemoryEstimate, plan: Plan, width: int, batch: int) -> int:
    """Bytes per device a group of ``width`` members at per-member ``batch`` holds at most.

    Training: the fused step's compiled peak (``estimate``) plus every member's prefetched
    next batch. Evaluating one member: the member plan's evaluation peak plus the whole
    stacked state (params, optimizer state, rest of all members; one member's parameters are
    counted twice, which errs large) plus the prefetched batches. The larger of the two, plus the
    plan's ``allowance_bytes``. A plan without prefetch, evaluation or allowance figures
    (``prefetch_bytes``, ``eval_peak_bytes``, ``allowance_bytes``) counts them as 0.
    """
    return group_bytes(estimate.peak, estimate.params + estimate.opt_state + estimate.rest,
                       member_prefetch=int(getattr(plan, "prefetch_bytes", 0)), width=width,
                       batch=batch, member_batch=int(getattr(plan, "batch_size", batch)),
                       eval_peak=int(getattr(plan, "eval_peak_bytes", 0)),
                       allowance=int(getattr(plan, "allowance_bytes", 0)))
