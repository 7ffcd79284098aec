"""One trial lifecycle: a solo trial is a group of width 1.

A run trains ``K`` members (one for a solo trial, ``K`` for a fused group,
`scamp_jax.hpo.fused_runner`) on one device set with one compiled step, and this module is the
one loop around that step for both. What differs is the `Program`: how the state is built or
restored, what one step is, how a member's state is read out. `scamp_jax.hpo.runner` holds the
solo program (the planner's step, optionally reduced over MPI ranks), `scamp_jax.hpo.fused_runner`
the fused one (the step vmapped over a member axis, with an ``active`` mask). The loop:

1. resume: each member's newest checkpoint of at most ``steps`` steps (a group resumes only
   members at the same step), the data streams advanced to it (in host memory);
2. the ledger check, before any of the run's arrays exist on its devices: the step and the
   evaluation forward are compiled (on a GPU that includes XLA's autotuning, whose buffers come
   from the same pool as the trials', so it runs while the pool is at its emptiest), and the
   step with the next batch prefetched beside it, and the evaluation forward at its chunk plus
   what stays resident (the optimizer state, for a group the whole stacked state, and the
   prefetched batch), must fit the run's booked share; otherwise the run ends ``oom`` with the
   measured bytes (`check_share`). Only then is the state made (or restored) on the devices and
   the first batch placed;
3. the step loop: stop (checkpoint, ``interrupted``), step, prefetch, loss read-back (a
   non-finite loss ends that member ``failed``), intermediate evaluation reported to the pruner
   (``pruned``), checkpoints every ``checkpoint_every`` steps (where ``checkpoint_min_seconds``
   of training have passed since the last one; ``on_checkpoint`` hears each member's, with the
   run's seconds so far, which the study stores with the trial); a stopped member is masked and,
   at the next evaluation, the group re-forms without it; after the first two steps the
   allocator's peak on the run's devices is measured (`scamp_jax.hpo.calibration.measure_peak`)
   and written to every member's status, where the search loop learns from it;
4. the end: one checkpoint of the last step (never written twice: a step on disk is kept; a
   group's members write theirs at once), the evaluation in chunks, the allocator's peak
   measured again, ``complete``.

Every exception ends the members still running through one mapping (`scamp_jax.hpo.trial.ending`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from scamp_jax.hpo.calibration import measure_peak
from scamp_jax.hpo.checkpoint import (
    CheckpointUnreadable,
    TrialCheckpointer,
    newest_step,
    saved_steps,
    set_aside,
    trains_from_start,
)
from scamp_jax.hpo.trial import (
    RunResult,
    TrialOutOfMemory,
    TrialStatus,
    ending,
    failure_traceback,
    trial_seed,
)
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.evaluation import (
    EvalCompiler,
    EvalPlan,
    abstract_eval_inputs,
    plan_eval,
    supports_chunked_eval,
)
from scamp_jax.space import Task

log = logging.getLogger(__name__)

PyTree = Any
#: ``(params, opt_state, rest)`` of one member.
MemberState = tuple[PyTree, PyTree, PyTree]


@dataclass(frozen=True)
class MemberSpec:
    """One trial of a run.

    Attributes:
      number: the study's trial number.
      params: the configuration; in a group, its architecture must match the group's.
      seed: seed of the member's parameter initialisation and data stream
        (`scamp_jax.hpo.trial.trial_seed` of its checkpoint key in a study).
      checkpoint_dir: the member's checkpoint directory, or ``None``.
    """

    number: int
    params: Mapping[str, Any]
    seed: int = 0
    checkpoint_dir: Path | None = None

    @classmethod
    def of(cls, trial: Any, seed: int, checkpoint_root: Path | None) -> MemberSpec:
        """The member a study's ``trial`` (its ``number``, ``params`` and ``checkpoint_key``)
        is in a run: its seed from the study's ``seed`` (`trial_seed`, which a re-run of an
        interrupted trial shares) and its checkpoint directory under ``checkpoint_root`` (None:
        no checkpoints). The one place a study's trial becomes a run's member."""
        key = trial.checkpoint_key
        return cls(trial.number, trial.params, trial_seed(seed, key),
                   checkpoint_root / key if checkpoint_root is not None else None)


@dataclass(frozen=True)
class Schedule:
    """How long a run trains and what it does on the way (steps and intervals, as `RunSpec`).

    ``share_bytes``: the bytes per device the run may hold (its booked share of the ledger).
    ``checkpoint_min_seconds``: a checkpoint due by ``checkpoint_every`` less than this many
    seconds after the run began training, or after its previous checkpoint, is not written
    (the last step's, and a stopped run's, always are).
    ``save``: write checkpoints (the ranks of a trial spanning MPI ranks all restore from one
    directory, one of them writes it). ``shared``: the checkpoints are read by other processes
    too (such a trial's parts): one that cannot be read fails the run on every part alike,
    rather than one part setting it aside under the others. ``reform``: re-form a group
    without its stopped members at the next evaluation (one compile per new width) instead of
    only masking them.
    """

    steps: int
    share_bytes: int
    checkpoint_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    save: bool = True
    shared: bool = False
    reform: bool = True
    checkpoint_min_seconds: float = 0.0
    #: with a reference batch: the k-th evaluation comes at the first step that has trained
    #: ``k`` evaluation intervals' samples at the reference batch (``evaluations_per_step``:
    #: the run's batch over those samples), and the pruner hears it as step
    #: ``k * report_every`` (the study's ``eval_every``), so trials of any batch are compared
    #: after as many samples; 0: every ``eval_every`` steps, heard as the run's own step
    report_every: int = 0
    evaluations_per_step: Fraction = Fraction(0)

    @classmethod
    def of(cls, config: Any, batch_size: int, share_bytes: int) -> Schedule:
        """A study's run at a global batch of ``batch_size`` that may hold ``share_bytes`` per
        device: its steps (`scamp_jax.hpo.settings.EngineConfig.steps_for`) and intervals
        (`scamp_jax.hpo.settings.EngineConfig.interval_for`) from ``config``, the study's
        `EngineConfig`. The one place a run's schedule is read from the study's
        configuration."""
        batch = int(batch_size)
        scaled = config.reference_batch is not None and config.eval_every > 0
        return cls(config.steps_for(batch), int(share_bytes),
                   config.interval_for(config.checkpoint_every, batch),
                   config.interval_for(config.eval_every, batch), config.log_every,
                   checkpoint_min_seconds=config.checkpoint_min_seconds,
                   report_every=config.eval_every if scaled else 0,
                   evaluations_per_step=(Fraction(batch, config.eval_every
                                                  * config.reference_batch)
                                         if scaled else Fraction(0)))

    def evaluations_by(self, done: int) -> int:
        """Intermediate evaluations due after ``done`` steps of this run (none where
        ``eval_every`` is 0: evaluations off)."""
        if not self.eval_every:
            return 0
        if self.evaluations_per_step:
            return math.floor(done * self.evaluations_per_step)
        return done // self.eval_every

    def evaluates_at(self, done: int) -> bool:
        """Whether an intermediate evaluation comes after ``done`` steps (never at the last:
        the final evaluation scores it)."""
        return 0 < done < self.steps and self.evaluations_by(done) > self.evaluations_by(done - 1)

    def reported_step(self, done: int) -> int:
        """The step the pruner hears for an evaluation after ``done`` steps of this run."""
        if not self.evaluations_per_step:
            return done
        return self.evaluations_by(done) * self.report_every


class Program(Protocol):
    """What the lifecycle needs of a solo or a fused training step on a run's devices.

    ``plan`` is a member's plan (mesh, shardings, optional ``eval_chunk``); ``batch_size`` the
    samples a member trains on per step (what its checkpoints record); ``width`` the members
    in the state now (slots, in order).
    """

    plan: Any
    batch_size: int
    width: int

    def prepare(self, members: Sequence[MemberSpec], first: int) -> None:
        """Everything but the arrays: the step to compile, the state's and the batch's shapes
        and shardings, every member's data stream advanced to step ``first`` with its next batch
        in host memory. Nothing is placed on the devices."""

    def start(self, members: Sequence[MemberSpec], first: int,
              checkpointers: Sequence[TrialCheckpointer | None]) -> None:
        """Make the state on the devices (or restore it at step ``first``) and place the batch
        `prepare` drew."""

    def compile(self) -> int | None:
        """Compile the step for the current width (from the shapes alone before `start`); its
        peak per device (None: unknown)."""

    def prefetch_bytes(self) -> int:
        """Bytes per device of the prefetched batch (known after `prepare`)."""

    def resident_bytes(self) -> int:
        """Bytes per device that stay resident beside the evaluation forward (it holds a
        member's parameters and other state itself)."""

    def evaluator(self) -> EvalCompiler:
        """The evaluation forward of one member on the run's mesh."""

    def step(self, active: np.ndarray) -> Any:
        """One training step of every slot (``active`` masks stopped ones); the losses, one
        per slot (a scalar at width 1)."""

    def prefetch(self) -> None:
        """Put the next batch on the devices."""

    def take_failed(self) -> Mapping[int, BaseException]:
        """The slots whose data stream failed since the last call (`prepare` and `prefetch`
        draw), each with its error, once: those members end ``failed`` as their solo runs
        would, the others train on. A program of one member raises its stream's error
        instead (the run ends)."""

    def member(self, slot: int) -> MemberState:
        """Slot ``slot``'s state, on the plan's shardings."""

    def checkpoint_leaves(self, slot: int) -> list[Any]:
        """Slot ``slot``'s state leaves to checkpoint: a solo run's device arrays; a group's
        read out of its stacked state into host memory, so the devices never hold a second
        copy of any member for a save."""

    def reform(self, keep: np.ndarray) -> None:
        """Keep only the slots ``keep`` (state, streams and pending batch)."""

    def evaluate_whole(self, slot: int, task: Task) -> Mapping[str, Any]:
        """The task's own ``evaluate`` of slot ``slot``'s model (tasks without chunks)."""


def evaluate_model(task: Task, graphdef: Any, params: Any, rest: Any, mesh: Any
                   ) -> Mapping[str, Any]:
    """The task's own ``evaluate`` of the model of ``params`` and ``rest`` on ``mesh``, in
    evaluation mode (``model.eval()``: dropout off, batch norm on its running averages), as
    the planned forward runs it, on a copy: what ``evaluate`` sets on it (a mode, a variable)
    never reaches the state training goes on from."""
    from flax import nnx

    with jax.set_mesh(mesh):
        model = nnx.merge(graphdef, params, rest, copy=True)
        model.eval()
        return task.evaluate(model)


def share_bytes(booked_bytes: int | None, memory_per_device: int, plan: Any) -> int:
    """The bytes per device a run may hold: ``booked_bytes`` (its share of the ledger), else
    the usable part of ``memory_per_device`` with ``plan``'s safety margin."""
    if booked_bytes is not None:
        return int(booked_bytes)
    margin = float(getattr(plan, "safety_margin", 0.0))
    return Budget(int(memory_per_device), margin).usable_bytes


def abstract_batch(batch: PyTree, sharding: Any) -> PyTree:
    """``jax.ShapeDtypeStruct``s of host ``batch`` as `jax.device_put` will place it with
    ``sharding`` (one for every leaf, or a tree of them): what a step compiles from before the
    batch is on the devices."""
    def spec(x: Any, s: Any) -> jax.ShapeDtypeStruct:
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype), sharding=s)

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: spec(x, sharding), batch)
    return jax.tree.map(spec, batch, sharding)


def resumable_step(checkpointer: TrialCheckpointer, steps: int) -> int | None:
    """Newest checkpointed step of at most ``steps`` (None: none;
    `scamp_jax.hpo.checkpoint.newest_step`)."""
    latest = checkpointer.latest_step()
    if latest is None or latest <= steps:
        return latest
    return newest_step(checkpointer.directory, steps)


def checked_scores(metrics: Any, where: str, metric: str) -> dict[str, float]:
    """``metrics`` (what ``where``, e.g. ``task.evaluate``, returned) as ``{name: float}``;
    ``TypeError`` or ``KeyError`` saying what it must return where it is no dict of numbers
    holding ``metric``. One rule for a trial's scores and the best model's test."""
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"{where} returned {type(metrics).__name__} {metrics!r}; it must return a dict "
            f"of scores that holds the study metric, e.g. {{{metric!r}: value}}")
    if metric not in metrics:
        raise KeyError(f"{where} returned {sorted(metrics)} without the study metric {metric!r}")
    scores = {}
    for key, value in metrics.items():
        try:
            array = np.asarray(value)
            scores[key] = float(array.reshape(()) if array.size == 1 else array)
        except (TypeError, ValueError):
            raise TypeError(f"{where} returned {key!r}: {value!r}; every score must be one "
                            "number (a float, or an array of one element)") from None
    return scores


def check_share(share: int, step_peak: int | None, prefetch: int, task: Task,
                evaluator: Callable[[], EvalCompiler], resident: int, plan: Any,
                ) -> tuple[EvalPlan | None, int | None]:
    """Raise `TrialOutOfMemory` (with the measured bytes) if a run exceeds ``share`` bytes.

    Training holds the compiled step's peak plus the prefetched next batch; evaluation holds
    the compiled forward at its chunk plus ``resident`` (what stays on the device) and that
    batch. The chunk is the plan's (``Plan.eval_chunk``) when it has one, else chosen here
    (`plan_eval`). Returns the evaluation's chunk (None for a task that evaluates itself) and
    the most the run holds per device (None: unknown).
    """
    train = None if step_peak is None else step_peak + prefetch
    chosen = None
    if supports_chunked_eval(task):
        groups = abstract_eval_inputs(task)
        assert groups is not None  # None only for a task without chunked evaluation
        forward = evaluator()
        chunk = int(getattr(plan, "eval_chunk", 0) or 0)
        if chunk:
            chosen = EvalPlan(chunk, forward.peak(chunk, groups), resident + prefetch)
        else:
            chosen = plan_eval(forward, groups, resident + prefetch, train or share)
        if chosen.total_bytes > share:
            raise TrialOutOfMemory(
                f"evaluation needs {chosen.total_bytes} bytes per device (forward at chunk "
                f"{chosen.chunk}: {chosen.peak_bytes}, state and prefetched batch: "
                f"{chosen.resident_bytes}), the run's share is {share}",
                bytes_needed=max(chosen.total_bytes, train or 0),
            )
    if train is not None and train > share:
        raise TrialOutOfMemory(
            f"compiled step needs {step_peak} bytes per device plus {prefetch} for the "
            f"prefetched batch, the run's share is {share}",
            bytes_needed=max(train, chosen.total_bytes if chosen else 0),
        )
    held = [b for b in (train, chosen.total_bytes if chosen else None) if b is not None]
    return chosen, max(held) if held else None


class _Member:
    """Mutable bookkeeping of one member while the run goes."""

    def __init__(self, spec: MemberSpec, status: TrialStatus) -> None:
        self.spec = spec
        self.status = status
        self.result: RunResult | None = None
        self.losses: list[tuple[int, float]] = []
        self.checkpointer: TrialCheckpointer | None = None


class Lifecycle:
    """The one loop of a run (see the module doc); `run` returns one `RunResult` per member."""

    def __init__(self, program: Program, members: Sequence[MemberSpec], schedule: Schedule,
                 task: Task, *, statuses: Sequence[TrialStatus] | None = None,
                 report: Callable[[int, int, float], bool] | None = None,
                 on_loss: Callable[[int, int, float], None] | None = None,
                 stop: threading.Event | None = None,
                 on_checkpoint: Callable[[int, int, float], None] | None = None) -> None:
        if not members:
            raise ValueError("a run needs at least one member")
        if statuses is not None and len(statuses) != len(members):
            raise ValueError(f"{len(statuses)} statuses given for {len(members)} members")
        self.program, self.schedule, self.task = program, schedule, task
        self.report, self.on_loss, self.stop = report, on_loss, stop
        self.on_checkpoint = on_checkpoint
        self.members = [_Member(m, statuses[i] if statuses is not None
                                else TrialStatus(m.number, m.params))
                        for i, m in enumerate(members)]
        self.slots = list(self.members)  # the members in the program's state, in order
        self.first = 0
        self.held_bytes: int | None = None
        self.measured_bytes: int | None = None
        self.compile_seconds = 0.0
        self._set_aside = False  # a checkpoint of this run's members was set aside (`_start`)
        self.widths: list[int] = []
        self.evaluation: EvalPlan | None = None
        self.start = time.monotonic()

    # ---- endings

    def _end(self, m: _Member, state: str, reason: str = "",
             metrics: Mapping[str, float] | None = None, checkpoint: Path | None = None,
             bytes_needed: int | None = None, traceback: str = "") -> None:
        if m.result is not None:
            return
        m.status.state = state
        if reason:
            m.status.reason = reason
        m.status.traceback = traceback
        m.result = RunResult(m.spec.number, state, m.status.step, time.monotonic() - self.start,
                             metrics=dict(metrics or {}), reason=reason, traceback=traceback,
                             bytes_needed=bytes_needed, loss=m.status.loss,
                             checkpoint=checkpoint, resumed_from=self.first,
                             held_bytes=self.held_bytes, measured_peak_bytes=self.measured_bytes)

    def _fail(self, m: _Member, err: BaseException) -> None:
        state, reason, needed = ending(err)
        # a raised error keeps its traceback; one made here (a non-finite loss or metric) is
        # the configuration's own, with none (`scamp_jax.hpo.failures` holds it apart)
        raised = state == "failed" and err.__traceback__ is not None
        self._end(m, state, reason, bytes_needed=needed,
                  traceback=failure_traceback(err) if raised else "")

    # ---- the run

    def run(self) -> list[RunResult]:
        """Train, evaluate and end every member; never raises."""
        for m in self.members:
            m.status.state, m.status.steps = "compiling", self.schedule.steps
        try:
            self._run()
        except Exception as err:  # noqa: BLE001 - one run's failure must not stop the study
            for m in self.members:
                self._fail(m, err)
        finally:
            for m in self.members:
                if m.checkpointer is not None:
                    m.checkpointer.close()  # waits for the last save; the next run opens its own
        for m in self.members:  # none expected: every path ends every member
            self._end(m, "failed", "the run ended before this member did")
        return [m.result for m in self.members if m.result is not None]

    def _resume(self) -> int:
        steps = {}
        batch = int(self.program.batch_size)
        for m in self.members:
            if m.spec.checkpoint_dir is not None:
                m.checkpointer = TrialCheckpointer(m.spec.checkpoint_dir)
                steps[m.spec.number] = resumable_step(m.checkpointer, self.schedule.steps)
                kept = m.checkpointer.batch_size()
                if steps[m.spec.number] is not None and trains_from_start(kept, batch):
                    trained = (f"were trained at batch {kept}" if kept is not None else
                               f"do not record the batch they were trained at (no "
                               f"{TrialCheckpointer.BATCH_FILE})")
                    log.warning("trial %d: its checkpoints %s and this run's batch is %d; it "
                                "trains from the start", m.spec.number, trained, batch)
                    steps[m.spec.number] = None
                    if self.schedule.save:
                        m.checkpointer.discard()
                if self.schedule.save:
                    m.checkpointer.record_batch(batch)
            else:
                steps[m.spec.number] = None
        # A step-0 checkpoint (a run stopped before its first step) holds the initial state,
        # which a member without one builds alike: both start at step 0.
        found = {step or 0 for step in steps.values()}
        if len(found) != 1 and self._set_aside:
            # one member's newest checkpoint was set aside (unreadable): the group resumes
            # from the newest step every member keeps (each keeps its last two), or the start
            held = [saved_steps(m.checkpointer.directory, self.schedule.steps)
                    if m.checkpointer is not None and steps[m.spec.number] else {0}
                    for m in self.members]
            common = max(set.intersection(*held) | {0})
            log.warning("group of trials %s resumes from step %d, the newest step every "
                        "member has a checkpoint of", sorted(steps), common)
            return common
        if len(found) != 1:
            raise ValueError(
                f"group members have checkpoints at different steps {steps}; a group resumes "
                "only members at the same step: run the others in their own groups")
        return found.pop()

    def _compile(self) -> int | None:
        t0 = time.monotonic()
        peak = self.program.compile()
        self.compile_seconds += time.monotonic() - t0
        if not self.widths or self.widths[-1] != self.program.width:  # a start or a re-form,
            self.widths.append(self.program.width)  # not a start tried again
        return peak

    def _check(self) -> None:
        program, schedule = self.program, self.schedule
        peak = self._compile()
        self.evaluation, self.held_bytes = check_share(
            schedule.share_bytes, peak, program.prefetch_bytes(), self.task, program.evaluator,
            program.resident_bytes(), program.plan)

    def _start(self) -> int:
        """Resume, prepare, check and start the run; the step it starts at. A checkpoint that
        cannot be read is set aside (`set_aside`, with a warning) and the run starts again
        from the next older one, or from the start: a damaged file costs the steps since the
        checkpoint before it, never the trial. The parts of a trial spanning MPI ranks
        (``schedule.shared``) fail alike instead: each reads the same checkpoint, and one
        part moving it would pull it from under the others."""
        program, schedule = self.program, self.schedule
        specs = [m.spec for m in self.members]
        while True:
            self.first = first = self._resume()
            program.prepare(specs, first)
            self._check()  # compiled (and autotuned) before the run's arrays exist
            try:
                program.start(specs, first, [m.checkpointer for m in self.members])
                return first
            except CheckpointUnreadable as err:
                if not schedule.save or schedule.shared:
                    raise
                for m in self.members:
                    if m.checkpointer is not None:
                        m.checkpointer.close()
                aside = set_aside(err.directory, err.step)
                self._set_aside = True
                number = next((m.spec.number for m in self.members
                               if m.spec.checkpoint_dir is not None
                               and Path(m.spec.checkpoint_dir).resolve() == err.directory),
                              self.members[0].spec.number)
                log.warning("trial %d: %s; it is set aside in %s and the trial resumes from "
                            "an older checkpoint, or from the start", number, err, aside)

    def _run(self) -> None:
        program, schedule = self.program, self.schedule
        first = self._start()
        now = time.monotonic()
        for m in self.members:  # the pace fields first: the engine reads them once it trains
            m.status.training_since, m.status.first_step = now, first
            m.status.state, m.status.step = "training", first
        active = np.ones(program.width, bool)
        self._data_failed(active)
        aside = 0.0  # seconds of the loop spent on checkpoints and intermediate evaluations
        saved = now  # when the run began training, or last wrote a checkpoint
        for step in range(first, schedule.steps):
            if self.stop is not None and self.stop.is_set():
                self._save(step)
                for m in self.slots:
                    self._end(m, "interrupted", f"stopped at step {step}")
                return
            losses = program.step(active)
            done = step + 1
            if done < schedule.steps:
                program.prefetch()
                self._data_failed(active)
            if done % schedule.log_every == 0 or done == schedule.steps:
                self._read_losses(losses, done, active)
            for slot, m in enumerate(self.slots):
                if active[slot]:
                    m.status.step = done
            if done == min(first + 2, schedule.steps):
                self._measure(losses)
            if schedule.evaluates_at(done):
                began = _after(losses)
                self._intermediate(done, active)
                aside += time.monotonic() - began
                if active.any() and not active.all() and schedule.reform:
                    keep = np.flatnonzero(active)
                    program.reform(keep)
                    self.slots = [self.slots[i] for i in keep]
                    active = np.ones(program.width, bool)
                    self._check()  # the narrower step, checked as the first
            if not active.any():
                return
            if (schedule.checkpoint_every and done % schedule.checkpoint_every == 0
                    and done < schedule.steps
                    and time.monotonic() - saved >= schedule.checkpoint_min_seconds):
                began = _after(losses)
                written = self._save(done, active)
                saved = time.monotonic()
                if self.on_checkpoint is not None:
                    for m in written:
                        self.on_checkpoint(m.spec.number, done, saved - self.start)
                aside += time.monotonic() - began  # the study's writes too
        if first < schedule.steps:
            # the steps' own seconds (losses read back), not the checkpoints' or evaluations'
            seconds = (time.monotonic() - now - aside) / (schedule.steps - first)
            for slot, m in enumerate(self.slots):
                if active[slot]:  # trained all its steps (not a member that failed)
                    m.status.step_seconds = seconds
            self._save(schedule.steps, active)
        self._finish(active)

    def _data_failed(self, active: np.ndarray) -> None:
        """End the members whose data stream failed (`Program.take_failed`); their slots stay
        in the step, masked, until the group re-forms."""
        for slot, err in self.program.take_failed().items():
            if active[slot]:
                active[slot] = False
                self._fail(self.slots[slot], err)

    def _measure(self, ready: Any = None) -> None:
        """The allocator's peak on the run's devices, into every member's status (None: the
        devices report nothing); ``ready``: arrays to wait for first (the last step's)."""
        if ready is not None:
            np.asarray(ready)  # the steps so far have run
        peak = measure_peak(list(self.program.plan.mesh.devices.flat))
        if peak is None:
            return
        self.measured_bytes = max(peak, self.measured_bytes or 0)
        for m in self.members:
            m.status.measured_peak_bytes = self.measured_bytes

    def _save(self, step: int, active: np.ndarray | None = None) -> list[_Member]:
        """Checkpoint the running members (all, or the ``active`` slots') at ``step``;
        returns the members saved."""
        if not self.schedule.save:
            return []
        slots = [(slot, m) for slot, m in enumerate(self.slots)
                 if (m.result is None and m.checkpointer is not None
                     and (active is None or active[slot]))]
        saves = [(m.checkpointer, self.program.checkpoint_leaves(slot)) for slot, m in slots]
        if len(saves) == 1:
            checkpointer, leaves = saves[0]
            checkpointer.save(step, leaves)  # type: ignore[union-attr]
        elif saves:
            # A group's members save to their own directories at once: an orbax save is
            # mostly waiting (six small members: 0.2 s together, 0.6 s one after another).
            with ThreadPoolExecutor(len(saves), thread_name_prefix="trial-save") as pool:
                for done in [pool.submit(c.save, step, leaves)  # type: ignore[union-attr]
                             for c, leaves in saves]:
                    done.result()
        return [m for _, m in slots]

    def _read_losses(self, losses: Any, done: int, active: np.ndarray) -> None:
        values = np.asarray(losses).reshape(-1)
        for slot, m in enumerate(self.slots):
            if not active[slot]:
                continue
            loss = float(values[slot])
            m.status.loss = loss
            m.losses.append((done, loss))
            if self.on_loss is not None:
                self.on_loss(m.spec.number, done, loss)
            if not math.isfinite(loss):
                active[slot] = False
                m.status.step = done
                self._fail(m, FloatingPointError(f"loss is {loss} at step {done}"))

    def _evaluate(self, slot: int) -> dict[str, float]:
        """The task's scores of slot ``slot``: the planned forward in chunks on the run's
        devices, or the task's own ``evaluate`` for a task without chunks."""
        task = self.task
        metrics: Mapping[str, Any]
        if self.evaluation is not None:
            assert supports_chunked_eval(task)  # only such a task's evaluation is planned
            params, _, rest = self.program.member(slot)
            outputs = self.program.evaluator().run(self.evaluation.chunk, params, rest,
                                                   task.eval_inputs())
            metrics = task.score(outputs)
        else:
            metrics = self.program.evaluate_whole(slot, task)
        where = "task.score" if self.evaluation is not None else "task.evaluate"
        return checked_scores(metrics, where, task.metric)

    def _intermediate(self, done: int, active: np.ndarray) -> None:
        metric = self.task.metric
        for slot, m in enumerate(self.slots):
            if not active[slot]:
                continue
            try:
                value = self._evaluate(slot)[metric]
            except Exception as err:  # noqa: BLE001 - one member's failure ends that member
                active[slot] = False
                self._fail(m, err)
                continue
            if not math.isfinite(value):  # diverged between loss read-backs: failed, as at the end
                active[slot] = False
                self._fail(m, FloatingPointError(f"{metric} is {value} at step {done}"))
                continue
            m.status.metric, m.status.metric_step = value, done
            reported = self.schedule.reported_step(done)
            if self.report is not None and self.report(m.spec.number, reported, value):
                active[slot] = False
                self._end(m, "pruned", f"pruned at step {done} ({metric}={value:.4g})",
                          metrics={metric: value})

    def _finish(self, active: np.ndarray) -> None:
        metric = self.task.metric
        evaluated: dict[int, dict[str, float]] = {}
        for slot, m in enumerate(self.slots):
            if not active[slot]:
                continue
            try:
                m.status.state = "evaluating"
                evaluated[slot] = self._evaluate(slot)
            except Exception as err:  # noqa: BLE001 - one member's failure ends that member
                self._fail(m, err)
        self._measure()  # evaluation included
        for slot, metrics in evaluated.items():
            m = self.slots[slot]
            try:
                finite = math.isfinite(metrics[metric])
            except Exception as err:  # noqa: BLE001 - one member's failure ends that member
                self._fail(m, err)  # no such metric, or not a number: the task's error
                continue
            if not finite:
                self._fail(m, FloatingPointError(f"{metric} is {metrics[metric]} after training"))
                continue
            m.status.metric, m.status.metric_step = metrics[metric], self.schedule.steps
            self._end(m, "complete", metrics=metrics, checkpoint=self._final(m))

    def _final(self, m: _Member) -> Path | None:
        """The directory of ``m``'s checkpoint of its last step (None: checkpoints are off)."""
        if m.checkpointer is None or not self.schedule.save:
            return None
        return m.checkpointer.step_directory(self.schedule.steps)


def stream(batches: Iterator[Any], skip: int) -> Iterator[Any]:
    """``batches`` advanced by ``skip`` (the stream an uninterrupted run would be at), at its
    first draw: a stream that fails on the way fails where a member's draws fail (a fused
    group's member alone, `scamp_jax.hpo.member_streams`)."""
    def advanced() -> Iterator[Any]:
        for _ in range(skip):
            next(batches)
        yield from batches

    return advanced()


def _after(steps: Any) -> float:
    """The time once ``steps`` (the last step's losses) have run: what a checkpoint or an
    evaluation takes from then is theirs, not the steps' they would wait for."""
    jax.block_until_ready(steps)
    return time.monotonic()
