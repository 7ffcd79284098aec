"""Largest batch (and prefetch window) of a pipeline schedule under a per-device memory budget.

Schedules hold different buffers: sequential one subnet's activations per stage, GPipe a whole
batch in microbatches plus gradient accumulators, CSP several subnets in flight. Comparing them at
one batch size mixes what a schedule saves in time with what it costs in memory. `plan_schedule`
gives every schedule its own largest batch under the same budget, measured on the compiled stage
tick (XLA ``memory_analysis``, per stage device):

1. compile the tick at two batch sizes with the smallest window (no prefetch look-ahead) and fit
   the device bytes as ``a + k * batch`` (activation and gradient buffers and the temporaries of
   the forward and backward grow with the batch);
2. take the largest batch (a multiple of the microbatch count) the fit allows;
3. spend what is left of the budget on prefetch look-ahead: each tick of look-ahead can keep one
   more subnet's blocks resident on the stage (`scamp_jax.pipeline.build_program`), and a window
   slot's bytes follow from the state layout;
4. compile the tick at the chosen batch and window and check it against the budget (stepping the
   look-ahead, then the batch, down if it does not fit). That compiled tick is the one the run
   uses.

Compiles are what planning costs (seconds to minutes each on a CPU, growing with the candidates
per stage). Look-aheads that need the same window, and a final batch equal to a probe's, build
the very same tick: `ExecutorCache` hands back the executor already compiled for equal
arguments, within one plan and across the plans (and runs) that share the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scamp_jax.pipeline.csp import split_layers
from scamp_jax.pipeline.executor import PipelineExecutor
from scamp_jax.pipeline.executor_base import StageExecutor
from scamp_jax.pipeline.model import StageModel
from scamp_jax.pipeline.program import TickProgram, build_program
from scamp_jax.pipeline.trainer import (
    ExecutorFactory,
    build_executor,
    check_subnets,
    make_schedule,
)

#: ``shapes(microbatch_size) -> (input_shape, target_shape)`` of one stage's microbatch.
SampleShapes = Callable[[int], tuple[tuple[int, ...], tuple[int, ...]]]


class BatchDoesNotFitError(ValueError):
    """Not even the smallest batch of a schedule fits the per-device budget."""


@dataclass(frozen=True)
class SchedulePlan:
    """A schedule's largest fitting batch and window under a per-device budget.

    Attributes:
      schedule: ``sequential``, ``gpipe`` or ``csp``.
      batch_size: samples per subnet batch.
      num_microbatches: M (GPipe; 1 otherwise).
      prefetch_ahead: ticks a subnet's blocks are fetched before its first forward.
      window_slots: subnets' blocks resident per stage.
      device_bytes: the compiled tick's device bytes per stage device at this plan.
      budget_bytes: the budget, bytes per device.
      fit: ``(a, k)`` of the fit ``device bytes = a + k * batch`` (bytes, bytes per sample).
      compiles: tick compilations spent on the plan (ticks an `ExecutorCache` already held
        compiled do not count).
    """

    schedule: str
    batch_size: int
    num_microbatches: int
    prefetch_ahead: int
    window_slots: int
    device_bytes: int
    budget_bytes: int
    fit: tuple[float, float]
    compiles: int


class ExecutorCache:
    """An `ExecutorFactory` that builds each distinct executor once and then hands it back.

    Executors built with equal arguments (the same model object and equal sizes, slots, flags
    and optimizer) compile the same tick, so planning and running several schedules through one
    cache compile every distinct stage step once. An executor keeps no training state between
    runs (`init_state` makes a fresh one), so sharing it is safe.

    The cache owns what it builds: `scamp_jax.pipeline.trainer.train_supernet` leaves them open
    (``keeps_executors``), and `close` closes them all (collective for MPI executors: every rank
    calls it at the same point), so one MPI executor serves every run it fits.

    Args:
      factory: builds an executor on a miss (default `PipelineExecutor`; e.g.
        ``functools.partial(PipelineExecutor, max_in_flight=4)``).

    Attributes:
      built: executors the factory built (misses); ``hits``: calls answered from the cache.
    """

    #: `train_supernet` does not close what this factory returns (the cache closes it).
    keeps_executors = True

    def __init__(self, factory: ExecutorFactory = PipelineExecutor):
        self.factory = factory
        self._executors: dict[tuple[int, Hashable], tuple[StageModel, StageExecutor]] = {}
        self._uncached: list[StageExecutor] = []
        self.built = 0
        self.hits = 0

    def __call__(self, model: StageModel, **sizes: Any) -> StageExecutor:
        """The executor for ``model`` and ``sizes`` (`StageExecutor`'s keywords)."""
        key = (id(model), tuple(sorted(sizes.items())))
        try:
            hash(key)
        except TypeError:  # e.g. a list of devices: build without caching (closed by `close`)
            self.built += 1
            self._uncached.append(self.factory(model, **sizes))
            return self._uncached[-1]
        if key in self._executors:
            self.hits += 1
        else:
            # The model is kept with its executor so that its id cannot be reused meanwhile.
            self._executors[key] = (model, self.factory(model, **sizes))
            self.built += 1
        return self._executors[key][1]

    def close(self) -> None:
        """Close every executor the cache built and forget them (collective, as each
        executor's own ``close``); the cache builds anew afterwards."""
        executors = [e for _, e in self._executors.values()] + self._uncached
        self._executors, self._uncached = {}, []
        for executor in executors:
            executor.close()


def _window_slot_bytes(executor: StageExecutor) -> int:
    """Bytes of one window slot of one stage (weights, optimizer fields, step counts, acc)."""
    window = executor.state_shapes()["window"]
    prefix = len(executor._stage_prefix)
    total = 0
    for leaf in window.values():
        per_slot = int(np.prod(leaf.shape[prefix + 1 :]))
        total += per_slot * np.dtype(leaf.dtype).itemsize
    return total


def plan_schedule(
    model: StageModel,
    subnets: Sequence[Sequence[int]],
    shapes: SampleShapes,
    *,
    schedule: str,
    num_stages: int,
    budget_bytes: int,
    lr_side: int,
    num_microbatches: int = 4,
    offload: bool = True,
    train_shared: bool = False,
    max_prefetch_ahead: int | None = None,
    max_batch: int = 4096,
    batch_multiple: int | None = None,
    executor_class: ExecutorFactory = PipelineExecutor,
) -> tuple[SchedulePlan, StageExecutor, TickProgram]:
    """Plan ``schedule`` under ``budget_bytes`` per device (see the module docstring).

    Args:
      model: the supernet.
      subnets: the subnets the run will train (their overlap sizes CSP's window).
      shapes: input and target shapes of one stage's microbatch for a microbatch size.
      schedule: ``sequential``, ``gpipe`` or ``csp``.
      num_stages: S.
      budget_bytes: device memory per stage device (bytes).
      lr_side: input side (pixels).
      num_microbatches: M for ``gpipe`` (its batch is a multiple of M).
      offload, train_shared: as for `scamp_jax.pipeline.train_supernet`.
      max_prefetch_ahead: most look-ahead ticks (default S).
      max_batch: largest batch considered.
      batch_multiple: batches are multiples of this (default M for ``gpipe``, else 1); pass
        the same value to every schedule to compare them at common batch sizes too.
      executor_class: builds the executors (default `PipelineExecutor`); pass an
        `ExecutorCache` to reuse compiled ticks across probes, plans and runs.
    Returns:
      ``(plan, executor, program)``: the executor's tick is compiled for the plan (the run reuses
      it) and the program is the schedule's with the planned look-ahead.
    Raises:
      BatchDoesNotFitError: naming the smallest batch's bytes and the budget.
    """
    check_subnets(subnets, model.num_layers, model.num_choices)
    m = num_microbatches if schedule == "gpipe" else 1
    g = batch_multiple or m
    if g % m:
        raise ValueError(f"{batch_multiple=} must be a multiple of the {m} microbatches")
    bounds = split_layers(model.num_layers, num_stages)
    sched = make_schedule(schedule, subnets, bounds, train_shared=train_shared,
                          num_microbatches=m)
    programs = {
        ahead: build_program(sched, subnets, bounds, prefetch_ahead=ahead)
        for ahead in range(0, (num_stages if max_prefetch_ahead is None else max_prefetch_ahead)
                           + 1)
    }
    compiles = 0

    def compiled(batch: int, ahead: int) -> tuple[int, StageExecutor]:
        nonlocal compiles
        ex = build_executor(
            model, [programs[ahead]], num_stages=num_stages, batch_size=batch, lr_side=lr_side,
            num_microbatches=m, train_shared=train_shared, offload=offload,
            executor_class=executor_class,
        )
        compiles += not ex.is_compiled(*shapes(batch // m))
        return ex.compiled_memory(*shapes(batch // m))["device_bytes"], ex

    small, large = g, 4 * g
    b_small, ex_small = compiled(small, 0)
    if b_small > budget_bytes:
        raise BatchDoesNotFitError(
            f"{schedule}: a batch of {small} needs {b_small} bytes per device, more than the "
            f"budget of {budget_bytes} bytes; raise the budget or use fewer choices per stage"
        )
    b_large, _ = compiled(large, 0)
    slope = max((b_large - b_small) / (large - small), 1e-9)
    base = b_small - slope * small
    batch = int(min(max_batch, (budget_bytes - base) // slope)) // g * g
    batch = max(batch, small)
    slot = _window_slot_bytes(ex_small)
    left = budget_bytes - (base + slope * batch)
    ahead = max(
        (a for a, p in programs.items()
         if (p.window_slots - programs[0].window_slots) * slot <= left),
        default=0,
    )
    while True:
        used, ex = compiled(batch, ahead)
        if used <= budget_bytes:
            break
        if ahead > 0:
            ahead -= 1
        elif batch > small:
            batch -= g
        else:  # pragma: no cover - the smallest batch fitted above
            raise BatchDoesNotFitError(f"{schedule}: no batch fits {budget_bytes} bytes")
    plan = SchedulePlan(
        schedule=schedule, batch_size=batch, num_microbatches=m, prefetch_ahead=ahead,
        window_slots=programs[ahead].window_slots, device_bytes=used,
        budget_bytes=budget_bytes, fit=(float(base), float(slope)), compiles=compiles,
    )
    return plan, ex, programs[ahead]
