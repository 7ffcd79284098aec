"""Trials that span MPI ranks: data parallel, one device per rank, gradients reduced by mpi4jax.

Under MPI every rank plans its trials on its own devices first (`scamp_jax.distributed.engine`).
A configuration whose ScaMP plan cannot reach the study's ``min_batch_size`` on all of one
rank's devices is not failed: the rank defers it with a `SpanPlan` — the fewest ranks whose
devices together hold that batch, each rank training a whole replica of the model on one device
on its share of every global batch. The gradients and the loss are averaged over those ranks by
``mpi4jax.allreduce`` inside the jitted step (`scamp_jax.distributed.data_parallel.mpi_mean`),
so every replica applies the same update and the run equals training on the whole batch in one
process up to float32 reassociation (a model that draws random numbers in training, dropout
or drop-path, draws each rank's own: `scamp_jax.hpo.runner.own_random_streams`).

A spanning trial is booked as a lone trial is: its one-device plan is made for the budget less
the reduction's buffers (`scamp_jax.distributed.data_parallel.mpi_mean_bytes`, which the
planner's step does not hold), each rank books that plan with the reduction added to its step
(`scamp_jax.scheduling.booking.booked_bytes`) in a `DevicePool` of the budget less the safety
margin, and the run's ledger check measures the step it compiles, reduction included, against
that booking.

The deferred trials run after every rank has finished its local trials, when all devices are
free: `run_spanning_trials` packs them into groups of ranks (``comm.Split``), several groups at
once when they fit, and rank 0 tells the study how each one ended. Fewest ranks first keeps the
share of the step spent in cross-rank communication low (``benchmarks/mpi_comm.py`` measures
it); a trial that fits on one rank never spans.

Limits: one device per rank takes part (mpi4jax runs once per process, not per device of a
sharded computation); a model that needs model parallelism to fit one device cannot span ranks
and fails with a message saying so; spanning trials are not pruned (their intermediate values
would reach the study only after the fact). A spanning trial that fails on one of its ranks
(its data, an out-of-memory on that rank's device) ends the job, as an exception on a rank
does under MPI (`_end_together`): the group's other ranks wait for that rank in the step's
gradient reduction, which nothing else ends; the same command resumes the study.
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scamp_jax._signals import Terminated, interruptible, stops_held
from scamp_jax.hpo.failures import TRACEBACK
from scamp_jax.hpo.lifecycle import MemberSpec, Schedule
from scamp_jax.hpo.runner import RunSpec, make_optimizer, run_trial
from scamp_jax.hpo.study.trials import TrialOutcome
from scamp_jax.hpo.trial import RunResult, TrialStatus
from scamp_jax.planning import planner
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.train_step import StepShardings
from scamp_jax.scheduling.booking import booked_bytes
from scamp_jax.scheduling.placement import Placement, TrialRequest
from scamp_jax.scheduling.pool import DevicePool


@dataclass(frozen=True)
class SpanPlan:
    """How a trial spans ranks (plain numbers, sent between ranks).

    Attributes:
      ranks: ranks that train it together, one device each.
      batch_per_rank: samples per rank in every step; the global batch is ``ranks`` times that.
      peak_bytes_per_device: the step's peak on one device: the planner's compiled peak at
        ``batch_per_rank`` plus the cross-rank reduction's buffers.
      booked_bytes: what each rank books for it (`scamp_jax.scheduling.booking.booked_bytes` of
        the one-device plan with the reduction added to its step), within the usable part of
        the budget; the run is checked against it.
    """

    ranks: int
    batch_per_rank: int
    peak_bytes_per_device: int
    booked_bytes: int

    @property
    def global_batch(self) -> int:
        """Samples per step over all the trial's ranks."""
        return self.ranks * self.batch_per_rank


@dataclass(frozen=True)
class SpanningTrial:
    """A deferred trial: the asked configuration, its `SpanPlan` and the rank that asked it."""

    number: int
    params: Mapping[str, Any]
    checkpoint_key: str
    plan: SpanPlan
    asked_by: int


@dataclass(frozen=True)
class OneDevicePlan:
    """The plan a spanning trial's runner executes on one rank: a whole replica on one device.

    Duck-types the parts of `scamp_jax.planning.planner.Plan` that `scamp_jax.hpo.runner.run_trial`
    reads.
    ``batch_size`` is this rank's share of the global batch.
    """

    mesh: Mesh
    step_shardings: StepShardings
    batch_sharding: NamedSharding
    batch_size: int
    peak_bytes_per_device: int
    data_parallel: int = 1
    model_parallel: int = 1


def span_plan(
    call_planner: Callable[[Any, int, int | None, int | None], Any],
    model: Any,
    *,
    ranks: int,
    min_batch_size: int,
    max_batch_size: int | None,
    memory_per_device: int,
    safety_margin: float,
    reduction_bytes: int,
    local_error: Exception,
) -> SpanPlan:
    """The fewest ranks (one device each) whose replicas together train ``min_batch_size``.

    The step that runs reduces its gradients over the ranks (`mpi_mean`), which the planner's
    step does not: the one-device plan is made for the budget less ``reduction_bytes``, and the
    booking adds them to its step through the byte rule, so the booking covers the step that
    runs and stays within ``memory_per_device * (1 - safety_margin)``.

    Args:
      call_planner: ``f(model, n_devices, max_batch, memory_per_device) -> Plan`` on this
        rank's first devices (`scamp_jax.hpo.plan_service.PlanningService.call_planner`).
      model: the configuration's abstract model.
      ranks: ranks of the job.
      min_batch_size: the global batch the trial must reach.
      max_batch_size: cap on the global batch (None: none).
      memory_per_device, safety_margin: each rank's budget and the share of it kept free.
      reduction_bytes: what the cross-rank reduction adds to the step per device
        (`scamp_jax.distributed.data_parallel.mpi_mean_bytes`).
      local_error: why the trial did not fit on this rank's devices (quoted in errors).

    Raises:
      planner.DoesNotFitError: the model does not fit one device at batch 1 beside the
        reduction (spanning ranks does not split a model), the job has too few ranks, or no
        group of them trains an equal share each within ``min_batch_size`` and
        ``max_batch_size``; the message says what to change.
    """
    usable = Budget(memory_per_device, safety_margin).usable_bytes
    # The plan's usable part (floor of memory * (1 - margin)) leaves the reduction room.
    memory = math.floor((usable - reduction_bytes) / (1.0 - safety_margin))
    try:
        if memory <= 0:
            raise planner.DoesNotFitError(
                f"the cross-rank reduction alone needs {reduction_bytes} bytes, {usable} are "
                "usable", reduction_bytes, usable)
        one = call_planner(model, 1, max_batch_size, memory)
    except planner.DoesNotFitError as err:
        raise planner.DoesNotFitError(
            f"{local_error}. It cannot span ranks either: ranks share a trial data-parallel, "
            f"each holding the whole model on one device beside a {reduction_bytes}-byte "
            f"gradient reduction, and it does not fit one device ({err}). Give each rank more "
            "memory per device (--memory-per-device)",
            err.bytes_needed, err.bytes_available,
        ) from err
    fits = int(one.batch_size)
    need = max(2, math.ceil(min_batch_size / fits))
    if need > ranks:
        raise planner.DoesNotFitError(
            f"{local_error}. Spanning ranks, one device fits a batch of {fits} beside the "
            f"gradient reduction, so min_batch_size={min_batch_size} needs {need} ranks but the "
            f"job has {ranks}: launch at least {need} ranks, lower --min-batch-size, or raise "
            "--memory-per-device",
            booked_bytes(one, step_extra=reduction_bytes), usable,
        )

    def shares(n: int) -> tuple[int, int]:  # each of n ranks' fewest and most samples
        most = fits if max_batch_size is None else min(fits, max_batch_size // n)
        return math.ceil(min_batch_size / n), most

    first = need
    while need <= ranks and shares(need)[0] > shares(need)[1]:
        need += 1  # every rank trains the same share: n x share must lie in [min, max]
    if need > ranks:
        raise planner.DoesNotFitError(
            f"{local_error}. Spanning ranks, one device fits a batch of {fits} beside the "
            f"gradient reduction and every rank trains the same share, so no group of "
            f"{first} to {ranks} ranks trains a global batch between min_batch_size="
            f"{min_batch_size} and max_batch_size={max_batch_size}: widen that range, or "
            "raise --memory-per-device",
            booked_bytes(one, step_extra=reduction_bytes), usable,
        )
    per_rank = shares(need)[1]
    if per_rank < fits:  # book the plan of the batch that runs
        one = call_planner(model, 1, per_rank, memory)
    booked = booked_bytes(one, step_extra=reduction_bytes)
    if booked > usable:  # the planner keeps its plan within the budget less the reduction
        raise AssertionError(f"span booking {booked} exceeds the usable {usable} bytes")
    return SpanPlan(need, per_rank, int(one.peak_bytes_per_device) + int(reduction_bytes),
                    booked)


def one_device_plan(space: Any, params: Mapping[str, Any], batch_per_rank: int,
                    device: Any) -> OneDevicePlan:
    """A `OneDevicePlan` for ``params`` on ``device`` (every leaf replicated on it)."""
    from scamp_jax.distributed.data_parallel import one_device_shardings

    model = nnx.eval_shape(lambda: space.model(params, nnx.Rngs(0)))
    shardings = one_device_shardings(model, make_optimizer(params), device)
    return OneDevicePlan(mesh=shardings.mesh, step_shardings=shardings,
                         batch_sharding=shardings.batch, batch_size=batch_per_rank,
                         peak_bytes_per_device=0)


def assign_rounds(
    trials: Sequence[SpanningTrial], ranks: int
) -> list[list[tuple[SpanningTrial, tuple[int, ...]]]]:
    """Rounds of concurrent groups: each round gives trials (in number order) disjoint
    consecutive ranks while they last. Every rank computes the same rounds.

    Raises:
      ValueError: a trial needs more ranks than the job has.
    """
    pending = sorted(trials, key=lambda t: t.number)
    for trial in pending:
        if trial.plan.ranks > ranks:
            raise ValueError(f"trial {trial.number} needs {trial.plan.ranks} ranks, the job has "
                             f"{ranks}")
    rounds = []
    while pending:
        free, later, groups = 0, [], []
        for trial in pending:
            if trial.plan.ranks <= ranks - free:
                groups.append((trial, tuple(range(free, free + trial.plan.ranks))))
                free += trial.plan.ranks
            else:
                later.append(trial)
        rounds.append(groups)
        pending = later
    return rounds


class SpanningRun(NamedTuple):
    """How a trial that spanned ranks ran (`run_spanning_trials`): on ``ranks`` (one device of
    each), its ``result``, from ``start_s`` seconds after the spanning trials began (its
    round's start, on rank 0's clock; it ran ``result.wall_seconds`` from there)."""

    trial: SpanningTrial
    ranks: tuple[int, ...]
    result: RunResult
    start_s: float


def run_spanning_trials(
    trials: Sequence[SpanningTrial],
    space: Any,
    task: Any,
    config: Any,
    comm: Any,
    *,
    checkpoint_root: Path | None,
    log: Callable[[str], None] = print,
    on_finished: Callable[[SpanningTrial, tuple[int, ...], RunResult], None] | None = None,
    on_stop: Callable[[list[int]], None] | None = None,
) -> list[SpanningRun]:
    """Run the deferred ``trials`` across the ranks of ``comm`` (collective: call on every rank).

    Args:
      trials: every rank's deferred trials (the same list on every rank).
      space, task: the search space and task.
      config: the `scamp_jax.hpo.settings.EngineConfig` (steps, budget, checkpointing, seed).
      comm: mpi4py communicator of all ranks.
      checkpoint_root: directory of the study's checkpoints (seen by every rank), or None.
      log: where rank 0 prints progress lines.
      on_finished: called on rank 0 with ``(trial, ranks, result)`` as each round's trials
        end (the study records each then, not once every round has run).
      on_stop: called on rank 0, at once, with the numbers of the round's trials when a stop
        (Ctrl-C or SIGTERM) reaches it during the round: the study takes them back before
        their ranks have stopped, which an MPI launcher may not wait for (their checkpoint at
        the stop follows); none of them is then told finished.

    Returns:
      on rank 0, a `SpanningRun` for every trial in finishing order; elsewhere ``[]``.
    """
    from scamp_jax.distributed.mpi import import_mpi4py

    mpi = import_mpi4py()
    rank, size = comm.Get_rank(), comm.Get_size()
    finished: list[SpanningRun] = []
    began = time.monotonic()
    # This rank's one device, booked as the engine books a lone trial's: its plan's bytes by the
    # byte rule, within the budget less the safety margin.
    pool = DevicePool([config.need_budget().usable_bytes])
    given: set[int] = set()  # given back at a stop (`on_stop`)
    kind = 0  # the stop the ranks agreed on at a round's end (`_STOP_KINDS`)
    # Stops are held for the whole phase: a Ctrl-C or SIGTERM raised between two collectives
    # would take one rank out of the sequence the others go on with (they would wait for it
    # for ever). Held, a stop reaches a running trial as its flag (`_run_stoppable`), and every
    # rank ends the phase together at the end of the round.
    with stops_held() as held:
        for groups in assign_rounds(trials, size):
            round_start = time.monotonic() - began  # rank 0's: the one that records it
            if rank == 0:
                for trial, ranks in groups:
                    log(f"trial {trial.number} spans ranks {list(ranks)}: global batch "
                        f"{trial.plan.global_batch} ({trial.plan.batch_per_rank} per rank), "
                        f"{config.steps_for(trial.plan.global_batch)} steps")
            mine = next(((i, g) for i, g in enumerate(groups) if rank in g[1]), None)
            sub = comm.Split(mine[0] if mine else mpi.UNDEFINED, rank)
            result = None
            if mine is not None:
                trial, ranks = mine[1]
                numbers = [t.number for t, _ in groups]

                def stopping(numbers: list[int] = numbers) -> None:  # rank 0's, at a stop
                    log(f"stopping: trial(s) {numbers}, which span ranks, end at their next "
                        "step with a checkpoint and go back to the study, where a re-run "
                        "resumes them")
                    given.update(numbers)
                    if on_stop is not None:
                        on_stop(numbers)

                # The group's communicator is not freed: mpi4jax keeps handles to
                # communicators it has seen, and a freed one would be invalid under a later
                # step.
                result = _run_stoppable(
                    functools.partial(_run_on_group, trial, space, task, config, sub,
                                      checkpoint_root, pool),
                    sub, trial.number, held, stopping if rank == 0 else None)
                _end_together(sub, trial, result, rank)
                result = _group_result(sub, result)
                if rank != ranks[0]:
                    result = None  # the group's first rank speaks for it
            gathered = comm.gather(result, root=0)
            if rank == 0:
                by_number = {r.number: r for r in gathered if r is not None}
                for trial, ranks in groups:
                    ended = by_number[trial.number]
                    if ended.state == "interrupted" or trial.number in given:  # a stop's:
                        continue  # given back (`on_stop`, or by the caller)
                    finished.append(SpanningRun(trial, ranks, ended, round_start))
                    if on_finished is not None:  # recorded, then said
                        on_finished(trial, ranks, ended)
                    value = ended.metrics.get(task.metric)
                    log(f"trial {trial.number} {ended.state} on ranks {list(ranks)} in "
                        f"{ended.wall_seconds:.1f} s"
                        + (f": {task.metric}={value:.4g}" if value is not None else "")
                        + (f" ({ended.reason})" if ended.reason else ""))
            # A stop of any rank (Ctrl-C or SIGTERM, as mpirun sends every rank) ends the
            # phase on every rank, once this round's trials have checkpointed and ended
            # together: SIGTERM's where any rank had one.
            kind = _STOP_KINDS.get(held.held() if held is not None else None, 0)
            kind = comm.allreduce(kind, op=mpi.MAX)
            if kind:
                break  # a rank's own stop is delivered as the hold ends (its handler raises)
    if kind:  # a rank that had none stops as the others did
        raise Terminated() if kind == _STOP_KINDS[int(signal.SIGTERM)] else KeyboardInterrupt()
    return finished


#: A held stop as the ranks reduce it (the largest wins: SIGTERM's word and exit status).
_STOP_KINDS: dict[int | None, int] = {None: 0, int(signal.SIGINT): 1, int(signal.SIGTERM): 2}


class _GroupStop(threading.Event):
    """A spanning trial's stop, as the trial's steps read it (`Lifecycle`'s ``stop``): set
    on a rank of its group once all of them agree (one reduction of each rank's own flag per
    step, on a communicator of their own, which the step's gradient reduction does not use),
    so every rank stops at the same step and none waits in a reduction another left."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        from scamp_jax.distributed.mpi import import_mpi4py

        self._lor = import_mpi4py().LOR
        self._comm = group.Dup()
        self.here = threading.Event()  # this rank's own stop

    def is_set(self) -> bool:
        if not super().is_set() and self._comm.allreduce(self.here.is_set(), op=self._lor):
            self.set()
        return super().is_set()

    def close(self) -> None:
        self._comm.Free()


def _run_stoppable(run: Callable[[threading.Event], RunResult], group: Any, number: int,
                   held: Any, stopping: Callable[[], None] | None) -> RunResult:
    """``run(stop)`` of this rank's part of trial ``number`` while the main thread waits
    (`scamp_jax._signals.interruptible`), so that a stop ``held`` holds (`stops_held`) reaches
    it as a single process's reaches its trials: the group's ranks stop together at their next
    step (`_GroupStop`), with a checkpoint, and the trial ends ``interrupted``; ``stopping``
    (rank 0's: say it, give the round's trials back) is called first, at the stop."""
    stop = _GroupStop(group)

    def tick() -> None:
        if held is not None and held.held() is not None and not stop.here.is_set():
            if stopping is not None:
                stopping()
            stop.here.set()

    result = interruptible(lambda: run(stop), name=f"spanning-trial-{number}", tick=tick)
    stop.close()  # not where a second Ctrl-C left the part running: the process ends at once
    return result


#: Seconds a rank whose part of a spanning trial ended other than complete (failed, out of
#: memory, interrupted) waits for the rest of its group before it ends the job: they may be
#: waiting for it in the step's gradient reduction, which nothing else can end.
END_TOGETHER_SECONDS = 60.0


def _end_together(sub: Any, trial: SpanningTrial, result: RunResult, rank: int) -> None:
    """Wait until every rank of the group has ended its part of ``trial``. A rank whose part
    ended other than complete waits `END_TOGETHER_SECONDS` at most: the others, still
    training, wait in the next step's reduction for a contribution that never comes, so it
    prints ``rank R failed: ...`` and aborts the job (``MPI_Abort``); running the same command
    again resumes the study, the trial from its last checkpoint."""
    if sub.Get_size() == 1:
        return
    arrived = sub.Ibarrier()
    if result.state == "complete":
        arrived.Wait()
        return
    deadline = time.monotonic() + END_TOGETHER_SECONDS
    while not arrived.Test():
        if time.monotonic() > deadline:
            print(f"rank {rank} failed: trial {trial.number}, which spans ranks, ended "
                  f"{result.state} on this rank ({result.reason or 'no reason given'}) while the "
                  "other ranks of its group train on, waiting for this rank in the step's "
                  "gradient reduction; ending the job (the same command resumes the study)",
                  file=sys.stderr, flush=True)
            sub.Abort(1)
        time.sleep(0.05)


def _group_result(sub: Any, result: RunResult) -> RunResult:
    """The result the group's first rank reports for it (collective over the group): its own,
    unless another rank's part ended other than complete after the last reduction (its final
    evaluation failed, say), whose state and reason it then takes."""
    if sub.Get_size() == 1:
        return result
    parts = sub.allgather((result.state, result.reason))
    if result.state != "complete":
        return result
    other = next(((i, state, reason) for i, (state, reason) in enumerate(parts)
                  if state != "complete"), None)
    if other is None:
        return result
    index, state, reason = other
    return replace(result, state=state,
                   reason=f"rank {index} of its group: {reason or 'no reason given'}")


def _run_on_group(trial: SpanningTrial, space: Any, task: Any, config: Any, sub: Any,
                  checkpoint_root: Path | None, pool: DevicePool,
                  stop: threading.Event | None = None) -> RunResult:
    index, parts = sub.Get_rank(), sub.Get_size()
    # Raises if the booking exceeds the usable budget (a plan made for another budget).
    pool.allocate(Placement(trial.number, (0,)),
                  TrialRequest(trial.number, 1, trial.plan.booked_bytes, arrival=0))
    try:
        return _run_booked(trial, space, task, config, sub, checkpoint_root, index, parts, stop)
    finally:
        pool.release(trial.number)


def _run_booked(trial: SpanningTrial, space: Any, task: Any, config: Any, sub: Any,
                checkpoint_root: Path | None, index: int, parts: int,
                stop: threading.Event | None = None) -> RunResult:
    from scamp_jax.distributed.data_parallel import mpi_mean

    plan = one_device_plan(space, trial.params, trial.plan.batch_per_rank, jax.local_devices()[0])
    # No intermediate evaluations (the ranks would each report); one rank writes checkpoints.
    schedule = replace(Schedule.of(config, trial.plan.global_batch, trial.plan.booked_bytes),
                       eval_every=0, save=index == 0)
    spec = RunSpec.of(MemberSpec.of(trial, config.seed, checkpoint_root), plan, schedule,
                      config.need_budget().memory_per_device, grad_reduce=mpi_mean(sub),
                      batch_share=(index, parts))
    return run_trial(spec, space, task, status=TrialStatus(trial.number, trial.params),
                     stop=stop)


_STATE = {"complete": "complete", "pruned": "pruned"}


def spanning_outcome(trial: SpanningTrial, ranks: tuple[int, ...], result: RunResult,
                     metric: str) -> TrialOutcome:
    """The study outcome of a spanning trial (its ``rank`` attribute lists every rank)."""
    state = _STATE.get(result.state, "failed")
    reason = result.reason
    if result.state == "oom":
        reason = f"{reason}; a spanning trial is not re-planned"
    attrs = {
        "devices": [0],
        "model_parallel": 1,
        "batch_size": trial.plan.global_batch,
        "batch_per_rank": trial.plan.batch_per_rank,
        "predicted_peak_bytes": trial.plan.booked_bytes,
        "booked_bytes": trial.plan.booked_bytes,  # recorded as every trial's (results.json)
        "measured_peak_bytes": result.measured_peak_bytes,
        "held_bytes": result.held_bytes,
        "steps": result.steps,
        "wall_seconds": round(result.wall_seconds, 3),
        "replans": 0,
        "resizes": 0,
        "rank": list(ranks),
        "final_loss": None if math.isnan(result.loss) else result.loss,
        "metrics": dict(result.metrics),
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "resumed_from": result.resumed_from,
        "spanned_ranks": len(ranks),
        **({TRACEBACK: result.traceback} if result.traceback else {}),
    }
    return TrialOutcome(trial.number, state,
                        value=result.metrics.get(metric) if state == "complete" else None,
                        reason=reason, attrs=attrs)
