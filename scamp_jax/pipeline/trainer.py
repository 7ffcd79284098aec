"""Train a supernet over a sequence of subnets with a chosen pipeline schedule.

`train_supernet` is the library entry point: it builds the schedule (``csp``, ``gpipe`` or
``sequential``), turns it into a tick program, runs it on a `PipelineExecutor` (or any other
`StageExecutor`, such as the MPI one) and reports the losses, a hash of the final weights, ticks,
stage utilisation and resident bytes.
The independent check of what it computes is `search_spaces.supernet_reference.train_reference`
(a plain single-device loop on the SR supernet's Flax modules with ``optax.adam``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import jax
import numpy as np

from scamp_jax.pipeline.csp import check_causality, csp_schedule, ideal_schedule, split_layers
from scamp_jax.pipeline.executor import PipelineExecutor
from scamp_jax.pipeline.executor_base import StageExecutor
from scamp_jax.pipeline.model import StageModel, check_stage_model, state_bytes
from scamp_jax.pipeline.program import TickProgram, build_program
from scamp_jax.pipeline.schedules import (
    Schedule,
    gpipe_schedule,
    sequential_schedule,
    validate_schedule,
)
from scamp_jax.pipeline.stage import OptimizerSpec

SCHEDULES = ("csp", "gpipe", "sequential")

#: Builds an executor from `PipelineExecutor`'s constructor arguments (``layout`` and the
#: keywords ``num_stages`` ... ``optimizer``), e.g. an executor class.
ExecutorFactory = Callable[..., StageExecutor]


class TrainOptions(TypedDict, total=False):
    """`train_supernet`'s keyword arguments but ``executor`` (same meanings and defaults), for
    wrappers that choose the executor themselves."""

    schedule: str
    num_stages: int
    seed: int
    offload: bool
    train_shared: bool
    num_microbatches: int
    optimizer: OptimizerSpec | None
    max_inflight: int | None
    prefetch_ahead: int
    initial_weights: tuple[np.ndarray, np.ndarray] | None
    initial_state: SupernetState | None
    on_tick: Callable[[int, int], None] | None


def check_subnets(subnets: Sequence[Sequence[int]], num_layers: int, num_choices: int) -> None:
    """Raise `ValueError` unless every subnet picks one candidate ``0 <= c < num_choices`` for
    each of ``num_layers`` layers. (The stage step reads a candidate with an index it clamps
    and writes it back where the index wraps, so a choice out of range would train another
    candidate and lose its update, and the schedule would order it as a block of its own.)"""
    for i, subnet in enumerate(subnets):
        choices = list(subnet)
        if len(choices) != num_layers:
            raise ValueError(f"subnet {i} has {len(choices)} choices for {num_layers} layers; "
                             "give one candidate index per layer")
        bad = [c for c in choices
               if not isinstance(c, (int, np.integer)) or isinstance(c, bool)
               or not 0 <= int(c) < num_choices]
        if bad:
            raise ValueError(f"subnet {i} {tuple(choices)} picks {bad[0]!r}; a layer's choice is "
                             f"a candidate index from 0 to {num_choices - 1}")


def check_batches(layout: StageModel, lr_batches: np.ndarray, hr_batches: np.ndarray) -> None:
    """Raise `ValueError` unless ``hr_batches`` holds one batch of targets per LR batch, of the
    same number of samples (at least one), each of the shape the supernet turns an LR image
    into, and the supernet takes the LR images (their channels). Shapes only: the stem and head
    are traced abstractly (`jax.eval_shape`), nothing is compiled."""
    if lr_batches.ndim != 5 or hr_batches.ndim != 5:
        raise ValueError(
            f"lr_batches of shape {lr_batches.shape} and hr_batches of shape {hr_batches.shape}; "
            "pass (N, B, height, width, channels) arrays of images, one batch per subnet")
    n, batch, side = lr_batches.shape[0], lr_batches.shape[1], lr_batches.shape[2]
    if len(hr_batches) != n:
        raise ValueError(f"hr_batches holds {len(hr_batches)} batches but lr_batches {n}; pass "
                         "one HR batch per LR batch")
    if batch == 0:
        raise ValueError("lr_batches' batches hold 0 samples; pass at least one sample per batch")
    if hr_batches.shape[1] != batch:
        raise ValueError(f"hr_batches' batches hold {hr_batches.shape[1]} samples but "
                         f"lr_batches' {batch}; pass the targets of every LR sample")
    image, target = tuple(lr_batches.shape[2:]), tuple(hr_batches.shape[2:])
    if lr_batches.shape[3] != side:
        raise ValueError(f"lr_batches' images are {side} x {lr_batches.shape[3]} pixels; the "
                         "supernet takes square images: pass LR patches as high as they are wide")
    shared = jax.ShapeDtypeStruct((layout.shared_size,), np.float32)
    inputs = jax.ShapeDtypeStruct((1, *image), np.float32)
    try:
        jax.eval_shape(layout.apply_stem, shared, inputs)
        features = jax.ShapeDtypeStruct(layout.feature_shape(1, side), np.float32)
        output = jax.eval_shape(layout.apply_head, shared, features, inputs)
    except (TypeError, ValueError) as err:
        reason = str(err).split("\n", 1)[0]
        raise ValueError(f"lr_batches' images of {image} do not fit the supernet's input "
                         f"({reason}); pass images with the channels it takes") from err
    if tuple(output.shape[1:]) != target:
        raise ValueError(
            f"hr_batches' images are {target} but the supernet turns LR images of {image} into "
            f"{tuple(output.shape[1:])}; pass HR targets of that shape")


def make_schedule(
    name: str,
    subnets: Sequence[Sequence[int]],
    bounds: Sequence[tuple[int, int]],
    *,
    train_shared: bool = False,
    num_microbatches: int = 4,
    max_inflight: int | None = None,
) -> Schedule:
    """Build and check the schedule ``name`` in `SCHEDULES` for ``subnets`` over ``bounds``.

    ``num_microbatches`` applies to ``gpipe`` only. Every schedule is validated structurally and
    checked to read and update every parameter in sequence-id order before it is returned.
    """
    n = len(subnets)
    if name == "csp":
        sched = csp_schedule(
            subnets, bounds, train_shared=train_shared, max_inflight=max_inflight
        )
    elif name == "gpipe":
        sched = gpipe_schedule(n, len(bounds), num_microbatches)
    elif name == "sequential":
        sched = sequential_schedule(n, len(bounds))
    else:
        raise ValueError(f"unknown schedule {name!r}; use one of {SCHEDULES}")
    validate_schedule(sched)
    check_causality(sched, subnets, bounds, train_shared)
    return sched


def split_microbatches(batches: np.ndarray, num_microbatches: int) -> np.ndarray:
    """(N, B, ...) batches -> (N, M, B / M, ...) microbatches (sample order kept)."""
    n, b = batches.shape[:2]
    if b % num_microbatches:
        raise ValueError(
            f"batch size {b} is not a multiple of {num_microbatches=}; use a batch of "
            f"{max(1, b // num_microbatches) * num_microbatches}"
        )
    return batches.reshape(n, num_microbatches, b // num_microbatches, *batches.shape[2:])


def params_sha256(blocks: np.ndarray, shared: np.ndarray) -> str:
    """SHA-256 of the float32 bytes of the supernet weights (blocks then shared), hex."""
    digest = hashlib.sha256()
    for arr in (blocks, shared):
        digest.update(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class SupernetState:
    """The supernet's weights with their optimizer state: where `train_supernet` stopped
    (`TrainResult.state`) and where it can continue (its ``initial_state``).

    Training subnets ``[0, k)``, then ``[k, N)`` from the first run's ``state``, computes the
    same losses and weights, bit for bit, as training ``[0, N)`` in one call, when both runs
    have the same ``num_stages``. The weights depend on the stage count (the order of some
    floating-point sums follows the stages, so another count may change their last bits), and a
    state does not record it: continuing under another ``num_stages`` trains on, but does not
    reproduce the one-call run.

    Attributes:
      blocks: (L, C, P) block weights; shared: (P_shared,) stem and head weights.
      optimizer: the optimizer state as `StageExecutor.export` returns it
        (`StageExecutor.optimizer_keys`: ``blocks_<field>`` (L, C, P), ``block_steps`` (L, C),
        ``shared_<field>`` (P_shared,), ``shared_step`` ()).
    """

    blocks: np.ndarray
    shared: np.ndarray
    optimizer: dict[str, np.ndarray]


@dataclass(frozen=True)
class TrainResult:
    """Outcome of `train_supernet`.

    Attributes:
      schedule: schedule name.
      losses: (N,) training loss per subnet in sequence-id order.
      blocks: (L, C, P) final block weights; shared: (P_shared,) final stem and head weights.
      optimizer: their final optimizer state (`SupernetState.optimizer`); `state` holds all
        three, to continue training from (``train_supernet(..., initial_state=result.state)``).
      params_sha256: `params_sha256` of the final weights.
      ticks, stage_utilization: schedule length and busy stage-ticks / (S x ticks).
      ideal_ticks, ideal_utilization: the same pipeline without CSP stalls (one subnet per
        batch, no microbatches), for comparison.
      device_param_bytes: weights + optimizer state resident in device memory, all stages.
      host_param_bytes: weights + optimizer state in host memory (the store when offloading).
      supernet_param_bytes: weights + optimizer state of the whole supernet (store + shared).
      activation_bytes: saved-input and gradient buffers on the devices.
      wall_seconds: time of the whole run (including compilation), seconds.
      steady_seconds: time of all ticks after the first (compilation excluded), seconds.
      samples_per_second: training samples over ``steady_seconds`` x ticks / (ticks - 1).
    """

    schedule: str
    losses: np.ndarray
    blocks: np.ndarray
    shared: np.ndarray
    optimizer: dict[str, np.ndarray]
    params_sha256: str
    ticks: int
    stage_utilization: float
    ideal_ticks: int
    ideal_utilization: float
    device_param_bytes: int
    host_param_bytes: int
    supernet_param_bytes: int
    activation_bytes: int
    wall_seconds: float
    steady_seconds: float
    samples_per_second: float

    @property
    def state(self) -> SupernetState:
        """The final weights and optimizer state, for ``train_supernet(initial_state=...)``."""
        return SupernetState(self.blocks, self.shared, self.optimizer)


def build_executor(
    layout: StageModel,
    programs: Sequence[TickProgram],
    *,
    num_stages: int,
    batch_size: int,
    lr_side: int,
    num_microbatches: int = 1,
    train_shared: bool = False,
    offload: bool = False,
    optimizer: OptimizerSpec | None = None,
    executor_class: ExecutorFactory = PipelineExecutor,
) -> StageExecutor:
    """An executor whose buffers fit every program in ``programs`` (one compiled tick for all).

    ``executor_class`` builds it (default `PipelineExecutor`, all stages in this process); pass
    e.g. ``functools.partial(MPIPipelineExecutor, comm=comm)`` for one stage per MPI rank
    (`scamp_jax.distributed.train_supernet_mpi` does, after checking that every rank passes
    the same arguments; the executor itself checks the weights, program and batches; code
    around it that one rank may raise in belongs inside
    `scamp_jax.distributed.failures_end_every_rank`).
    """
    return executor_class(
        layout,
        num_stages=num_stages,
        microbatch_size=batch_size // num_microbatches,
        lr_side=lr_side,
        window_slots=max(p.window_slots for p in programs),
        act_slots=max(p.act_slots for p in programs),
        grad_slots=max(p.grad_slots for p in programs),
        num_microbatches=num_microbatches,
        train_shared=train_shared,
        offload=offload,
        optimizer=optimizer,
    )


def _check_reused_executor(executor: StageExecutor, layout: StageModel, num_stages: int,
                           **wanted: Any) -> None:
    """Refuse an executor compiled for another model than ``layout`` (it would train its own,
    whose blocks, head and loss it compiled) or stage count, or for other training than
    ``wanted`` (its `StageSpec`): the update rule is the executor's, while the schedule and its
    causality check follow the arguments, so a mismatch (e.g. an executor that trains the stem
    and head under a schedule that lets subnets overlap on them) would no longer train as
    sequential training does."""
    if executor.layout is not layout:
        raise ValueError(
            f"the executor passed was built for another model (a {type(executor.layout).__name__}"
            f" other than the {type(layout).__name__} passed) and would train that one; pass "
            "the layout it was built with, or an ExecutorFactory to build one for this model")
    if executor.spec.num_stages != num_stages:
        raise ValueError(
            f"the executor passed runs {executor.spec.num_stages} stages but {num_stages=}; "
            f"pass num_stages={executor.spec.num_stages}, or an ExecutorFactory to build one "
            f"of {num_stages} stages")
    differ = [f"{name}={value!r} (the executor's: {getattr(executor.spec, name)!r})"
              for name, value in wanted.items() if getattr(executor.spec, name) != value]
    if differ:
        raise ValueError(
            f"the executor passed was built for other training: {', '.join(differ)}; pass the "
            "arguments it was built with, or an ExecutorFactory to build one for these")


def train_supernet(
    layout: StageModel,
    subnets: Sequence[Sequence[int]],
    lr_batches: np.ndarray,
    hr_batches: np.ndarray,
    *,
    schedule: str = "csp",
    num_stages: int = 4,
    seed: int = 0,
    offload: bool = True,
    train_shared: bool = False,
    num_microbatches: int = 4,
    optimizer: OptimizerSpec | None = None,
    max_inflight: int | None = None,
    prefetch_ahead: int = 1,
    initial_weights: tuple[np.ndarray, np.ndarray] | None = None,
    initial_state: SupernetState | None = None,
    executor: StageExecutor | ExecutorFactory | None = None,
    on_tick: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train the supernet initialised from ``seed`` on ``subnets`` (one batch each, in order).

    Args:
      layout: the supernet (a `scamp_jax.pipeline.StageModel`; anything else is refused with
        a `TypeError` naming what it lacks).
      subnets: N choice vectors (L,), index = sequence id.
      lr_batches: (N, B, h, h, 3) float32 LR inputs (square images), batch i for subnet i.
      hr_batches: (N, B, r h, r h, 3) float32 HR targets.
      schedule: one of `SCHEDULES`.
      num_stages: S pipeline stages (one device each). The final weights depend on it (the
        order of some floating-point sums follows the stages): runs are bit-identical at the
        same stage count.
      seed: weight initialisation seed.
      offload: keep the whole supernet (weights and optimizer state) in host memory.
      train_shared: train the stem and head too (serialises CSP on the first and last stage).
      num_microbatches: microbatches per batch for ``gpipe`` (ignored otherwise).
      optimizer: per-block optimizer (default Adam, learning rate 1e-3).
      max_inflight: CSP's cap on subnets in flight (default S).
      prefetch_ahead: ticks a subnet's blocks may be fetched before its first forward.
      initial_weights: ``(blocks (L, C, P), shared (P_shared,))`` to start from, e.g. with a
        warmed-up stem and head (default ``layout.init(seed)``); optimizer state starts at zero.
      initial_state: weights and optimizer state to continue from (a previous run's
        `TrainResult.state`, or one restored from a checkpoint), instead of
        ``initial_weights``: training ``subnets[:k]``, then ``subnets[k:]`` from the first
        run's state, equals training ``subnets`` in one call, bit for bit, when both runs have
        the same ``num_stages`` (a state does not record its stage count; under another one
        the run trains on but does not reproduce the one-call run).
      executor: a compiled executor to reuse (its buffers must fit this run's program; left
        open), or an `ExecutorFactory` that `build_executor` calls to build one sized for this
        run (default `PipelineExecutor`; closed when the run ends, unless the factory keeps
        what it builds, as `scamp_jax.pipeline.budget.ExecutorCache` does).
      on_tick: progress callback ``on_tick(tick, total_ticks)``.
    Returns:
      the `TrainResult`.
    """
    layout = check_stage_model(layout)
    if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
        raise TypeError(f"optimizer takes an OptimizerSpec (the per-block update rule the stage "
                        f"programs compile, e.g. OptimizerSpec('adam', learning_rate=1e-3)), "
                        f"not {type(optimizer).__name__}")
    if initial_state is not None and not isinstance(initial_state, SupernetState):
        raise TypeError(f"initial_state takes a SupernetState (a TrainResult's .state), not "
                        f"{type(initial_state).__name__}; for weights alone pass "
                        "initial_weights=(blocks, shared)")
    lr_batches, hr_batches = np.asarray(lr_batches), np.asarray(hr_batches)  # lists too
    subnets = [list(subnet) for subnet in subnets]  # a generator, or an array, too
    n, batch = lr_batches.shape[:2] if lr_batches.ndim >= 2 else (len(lr_batches), 0)
    if initial_weights is not None and initial_state is not None:
        raise ValueError("pass initial_weights (optimizer state from zero) or initial_state "
                         "(weights with their optimizer state), not both")
    if n != len(subnets):
        raise ValueError(f"{len(subnets)} subnets but {n} batches; pass one batch per subnet")
    check_batches(layout, lr_batches, hr_batches)
    check_subnets(subnets, layout.num_layers, layout.num_choices)
    bounds = split_layers(layout.num_layers, num_stages)
    m_count = num_microbatches if schedule == "gpipe" else 1
    sched = make_schedule(
        schedule, subnets, bounds, train_shared=train_shared, num_microbatches=m_count,
        max_inflight=max_inflight,
    )
    ideal = ideal_schedule(subnets, bounds, max_inflight=max_inflight)
    program = build_program(sched, subnets, bounds, prefetch_ahead=prefetch_ahead)
    start = time.perf_counter()
    # Closed here once the run ends, unless a factory keeps what it builds (`ExecutorCache`).
    built = not isinstance(executor, StageExecutor) and not getattr(
        executor, "keeps_executors", False)
    if isinstance(executor, StageExecutor):
        _check_reused_executor(executor, layout, num_stages, train_shared=train_shared,
                               offload=offload, optimizer=optimizer or OptimizerSpec(),
                               num_microbatches=m_count)
    else:
        executor = build_executor(
            layout, [program], num_stages=num_stages, batch_size=batch,
            lr_side=lr_batches.shape[2], num_microbatches=m_count, train_shared=train_shared,
            offload=offload, optimizer=optimizer, executor_class=executor or PipelineExecutor,
        )
    first_tick_done: list[float] = []

    def progress(t: int, total: int) -> None:
        if t == 0:
            first_tick_done.append(time.perf_counter())
        if on_tick is not None:
            on_tick(t, total)

    try:
        if initial_state is not None:
            state = executor.init_state(initial_state.blocks, initial_state.shared,
                                        optimizer_state=initial_state.optimizer)
        else:
            blocks0, shared0 = layout.init(seed) if initial_weights is None else initial_weights
            state = executor.init_state(blocks0, shared0)
        state, losses = executor.run(
            state,
            program,
            split_microbatches(lr_batches, m_count),
            split_microbatches(hr_batches, m_count),
            on_tick=progress,
        )
    except ValueError:
        # a refusal (every MPI rank raises it alike, so the collective close is too): the
        # executor this call built is closed, as after a run; other failures end an MPI job
        if built:
            executor.close()
        raise
    jax.block_until_ready(state)
    end = time.perf_counter()
    exported = executor.export(state)
    memory = executor.resident_bytes(state)
    if built:  # collective on every rank alike; a failed run ends its MPI job instead
        executor.close()
    steady = end - first_tick_done[0] if first_tick_done else 0.0
    per_tick = steady / max(1, sched.ticks - 1)
    return TrainResult(
        schedule=schedule,
        losses=losses,
        blocks=exported["blocks"],
        shared=exported["shared"],
        optimizer={k: v for k, v in exported.items() if k not in ("blocks", "shared")},
        params_sha256=params_sha256(exported["blocks"], exported["shared"]),
        ticks=sched.ticks,
        stage_utilization=sched.utilization,
        ideal_ticks=ideal.ticks,
        ideal_utilization=ideal.utilization,
        device_param_bytes=memory["device_param_bytes"],
        host_param_bytes=memory["host_param_bytes"],
        supernet_param_bytes=supernet_state_bytes(layout, executor.spec.optimizer),
        activation_bytes=memory["activation_bytes"],
        wall_seconds=end - start,
        steady_seconds=steady,
        samples_per_second=n * batch / (per_tick * sched.ticks) if per_tick > 0 else 0.0,
    )


def supernet_state_bytes(layout: StageModel, optimizer: OptimizerSpec) -> int:
    """Bytes of the whole supernet's weights and optimizer state (flat layout, float32).

    Counts every (layer, candidate) block at the padded length P plus the stem and head, times
    the optimizer's float fields, plus one int32 step count per block.
    """
    return state_bytes(layout, len(optimizer.fields))
