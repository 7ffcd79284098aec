"""Run one placed trial on its own sub-mesh: build, compile, train, report, checkpoint, evaluate.

`run_trial` is called in a worker thread per trial; JAX dispatch is asynchronous and each trial
owns disjoint devices, so several trials train at once. The runner never decides where a trial
goes or how big its batch is: it executes the `Plan` it is given and reports back how it ended:

- ``complete``: trained for all steps and evaluated;
- ``pruned``: the study's pruner stopped it after an intermediate evaluation;
- ``failed``: it raised (a bug in a candidate, a NaN loss); the reason is kept, others go on;
- ``oom``: it did not fit, either because what it holds per device exceeds its booked share
  (checked from ``memory_analysis()`` before the first step: the compiled step plus the
  prefetched next batch, and the evaluation forward plus optimizer state plus that batch) or
  because XLA ran out of memory; the engine re-plans it with more devices or a smaller batch;
- ``interrupted``: the engine asked it to stop (Ctrl-C, or to restart it on more devices); it
  saved a checkpoint first.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from scamp_jax.hpo.checkpoint import TrialCheckpointer
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.evaluation import (
    EvalCompiler,
    EvalPlan,
    abstract_eval_inputs,
    plan_eval,
    supports_chunked_eval,
)
from scamp_jax.planning.reuse import ExecutableCache, InitialStates
from scamp_jax.planning.train_step import jit_train_step, split_model
from scamp_jax.space import SearchSpace, Task

#: keys of a configuration that are optimizer hyperparameters, not architecture.
OPTIMIZER_KEYS = ("learning_rate", "weight_decay", "b1", "b2")
_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OOM when allocating")


class TrialOutOfMemory(RuntimeError):
    """A trial's step does not fit its devices; carries the bytes per device it needs."""

    def __init__(self, message: str, bytes_needed: int | None = None) -> None:
        super().__init__(message)
        self.bytes_needed = bytes_needed


class TrialInterrupted(RuntimeError):
    """The engine asked the trial to stop (its state was checkpointed)."""


@dataclass
class TrialStatus:
    """Live, mutable progress of one trial (read by the live view; written by its runner)."""

    number: int
    params: Mapping[str, Any]
    state: str = "queued"
    devices: tuple[int, ...] = ()
    model_parallel: int = 1
    batch_size: int = 0
    predicted_peak_bytes: int = 0
    step: int = 0
    steps: int = 0
    loss: float = math.nan
    metric: float = math.nan
    replans: int = 0
    reason: str = ""
    #: ``time.monotonic()`` when this run's first training step began (after compile, restore),
    #: and the step it began at: the engine's measure of the trial's pace.
    training_since: float = math.nan
    first_step: int = 0
    #: times the engine restarted the trial on more devices (`scamp_jax.scheduling.elastic`).
    resizes: int = 0


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
      eval_every: steps between intermediate evaluations reported to the pruner (0: none).
      log_every: steps between loss read-backs (each one synchronises with the device).
      seed: seed of the parameter initialisation and of the data stream.
      grad_reduce: ``f(tree) -> tree`` applied to the gradients and the loss inside the jitted
        step (`scamp_jax.planning.train_step.make_train_step`), e.g. the mean over MPI ranks of a
        trial that spans ranks (`scamp_jax.distributed.data_parallel.mpi_mean`); None: no reduction.
      batch_share: ``(index, parts)``: this process trains on part ``index`` of ``parts`` equal
        contiguous parts of every global batch of ``plan.batch_size * parts`` samples (each
        rank of a spanning trial draws the same global stream); None: the whole batch.
      save_checkpoints: write checkpoints (a spanning trial's ranks all restore from the same
        directory, one of them writes it).
      booked_bytes: bytes per device the trial's placement reserved (its share of the device
        ledger, e.g. the plan's ``predicted_peak_bytes``); None: the usable part of
        ``memory_per_device`` (less the plan's safety margin). Training (step + prefetched
        batch) and evaluation (forward + optimizer state + prefetched batch) must fit in it.
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

    def share_bytes(self) -> int:
        """The bytes per device this trial may hold (see ``booked_bytes``)."""
        if self.booked_bytes is not None:
            return int(self.booked_bytes)
        margin = float(getattr(self.plan, "safety_margin", 0.0))
        return int(self.memory_per_device * (1.0 - margin))


@dataclass(frozen=True)
class RunResult:
    """How one run ended (see the module docstring for ``state``).

    ``metrics`` holds the task's evaluation (e.g. ``psnr``, ``bicubic_psnr``) for a complete run;
    ``bytes_needed`` the measured peak per device of an ``oom`` run when known;
    ``checkpoint`` the directory of the final checkpoint of a complete run;
    ``resumed_from`` the checkpointed step training restarted from (0: from scratch).
    """

    number: int
    state: str
    steps: int
    wall_seconds: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""
    bytes_needed: int | None = None
    loss: float = math.nan
    checkpoint: Path | None = None
    resumed_from: int = 0


def make_optimizer(params: Mapping[str, Any]) -> optax.GradientTransformation:
    """AdamW with every hyperparameter injected (so trials of one architecture share a compile).

    The values are placeholders here; `run_trial` writes the configuration's ``learning_rate``,
    ``weight_decay``, ``b1`` and ``b2`` into the optimizer state.
    """
    del params  # The optimizer's structure is the same for every configuration.
    return optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-3, b1=0.9, b2=0.999, weight_decay=0.0
    )


def _resumable_step(checkpointer: TrialCheckpointer, steps: int) -> int | None:
    """Newest checkpointed step of at most ``steps`` (None: none).

    A checkpoint of a longer run (more steps than this one asks for) holds weights trained
    past ``steps``; resuming from it would report a longer training as this one.
    """
    latest = checkpointer.latest_step()
    if latest is None or latest <= steps:
        return latest
    saved = (int(p.name) for p in checkpointer.directory.iterdir() if p.name.isdigit())
    return max((s for s in saved if s <= steps), default=None)


def trial_seed(seed: int, checkpoint_key: str) -> int:
    """A per-trial seed that a re-run of an interrupted trial shares (keyed by checkpoint key)."""
    return (seed * 1_000_003 + zlib.crc32(checkpoint_key.encode())) % (2**31 - 1)


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


def is_oom_error(err: BaseException) -> bool:
    """True for XLA out-of-memory errors (allocation failures at compile or run time)."""
    if isinstance(err, TrialOutOfMemory | MemoryError):
        return True
    text = f"{type(err).__name__}: {err}"
    return any(marker in text for marker in _OOM_MARKERS)


class StepCache:
    """Jitted training steps shared by trials with the same architecture, plan and devices.

    Trials of one architecture differ only in data (hyperparameters live in the optimizer
    state), so the second trial on the same devices reuses the first one's compiled step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[Any, tuple[Any, optax.GradientTransformation]] = {}
        self._evaluators: dict[Any, EvalCompiler] = {}
        #: compiled steps and initialisations, shared by trials of one architecture
        self.executables, self.initial_states = ExecutableCache(), InitialStates()
        self.hits = 0
        self.misses = 0

    def evaluator(self, graphdef: nnx.GraphDef, plan: Any, task: Any, params: Any,
                  rest: Any) -> EvalCompiler:
        """The evaluation forward of ``task`` on ``plan``'s mesh (compiles kept per chunk)."""
        devices = tuple(d.id for d in plan.mesh.devices.flat)
        key = (graphdef, plan.mesh.devices.shape, devices, id(task))
        with self._lock:
            ready = getattr(plan, "evaluator", None)
            if key not in self._evaluators and ready is not None and ready.serves(
                    task.eval_forward, devices):
                self._evaluators[key] = ready  # the planner's, with its compiled chunks
            if key not in self._evaluators:
                shardings = plan.step_shardings
                self._evaluators[key] = EvalCompiler(
                    graphdef, task.eval_forward, params, rest, shardings.params,
                    shardings.rest, plan.mesh)
            return self._evaluators[key]

    def get(
        self, graphdef: nnx.GraphDef, plan: Any, loss_fn: Callable[..., Any], params: Any,
        grad_reduce: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, optax.GradientTransformation]:
        """``(jitted step, optimizer)`` for this architecture, plan and gradient reduction,
        built once."""
        devices = tuple(d.id for d in plan.mesh.devices.flat)
        # A bound method is a new object on every access: key it by its function and owner.
        owner = id(getattr(loss_fn, "__self__", None))
        key = (graphdef, plan.mesh.devices.shape, devices, plan.batch_size,
               getattr(loss_fn, "__func__", loss_fn), owner, grad_reduce)
        with self._lock:
            if key in self._steps:
                self.hits += 1
                return self._steps[key]
            self.misses += 1
            optimizer = make_optimizer(params)
            step = jit_train_step(graphdef, optimizer, loss_fn, plan.step_shardings,
                                  grad_reduce=grad_reduce)
            self._steps[key] = (step, optimizer)
            return step, optimizer


def _set_hyperparams(opt_state: Any, params: Mapping[str, Any]) -> Any:
    for name in OPTIMIZER_KEYS:
        if name in params:
            old = opt_state.hyperparams[name]
            opt_state.hyperparams[name] = jax.numpy.asarray(params[name], dtype=old.dtype)
    return opt_state


def _initial_state(
    space: SearchSpace, spec: RunSpec, optimizer: optax.GradientTransformation, seed: int,
    abstract: bool = False, states: InitialStates | None = None, architecture: Any = None,
) -> tuple[Any, Any, Any]:
    """Parameters, optimizer state and other state created directly on the plan's devices.

    ``abstract``: ``ShapeDtypeStruct``s carrying the plan's shardings instead (nothing is
    allocated), the restore target of a resumed trial.
    """
    shardings = spec.plan.step_shardings

    def init() -> tuple[Any, Any, Any]:
        model = space.build(spec.params, nnx.Rngs(seed))
        _, params, rest = split_model(model)
        opt_state = _set_hyperparams(optimizer.init(params), spec.params)
        return params, opt_state, rest

    if states is not None and not abstract:  # one compile per architecture, seed an argument
        hyper = {k: spec.params[k] for k in OPTIMIZER_KEYS if k in spec.params}
        arch = (architecture, tuple(sorted((k, repr(v)) for k, v in spec.params.items()
                                           if k not in OPTIMIZER_KEYS)))
        return states.make(arch, lambda rngs: space.build(spec.params, rngs), optimizer,
                           shardings, seed, hyper)
    out = (shardings.params, shardings.opt_state, shardings.rest)
    with jax.set_mesh(spec.plan.mesh):
        if abstract:
            shapes = jax.eval_shape(init)
            return jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, out
            )
        return jax.jit(init, out_shardings=out)()


def run_trial(
    spec: RunSpec,
    space: SearchSpace,
    task: Task,
    *,
    report: Callable[[int, int, float], bool] | None = None,
    status: TrialStatus | None = None,
    stop: threading.Event | None = None,
    cache: StepCache | None = None,
) -> RunResult:
    """Train and evaluate one configuration on ``spec.plan``'s devices; never raises.

    Args:
      spec: what to run (configuration, plan on its devices, steps, checkpointing).
      space: the search space (``build`` makes the model).
      task: the data, loss and evaluation.
      report: ``report(number, step, value) -> prune?``, called after each intermediate
        evaluation with the task's metric.
      status: progress record updated in place for the live view.
      stop: set by the engine to stop the trial (it checkpoints and returns ``interrupted``).
      cache: compiled-step cache shared between trials.

    Returns:
      A `RunResult`; every exception is turned into a ``failed`` or ``oom`` result.
    """
    start = time.monotonic()
    status = status or TrialStatus(spec.number, spec.params)
    status.state, status.steps = "compiling", spec.steps
    try:
        return _run(spec, space, task, report, status, stop, cache or StepCache(), start)
    except TrialInterrupted as err:
        status.state = "interrupted"
        return RunResult(spec.number, "interrupted", status.step, time.monotonic() - start,
                         reason=str(err), loss=status.loss)
    except Exception as err:  # noqa: BLE001 - one candidate's failure must not stop the study
        if is_oom_error(err):
            status.state = "oom"
            return RunResult(spec.number, "oom", status.step, time.monotonic() - start,
                             reason=f"out of memory: {err}".splitlines()[0][:300],
                             bytes_needed=getattr(err, "bytes_needed", None), loss=status.loss)
        status.state, status.reason = "failed", f"{type(err).__name__}: {err}"
        frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        where = f" (at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300] + where
        return RunResult(spec.number, "failed", status.step, time.monotonic() - start,
                         reason=reason, loss=status.loss)


def _run(
    spec: RunSpec,
    space: SearchSpace,
    task: Task,
    report: Callable[[int, int, float], bool] | None,
    status: TrialStatus,
    stop: threading.Event | None,
    cache: StepCache,
    start: float,
) -> RunResult:
    plan = spec.plan
    seed = spec.seed
    with jax.set_mesh(plan.mesh):
        graphdef = split_model(nnx.eval_shape(lambda: space.build(spec.params, nnx.Rngs(seed))))[0]
    step_fn, optimizer = cache.get(graphdef, plan, task.loss_fn, spec.params, spec.grad_reduce)

    first = 0
    checkpointer = TrialCheckpointer(spec.checkpoint_dir) if spec.checkpoint_dir else None
    saving = checkpointer is not None and spec.save_checkpoints
    resume = _resumable_step(checkpointer, spec.steps) if checkpointer is not None else None
    if checkpointer is not None and resume is not None:
        # Resume: restore straight into this placement's shardings (the devices may differ from
        # before); the target is abstract, so the state exists once, never a fresh copy too.
        target = _initial_state(space, spec, optimizer, seed, abstract=True)
        first, leaves = checkpointer.restore(jax.tree.leaves(target), resume)
        params, opt_state, rest = jax.tree.unflatten(jax.tree.structure(target), leaves)
    else:
        params, opt_state, rest = _initial_state(space, spec, optimizer, seed,
                                                 states=cache.initial_states,
                                                 architecture=graphdef)

    batches = _batches(task, plan.batch_size, seed, spec.batch_share)
    for _ in range(first):  # keep the data stream identical to an uninterrupted run
        next(batches)
    batch = jax.device_put(next(batches), plan.batch_sharding)

    # The planner predicted this trial fits its share; check the real compiles on these devices
    # first: the step with the next batch prefetched beside it, and the evaluation. The
    # planner's own executable is run when it is the same program on the same devices.
    lowered = step_fn.lower(params, opt_state, rest, batch)
    ready = getattr(plan, "compiled_step", None) if spec.grad_reduce is None else None
    compiled = cache.executables.compiled(
        lowered, tuple(d.id for d in plan.mesh.devices.flat), ready)
    evaluation = _check_share(spec, task, cache, graphdef, params, opt_state, rest, batch,
                              compiled)

    if spec.grad_reduce is not None:
        # A cross-rank reduction is an ordered side effect (mpi4jax threads a token through the
        # step), which the ahead-of-time executable does not take: run through the jit wrapper.
        compiled = step_fn
    # The pace fields first: the engine reads them once it sees "training".
    status.training_since, status.first_step = time.monotonic(), first
    status.state, status.step = "training", first
    loss = None
    for step in range(first, spec.steps):
        if stop is not None and stop.is_set():
            if saving:
                checkpointer.save(step, jax.tree.leaves((params, opt_state, rest)))
            if checkpointer is not None:
                checkpointer.close()  # waits for the save; the next run opens its own
            raise TrialInterrupted(f"stopped at step {step}")
        params, opt_state, rest, loss = compiled(params, opt_state, rest, batch)
        done = step + 1
        if done < spec.steps:
            batch = jax.device_put(next(batches), plan.batch_sharding)
        if done % spec.log_every == 0 or done == spec.steps:
            status.loss = float(loss)
            if not math.isfinite(status.loss):
                raise FloatingPointError(f"loss is {status.loss} at step {done}")
        status.step = done
        if spec.eval_every and done % spec.eval_every == 0 and done < spec.steps:
            value = _evaluate(task, graphdef, params, rest, plan, evaluation)[task.metric]
            status.metric = value
            if report is not None and report(spec.number, done, value):
                status.state = "pruned"
                return RunResult(spec.number, "pruned", done, time.monotonic() - start,
                                 metrics={task.metric: value},
                                 reason=f"pruned at step {done} ({task.metric}={value:.4g})",
                                 loss=status.loss)
        if saving and spec.checkpoint_every and done % spec.checkpoint_every == 0:
            checkpointer.save(done, jax.tree.leaves((params, opt_state, rest)))

    if loss is not None:
        status.loss = float(loss)
        if not math.isfinite(status.loss):
            raise FloatingPointError(f"loss is {status.loss} at step {spec.steps}")
    status.state = "evaluating"
    metrics = _evaluate(task, graphdef, params, rest, plan, evaluation)
    value = metrics[task.metric]
    if not math.isfinite(value):
        raise FloatingPointError(f"{task.metric} is {value} after training")
    status.metric = value
    final = None
    if checkpointer is not None:
        if saving and checkpointer.latest_step() != spec.steps:
            checkpointer.save(spec.steps, jax.tree.leaves((params, opt_state, rest)))
        final = checkpointer.step_directory(spec.steps) if saving else None
        checkpointer.close()
    status.state = "complete"
    return RunResult(spec.number, "complete", spec.steps, time.monotonic() - start,
                     metrics=metrics, loss=status.loss, checkpoint=final,
                     resumed_from=first)


def _batches(task: Task, batch_size: int, seed: int,
             share: tuple[int, int] | None) -> Iterator[Any]:
    """The task's batch stream, or this process's contiguous part of a global stream."""
    if share is None:
        yield from task.batches(batch_size, seed)
        return
    index, parts = share
    for batch in task.batches(batch_size * parts, seed):
        yield jax.tree.map(lambda x: x[index * batch_size : (index + 1) * batch_size], batch)


def load_model(
    directory: str | Path, space: SearchSpace, params: Mapping[str, Any], seed: int = 0
) -> nnx.Module:
    """The trained model saved in a trial's checkpoint step directory (e.g. ``best_model/``).

    ``params`` is the trial's configuration (``best_model/trial.json`` holds it). The model is
    rebuilt from ``space`` and its parameters and other state are read back on the default device.
    """
    import orbax.checkpoint as ocp

    from scamp_jax.hpo.checkpoint import from_storable, to_storable

    directory = Path(directory).resolve()
    item = directory / "default"
    if not item.is_dir():
        raise FileNotFoundError(
            f"{directory} is not a checkpoint step directory (no 'default' item); pass e.g. "
            "<study_dir>/best_model or <study_dir>/checkpoints/<key>/<step>"
        )
    model = space.build(params, nnx.Rngs(seed))
    graphdef, weights, rest = split_model(model)
    like = jax.tree.leaves((weights, make_optimizer(params).init(weights), rest))
    with ocp.StandardCheckpointer() as checkpointer:
        leaves = checkpointer.restore(item, to_storable(like))
    weights, _, rest = jax.tree.unflatten(
        jax.tree.structure((weights, make_optimizer(params).init(weights), rest)),
        from_storable(leaves, like),
    )
    return nnx.merge(graphdef, weights, rest)


def _check_share(
    spec: RunSpec, task: Task, cache: StepCache, graphdef: nnx.GraphDef, params: Any,
    opt_state: Any, rest: Any, batch: Any, compiled: Any,
) -> tuple[EvalCompiler, EvalPlan] | None:
    """Raise `TrialOutOfMemory` (with the measured bytes) if the trial exceeds its share.

    Training holds the compiled step's peak plus the prefetched next batch; evaluation holds
    the compiled forward at its chunk plus the optimizer state and that batch. The chunk is the
    plan's (``Plan.eval_chunk``) when it has one, else chosen here (`plan_eval`). Returns the
    evaluator and its chunk, or None for a task that evaluates itself.
    """
    share = spec.share_bytes()
    plan = spec.plan
    prefetch = sh.bytes_per_device(batch, plan.batch_sharding)
    step_peak = peak_bytes(compiled)
    train = None if step_peak is None else step_peak + prefetch
    evaluation = None
    if supports_chunked_eval(task):
        groups = abstract_eval_inputs(task)
        evaluator = cache.evaluator(graphdef, plan, task, params, rest)
        resident = sh.bytes_per_device(opt_state, plan.step_shardings.opt_state) + prefetch
        chunk = int(getattr(plan, "eval_chunk", 0) or 0)
        if chunk:
            chosen = EvalPlan(chunk, evaluator.peak(chunk, groups), resident)
        else:
            chosen = plan_eval(evaluator, groups, resident, train or share)
        evaluation = (evaluator, chosen)
        if chosen.total_bytes > share:
            raise TrialOutOfMemory(
                f"evaluation needs {chosen.total_bytes} bytes per device (forward at chunk "
                f"{chosen.chunk}: {chosen.peak_bytes}, optimizer state and prefetched batch: "
                f"{chosen.resident_bytes}), the trial's share is {share}",
                bytes_needed=max(chosen.total_bytes, train or 0),
            )
    if train is not None and train > share:
        raise TrialOutOfMemory(
            f"compiled step needs {step_peak} bytes per device plus {prefetch} for the "
            f"prefetched batch, the trial's share is {share}",
            bytes_needed=max(train, evaluation[1].total_bytes if evaluation else 0),
        )
    return evaluation


def _evaluate(task: Task, graphdef: nnx.GraphDef, params: Any, rest: Any, plan: Any,
              evaluation: tuple[EvalCompiler, EvalPlan] | None = None) -> dict:
    """The task's scores: the planned forward in chunks on the trial's devices when
    ``evaluation`` is given, else the task's own ``evaluate`` under the trial's mesh."""
    if evaluation is not None:
        evaluator, chosen = evaluation
        outputs = evaluator.run(chosen.chunk, params, rest, task.eval_inputs())
        metrics = task.score(outputs)
    else:
        with jax.set_mesh(plan.mesh):
            model = nnx.merge(graphdef, params, rest)
            metrics = task.evaluate(model)
    if task.metric not in metrics:
        raise KeyError(
            f"task.evaluate returned {sorted(metrics)} without the study metric {task.metric!r}"
        )
    return {k: float(np.asarray(v)) for k, v in metrics.items()}
