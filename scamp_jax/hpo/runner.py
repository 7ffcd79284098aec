"""Run one placed trial on its own sub-mesh: build, compile, train, report, checkpoint, evaluate.

`run_trial` is called in a worker thread per trial; JAX dispatch is asynchronous and each trial
owns disjoint devices, so several trials train at once. The runner never decides where a trial
goes or how big its batch is: it executes the `Plan` it is given, as a group of width 1 in the
one trial lifecycle (`scamp_jax.hpo.lifecycle`), and reports back how it ended
(`scamp_jax.hpo.trial.RunResult`: ``complete``, ``pruned``, ``failed``, ``oom`` or
``interrupted``). This module holds what is particular to one trial: its `RunSpec`, the
compiled-step cache trials of one architecture share, the solo `SoloProgram` (the planner's
step, optionally reduced over MPI ranks, restored straight onto the plan's shardings) and
`load_model`.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from scamp_jax.hpo.checkpoint import TrialCheckpointer
from scamp_jax.hpo.lifecycle import (
    Lifecycle,
    MemberSpec,
    Schedule,
    abstract_batch,
    evaluate_model,
    share_bytes,
    stream,
)
from scamp_jax.hpo.program_key import (
    ProgramKey,
    evaluation_key,
    injected_keys,
    state_shapes,
)
from scamp_jax.hpo.trial import OPTIMIZER_KEYS, RunResult, TrialStatus
from scamp_jax.hpo.trial import TrialOutOfMemory as TrialOutOfMemory
from scamp_jax.hpo.trial import is_oom_error as is_oom_error
from scamp_jax.hpo.trial import trial_seed as trial_seed
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.evaluation import EvalCompiler
from scamp_jax.planning.initial_state import InitialStates, abstract_initial_state
from scamp_jax.planning.reuse import ExecutableCache, compile_lowered
from scamp_jax.planning.train_step import jit_train_step, split_model
from scamp_jax.space import SearchSpace, Task


@dataclass(frozen=True)
class RunSpec:
    """What to run: one configuration, its plan (already on its devices) and the training length.

    Attributes:
      number: the study's trial number.
      params: the configuration (architecture + optimizer hyperparameters).
      plan: the planner's `Plan`, remapped onto the devices the trial was placed on.
      steps: training steps in total (a resumed trial runs only the missing ones).
      memory_per_device: device budget in bytes (the plan's safety margin is held back from it).
      checkpoint_dir: the trial's checkpoint directory, or ``None`` to not checkpoint.
      checkpoint_every: steps between checkpoints (0: only at the end).
      checkpoint_min_seconds: least seconds of training between two checkpoints before the
        last (`scamp_jax.hpo.lifecycle.Schedule`; 0: every ``checkpoint_every`` steps).
      eval_every: steps between intermediate evaluations reported to the pruner (0: none).
      log_every: steps between loss read-backs (each one synchronises with the device).
      seed: seed of the parameter initialisation and of the data stream.
      grad_reduce: ``f(tree) -> tree`` applied to the gradients and the loss inside the jitted
        step (`scamp_jax.planning.train_step.make_train_step`), e.g. the mean over MPI ranks of a
        trial that spans ranks (`scamp_jax.distributed.data_parallel.mpi_mean`); None: no reduction.
      batch_share: ``(index, parts)``: this process trains on part ``index`` of ``parts`` equal
        contiguous parts of every global batch of ``plan.batch_size * parts`` samples (each
        rank of a spanning trial draws the same global stream), and draws its own random
        numbers in training (dropout, drop-path: `own_random_streams`); None: the whole batch.
      save_checkpoints: write checkpoints (a spanning trial's ranks all restore from the same
        directory, one of them writes it).
      booked_bytes: bytes per device the trial's placement reserved (its share of the device
        ledger, e.g. the plan's ``predicted_peak_bytes``); None: the usable part of
        ``memory_per_device`` (less the plan's safety margin). Training (step + prefetched
        batch) and evaluation (forward + optimizer state + prefetched batch) must fit in it.
      report_every: the step the pruner hears at the k-th intermediate evaluation is
        ``k * report_every`` (`scamp_jax.hpo.lifecycle.Schedule.report_every`); 0: the run's.
    """

    number: int
    params: Mapping[str, Any]
    plan: Any
    steps: int
    memory_per_device: int
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    seed: int = 0
    grad_reduce: Callable[[Any], Any] | None = None
    batch_share: tuple[int, int] | None = None
    save_checkpoints: bool = True
    booked_bytes: int | None = None
    report_every: int = 0
    evaluations_per_step: Fraction = Fraction(0)
    checkpoint_min_seconds: float = 0.0

    @classmethod
    def of(cls, member: MemberSpec, plan: Any, schedule: Schedule, memory_per_device: int,
           **extra: Any) -> RunSpec:
        """The spec of ``member`` trained on ``plan`` by ``schedule`` (its ``share_bytes`` is
        the booked share), with a device budget of ``memory_per_device`` bytes; ``extra``: the
        fields of a trial spanning MPI ranks (``grad_reduce``, ``batch_share``)."""
        return cls(number=member.number, params=member.params, plan=plan, steps=schedule.steps,
                   memory_per_device=memory_per_device, checkpoint_dir=member.checkpoint_dir,
                   checkpoint_every=schedule.checkpoint_every, eval_every=schedule.eval_every,
                   log_every=schedule.log_every, seed=member.seed,
                   save_checkpoints=schedule.save, booked_bytes=schedule.share_bytes,
                   report_every=schedule.report_every,
                   evaluations_per_step=schedule.evaluations_per_step,
                   checkpoint_min_seconds=schedule.checkpoint_min_seconds, **extra)

    def share_bytes(self) -> int:
        """The bytes per device this trial may hold (see ``booked_bytes``)."""
        return share_bytes(self.booked_bytes, self.memory_per_device, self.plan)

    def member(self) -> MemberSpec:
        """The trial as the lifecycle's one member."""
        return MemberSpec(self.number, self.params, self.seed, self.checkpoint_dir)

    def schedule(self) -> Schedule:
        """How long the run trains and what it does on the way (the lifecycle's schedule)."""
        return Schedule(self.steps, self.share_bytes(), self.checkpoint_every, self.eval_every,
                        self.log_every, save=self.save_checkpoints,
                        shared=self.batch_share is not None,
                        checkpoint_min_seconds=self.checkpoint_min_seconds,
                        report_every=self.report_every,
                        evaluations_per_step=self.evaluations_per_step)


#: AdamW's settings where a configuration leaves them out (optax's, with no weight decay).
ADAMW_DEFAULTS: dict[str, float] = {"learning_rate": 1e-3, "b1": 0.9, "b2": 0.999,
                                    "weight_decay": 0.0}


def make_optimizer(params: Mapping[str, Any]) -> optax.GradientTransformation:
    """AdamW with the hyperparameters ``params`` sets injected as data (so trials of one
    architecture share a compile) and the others constants, as ``optax.adamw`` has them.

    The values are placeholders here; the run's initial state writes the configuration's
    values into the optimizer state. Only what a configuration sets is injected: an injected
    ``b1`` or ``b2`` is a float32 array, so Adam's ``1 - b1`` and ``1 - b2`` are computed in
    float32 (``1 - float32(0.999)`` is 1.3e-5 off ``0.001``) where ``optax.adamw(lr)`` folds
    them from Python floats; with the constants a trial trains bit for bit as a plain
    ``optax.adamw(lr)`` loop from the trial's initial model does
    (`scamp_jax.planning.initial_state.initial_model`, ``tests/test_runner.py``).
    """
    return _adamw(injected_keys(params))


@functools.cache
def _adamw(injected: tuple[str, ...]) -> optax.GradientTransformation:
    # One object per set of injected keys (at most 2**3 of them): the planner's and a run's
    # optimizer are then the same object, which lets a run take the planner's jitted step.
    static = tuple(k for k in inspect.signature(optax.adamw).parameters if k not in injected)
    return optax.inject_hyperparams(optax.adamw, static_args=static)(**ADAMW_DEFAULTS)


def peak_bytes(compiled: Any) -> int | None:
    """Peak bytes per device of a compiled step: temp + arguments + outputs - aliased."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(
        analysis.temp_size_in_bytes
        + analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
    )


class StepCache:
    """Jitted training steps shared by trials with the same architecture, plan and devices.

    Trials of one architecture differ only in data (hyperparameters live in the optimizer
    state), so the second trial on the same devices reuses the first one's compiled step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[Any, tuple[Any, optax.GradientTransformation]] = {}
        self._evaluators: dict[Any, EvalCompiler] = {}
        #: compiled steps and traced initialisations, shared by trials of one architecture
        self.executables, self.initial_states = ExecutableCache(), InitialStates()
        self.hits = 0
        self.misses = 0

    def evaluator(self, graphdef: nnx.GraphDef, plan: Any, task: Any, params: Any,
                  rest: Any) -> EvalCompiler:
        """The evaluation forward of ``task`` on ``plan``'s mesh (compiles kept per chunk):
        the planner's (``plan.evaluator``) on its devices; on others, one that loads the
        planner's compiled chunks onto them (CPU) or compiles its own."""
        key = evaluation_key(graphdef, plan, task, (params, rest))
        devices = tuple(d.id for d in plan.mesh.devices.flat)
        with self._lock:
            ready = getattr(plan, "evaluator", None)
            if ready is not None and not ready.serves(task.eval_forward, ready.device_ids):
                ready = None  # another forward pass
            if key not in self._evaluators and ready is not None and ready.device_ids == devices:
                self._evaluators[key] = ready  # the planner's, with its compiled chunks
            if key not in self._evaluators:
                shardings = plan.step_shardings
                self._evaluators[key] = EvalCompiler(
                    graphdef, task.eval_forward, params, rest, shardings.params,
                    shardings.rest, plan.mesh, source=ready)
            return self._evaluators[key]

    def get(
        self, graphdef: nnx.GraphDef, plan: Any, loss_fn: Callable[..., Any], params: Any,
        grad_reduce: Callable[[Any], Any] | None = None,
        shapes: tuple[tuple[tuple[int, ...], str], ...] = (),
    ) -> tuple[Any, optax.GradientTransformation]:
        """``(jitted step, optimizer)`` for this architecture (``graphdef`` and its state's
        ``shapes``, `scamp_jax.hpo.program_key.state_shapes`), plan and gradient reduction,
        built once: the planner's own (``plan.step_source``) when it is the step this would
        build (its lowering at the trial's state is then JAX's cache hit), else a new one."""
        key = ProgramKey.of(graphdef, params, shapes).run_step(plan, loss_fn, grad_reduce)
        with self._lock:
            if key in self._steps:
                self.hits += 1
                return self._steps[key]
            self.misses += 1
            optimizer = make_optimizer(params)
            source = getattr(plan, "step_source", None)
            if grad_reduce is None and source is not None and source.serves(
                    graphdef, optimizer, loss_fn, plan.step_shardings):
                step = source.step  # the planner's: lowering it again traces nothing
            else:
                step = jit_train_step(graphdef, optimizer, loss_fn, plan.step_shardings,
                                      grad_reduce=grad_reduce)
            self._steps[key] = (step, optimizer)
            return step, optimizer


def _initial_state(
    space: SearchSpace, spec: RunSpec, optimizer: optax.GradientTransformation, seed: int,
    abstract: bool = False, states: InitialStates | None = None, architecture: Any = None,
) -> tuple[Any, Any, Any]:
    """Parameters, optimizer state and other state placed on the plan's devices
    (`scamp_jax.planning.initial_state`; ``states``: the initialisation programs shared by
    trials of one architecture, ``architecture`` its graphdef).

    ``abstract``: ``ShapeDtypeStruct``s carrying the plan's shardings instead (nothing is
    allocated), the restore target of a resumed trial.
    """
    hyper = {k: spec.params[k] for k in OPTIMIZER_KEYS if k in spec.params}

    def build(rngs: nnx.Rngs) -> nnx.Module:
        return space.model(spec.params, rngs)

    if abstract:
        return abstract_initial_state(build, optimizer, spec.plan.step_shardings, tuple(hyper))
    if architecture is None:
        with jax.set_mesh(spec.plan.mesh):
            architecture = split_model(nnx.eval_shape(lambda: build(nnx.Rngs(seed))))[0]
    states = states if states is not None else InitialStates()
    return states.make(ProgramKey.of(architecture, spec.params).architecture, build, optimizer,
                       spec.plan.step_shardings, seed, hyper)


def run_trial(
    spec: RunSpec,
    space: SearchSpace,
    task: Task,
    *,
    report: Callable[[int, int, float], bool] | None = None,
    status: TrialStatus | None = None,
    stop: threading.Event | None = None,
    cache: StepCache | None = None,
    on_loss: Callable[[int, int, float], None] | None = None,
    on_checkpoint: Callable[[int, int, float], None] | None = None,
) -> RunResult:
    """Train and evaluate one configuration on ``spec.plan``'s devices; never raises.

    A group of width 1 in the one trial lifecycle (`scamp_jax.hpo.lifecycle.Lifecycle`).

    Args:
      spec: what to run (configuration, plan on its devices, steps, checkpointing).
      space: the search space (``build`` makes the model).
      task: the data, loss and evaluation.
      report: ``report(number, step, value) -> prune?``, called after each intermediate
        evaluation with the task's metric.
      status: progress record updated in place for the live view.
      stop: set by the engine to stop the trial (it checkpoints and returns ``interrupted``).
      cache: compiled-step cache shared between trials.
      on_loss: ``on_loss(number, step, loss)`` at every loss read-back (``spec.log_every``),
        as for a fused group (`scamp_jax.hpo.fused_runner.run_fused_group`).
      on_checkpoint: ``on_checkpoint(number, step, seconds)`` after each checkpoint before
        the last, with the seconds the run has taken so far.

    Returns:
      A `RunResult`; every exception is turned into a ``failed`` or ``oom`` result.
    """
    program = SoloProgram(spec, space, task, cache or StepCache())
    status = status or TrialStatus(spec.number, spec.params)
    run = Lifecycle(program, [spec.member()], spec.schedule(), task, statuses=[status],
                    report=report, on_loss=on_loss, stop=stop, on_checkpoint=on_checkpoint)
    return run.run()[0]


class SoloProgram:
    """The `scamp_jax.hpo.lifecycle.Program` of one trial: the planner's step on the plan's
    devices (the planner's own executable when it is the same program), gradients optionally
    reduced over MPI ranks (``RunSpec.grad_reduce``), a restore straight onto the plan's
    shardings."""

    width = 1

    def __init__(self, spec: RunSpec, space: SearchSpace, task: Task, cache: StepCache) -> None:
        self.spec, self.space, self.task, self.cache = spec, space, task, cache
        self.plan = spec.plan
        # What a member trains on per step, as its checkpoints record it: a spanning trial's
        # global batch, of which this process trains one part.
        parts = 1 if spec.batch_share is None else spec.batch_share[1]
        self.batch_size = int(spec.plan.batch_size) * parts

    def prepare(self, members: Sequence[MemberSpec], first: int) -> None:
        spec, plan, seed = self.spec, self.plan, self.spec.seed
        with jax.set_mesh(plan.mesh):
            model = nnx.eval_shape(lambda: self.space.model(spec.params, nnx.Rngs(seed)))
        self.graphdef = split_model(model)[0]
        self.step_fn, self.optimizer = self.cache.get(self.graphdef, plan, self.task.loss_fn,
                                                      spec.params, spec.grad_reduce,
                                                      state_shapes(model))
        # Shapes and shardings only until `start`: the step compiles from them.
        self.state = _initial_state(self.space, spec, self.optimizer, seed, abstract=True)
        self.batches = stream(_batches(self.task, plan.batch_size, seed, spec.batch_share), first)
        self._next = next(self.batches)
        self.batch = abstract_batch(self._next, plan.batch_sharding)

    def start(self, members: Sequence[MemberSpec], first: int,
              checkpointers: Sequence[TrialCheckpointer | None]) -> None:
        spec, checkpointer = self.spec, checkpointers[0]
        if first and checkpointer is not None:
            # Resume: restore straight into this placement's shardings (the devices may differ
            # from before); the target is abstract, so the state exists once, never a fresh
            # copy too.
            target = self.state
            _, leaves = checkpointer.restore(jax.tree.leaves(target), first)
            self.state = jax.tree.unflatten(jax.tree.structure(target), leaves)
        else:
            self.state = _initial_state(self.space, spec, self.optimizer, spec.seed,
                                        states=self.cache.initial_states,
                                        architecture=self.graphdef)
        if spec.batch_share is not None:  # after a restore too: rank 0's keys are stored
            self.state = own_random_streams(self.state, spec.batch_share[0])
        self.batch = jax.device_put(self._next, self.plan.batch_sharding)
        del self._next

    def prefetch(self) -> None:
        self.batch = jax.device_put(next(self.batches), self.plan.batch_sharding)

    def take_failed(self) -> dict[int, BaseException]:
        return {}  # the stream's error ended the run where it was raised

    def compile(self) -> int | None:
        lowered = self.step_fn.lower(*self.state, self.batch)
        ready = getattr(self.plan, "compiled_step", None)
        if self.spec.grad_reduce is not None:
            # A cross-rank reduction is an ordered side effect (mpi4jax threads a token through
            # the step), which the ahead-of-time executable does not take: run through the jit
            # wrapper, sized by its own compile.
            self.compiled = self.step_fn
            return peak_bytes(compile_lowered(lowered))
        self.compiled = self.cache.executables.compiled(
            lowered, list(self.plan.mesh.devices.flat), ready)
        return peak_bytes(self.compiled)

    def prefetch_bytes(self) -> int:
        return sh.bytes_per_device(self.batch, self.plan.batch_sharding)

    def resident_bytes(self) -> int:
        return sh.bytes_per_device(self.state[1], self.plan.step_shardings.opt_state)

    def evaluator(self) -> EvalCompiler:
        params, _, rest = self.state
        return self.cache.evaluator(self.graphdef, self.plan, self.task, params, rest)

    def step(self, active: np.ndarray) -> Any:
        *state, loss = self.compiled(*self.state, self.batch)
        self.state = tuple(state)
        return loss

    def member(self, slot: int) -> tuple[Any, Any, Any]:
        return self.state

    def checkpoint_leaves(self, slot: int) -> list[Any]:
        return jax.tree.leaves(self.state)  # orbax reads the device arrays itself

    def reform(self, keep: np.ndarray) -> None:
        raise AssertionError("a run of one member never re-forms")  # it ends when that one does

    def evaluate_whole(self, slot: int, task: Task) -> Mapping[str, Any]:
        params, _, rest = self.state
        return evaluate_model(task, self.graphdef, params, rest, self.plan.mesh)


def own_random_streams(state: tuple[Any, Any, Any], index: int) -> tuple[Any, Any, Any]:
    """``(params, opt_state, rest)`` with the model's random keys (NNX's ``RngKey``s in
    ``rest``) folded with ``index``, the part of the global batch this process trains, so that
    the ranks of a spanning trial draw independent dropout and drop-path masks for their
    samples, as one process does for the whole batch, rather than each rank sample ``i`` the
    mask of rank 0's sample ``i``. Part 0 keeps its keys (a run in one process), and a key is
    fixed through a run (NNX counts the draws beside it), so folding the keys a resumed run
    restores (part 0's, the part that saves) gives each part the keys it trained with."""
    if index == 0:
        return state
    params, opt_state, rest = state

    def fold(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return jax.random.fold_in(x, index)
        return x

    return params, opt_state, jax.tree.map(fold, rest)


def _of_size(batch: Any, batch_size: int, seed: int,
             samples: Sequence[tuple[int, ...]] | None = None) -> Any:
    """``batch`` if every array of it holds ``batch_size`` samples on its leading axis, of the
    shapes ``samples`` (one sample's shape per array, the stream's first batch's; None: not
    checked), else a `ValueError`: a stream of other sizes would train other batches than the
    plan's (which the study books and reports), or run out of memory at a size it never
    planned; samples of another shape would meet a step compiled for the first batch's (JAX's
    error then speaks of argument types and x64 modes)."""
    leaves = jax.tree.leaves(batch)
    for i, leaf in enumerate(leaves):
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != batch_size:
            raise ValueError(
                f"task.batches({batch_size}, {seed}) yielded a batch whose array {i} has shape "
                f"{shape}; every array of a batch must hold the {batch_size} samples asked for "
                "on its leading axis (the plan's batch, which the study books and reports)")
        if samples is not None and i < len(samples) and shape[1:] != samples[i]:
            raise ValueError(
                f"task.batches({batch_size}, {seed}) yielded a batch whose array {i} has shape "
                f"{shape}, samples of shape {shape[1:]}; its first batch's had the shape "
                f"{samples[i]}, which the step was compiled for: every batch of a stream must "
                "hold samples of one shape")
    if samples is not None and len(leaves) != len(samples):
        raise ValueError(
            f"task.batches({batch_size}, {seed}) yielded a batch of {len(leaves)} arrays; its "
            f"first batch had {len(samples)}, which the step was compiled for")
    return batch


def _sample_shapes(batch: Any) -> list[tuple[int, ...]]:
    """One sample's shape per array of ``batch``."""
    return [tuple(getattr(leaf, "shape", ()))[1:] for leaf in jax.tree.leaves(batch)]


def _batches(task: Task, batch_size: int, seed: int,
             share: tuple[int, int] | None) -> Iterator[Any]:
    """The task's batch stream, or this process's contiguous part of a global stream; a stream
    that ends is an error that says so (a run draws as many batches as it trains steps, and
    more after a restart)."""
    drawn, samples = 0, None
    if share is None:
        for drawn, batch in enumerate(task.batches(batch_size, seed), 1):  # noqa: B007
            yield _of_size(batch, batch_size, seed, samples)
            samples = samples or _sample_shapes(batch)
    else:
        index, parts = share
        for drawn, batch in enumerate(task.batches(batch_size * parts, seed), 1):  # noqa: B007
            batch = _of_size(batch, batch_size * parts, seed, samples)
            samples = samples or _sample_shapes(batch)
            yield jax.tree.map(lambda x: x[index * batch_size : (index + 1) * batch_size], batch)
    raise ValueError(f"the task's batches({batch_size * (share[1] if share else 1)}, {seed}) "
                     f"ended after {drawn} batch(es); it must yield batches for as long as it "
                     "is asked (e.g. draw them in a `while True:` loop)")


def _stored_shapes(checkpointer: Any, item: Path) -> list[tuple[int, ...]] | None:
    """The shapes of the arrays a checkpoint item holds, in order, from its metadata (None
    where this orbax words its metadata otherwise: the restore then checks them itself)."""
    absl = logging.getLogger("absl")  # orbax warns of the step metadata a trial's item lacks
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        meta = checkpointer.metadata(item)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        arrays = jax.tree.leaves(tree, is_leaf=lambda a: hasattr(a, "shape"))
        return [tuple(a.shape) for a in arrays]
    except Exception:  # noqa: BLE001 - a check before the restore, never a new failure
        return None
    finally:
        absl.setLevel(level)


def _derived_again(space: SearchSpace, params: Mapping[str, Any],
                   drawn: Mapping[str, Any] | None) -> dict[str, Any]:
    """The configuration to build: ``space.suggest`` run again on Optuna's ``drawn``
    parameters where they are known (it makes the whole configuration from them, values the
    study could not store too); else ``params`` with the keys it lacks that ``suggest``
    derives from them (a stored value kept). ``params`` alone where ``suggest`` cannot take
    them (they name other parameters, or it prunes or refuses them)."""
    import warnings

    import optuna

    given = dict(params) if drawn is None else dict(drawn)
    try:
        with warnings.catch_warnings():  # a value outside a drawn range: stored, so kept
            warnings.simplefilter("ignore")
            derived = space.suggest(optuna.trial.FixedTrial(given))
    except Exception:  # noqa: BLE001 - a suggest of the user's (TrialPruned too)
        return dict(params)
    if not isinstance(derived, Mapping):
        return dict(params)
    return dict(derived) if drawn is not None else {**derived, **params}


def _drawn_beside(directory: Path, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``drawn`` of the ``trial.json`` in ``directory`` (a study's ``best_model/``) where
    its ``params`` are ``params`` (None: no such record)."""
    try:
        record = json.loads((directory / "trial.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("drawn"), dict):
        return None
    try:  # as the record holds them: JSON's values (a tuple as a list)
        same = record.get("params") == json.loads(json.dumps(dict(params), default=str))
    except (TypeError, ValueError):
        return None
    return record["drawn"] if same else None


def load_model(
    directory: str | Path, space: SearchSpace, params: Mapping[str, Any], seed: int = 0,
    *, drawn: Mapping[str, Any] | None = None,
) -> nnx.Module:
    """The trained model saved in a trial's checkpoint step directory (e.g. ``best_model/``).

    ``params`` is the trial's configuration (``best_model/trial.json`` holds it). The model is
    rebuilt from ``space`` and its parameters and other state are read back on the default
    device. Where ``suggest`` made the configuration from Optuna's draws otherwise than as
    drawn (a draw scaled, a function chosen by name, which the study cannot store: it stores
    what JSON holds), the configuration is made again by calling it on those draws
    (`optuna.trial.FixedTrial`): ``drawn``, a results row's, or the ``drawn`` of the
    ``trial.json`` beside the checkpoint where its ``params`` are these. Without them the keys
    ``params`` lacks are derived by calling it on ``params``; ``params`` it cannot take are
    built as given. It comes in
    evaluation mode, as the study scored it (``model.eval()``: dropout off, batch norm on its
    running averages); call ``model.train()`` to train it further. ``seed`` seeds the
    ``nnx.Rngs`` the model is built with (abstractly): every variable it holds, its random
    keys too, is read back from the checkpoint, so the seed changes nothing for a ``build``
    that keeps its randomness in the model's variables. A
    checkpoint whose data cannot be read (damaged) raises `CheckpointUnreadable`, which names
    it.
    """
    import orbax.checkpoint as ocp

    from scamp_jax.hpo.checkpoint import from_storable, read_or_say, to_storable

    if not isinstance(params, Mapping):
        raise TypeError(f"params={params!r} is not a trial's configuration; pass the dict "
                        "best_model/trial.json holds under 'params'")
    if isinstance(params.get("params"), Mapping) and "number" in params:
        raise ValueError("params is a whole trial record (it holds 'number' and 'params'); "
                         "pass its 'params': load_model(directory, space, record['params'])")
    directory = Path(directory).resolve()
    item = directory / "default"
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist; pass a study's best_model "
                                "directory (<study_dir>/best_model) or a checkpoint step "
                                "directory (<study_dir>/checkpoints/<key>/<step>)")
    if not item.is_dir():
        raise FileNotFoundError(
            f"{directory} is not a checkpoint step directory (no 'default' item); pass e.g. "
            "<study_dir>/best_model or <study_dir>/checkpoints/<key>/<step>"
        )
    if drawn is None:
        drawn = _drawn_beside(directory, params)
    params = _derived_again(space, params, drawn)
    # built abstract: every value is read from the checkpoint, so none is computed (a model
    # built for real costs a compile per initialiser, seconds for a SwinIR on CPU)
    model = nnx.eval_shape(lambda: space.model(params, nnx.Rngs(seed)))
    graphdef, weights, rest = split_model(model)
    on = jax.device_put(np.zeros((), np.float32)).sharding  # the default device
    like = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on) for x in jax.tree.leaves(
        (weights, jax.eval_shape(make_optimizer(params).init, weights), rest))]
    storable = to_storable(like)
    with ocp.StandardCheckpointer() as checkpointer:
        stored = _stored_shapes(checkpointer, item)
        built = [tuple(np.shape(x)) for x in jax.tree.leaves(storable)]
        # none read: its metadata is damaged too, which the restore says (not "0 arrays")
        if stored and stored != built:
            differ = next((i for i, (a, b) in enumerate(zip(stored, built, strict=False))
                           if a != b), min(len(stored), len(built)))
            found = (f"array {differ} is {stored[differ]} there, {built[differ]} here"
                     if differ < min(len(stored), len(built)) else
                     f"{len(stored)} arrays there, {len(built)} here")
            raise ValueError(
                f"the checkpoint in {directory} does not hold the model that space "
                f"{space.name!r} builds from params={dict(params)!r} ({found}); pass the params "
                "of the trial that saved it (best_model/trial.json holds them)")
        leaves = read_or_say(lambda: checkpointer.restore(item, storable), directory,
                             f"the model that space {space.name!r} builds")
    weights, _, rest = jax.tree.unflatten(
        jax.tree.structure((weights, jax.eval_shape(make_optimizer(params).init, weights),
                            rest)),
        from_storable(leaves, like),
    )
    model = nnx.merge(graphdef, weights, rest)
    model.eval()
    return model
