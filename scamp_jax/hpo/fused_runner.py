"""Run a fused group: ``K`` trials of one architecture trained together on one device set.

`run_fused_group` is `scamp_jax.hpo.runner.run_trial` for a group (`scamp_jax.planning.fusion`),
the same lifecycle (`scamp_jax.hpo.lifecycle`) with the fused program: it builds every member
from its own seed, trains all of them with one compiled fused step on the group's devices,
checks the fused step, the prefetched batches and a member's chunked evaluation beside the
stacked state against the group's booked share, and reports, evaluates, prunes, checkpoints
and ends each member on its own:

- each member reports to ``report(number, step, value) -> prune?`` after an intermediate
  evaluation, so each can be its own Optuna trial;
- a pruned member (or one whose loss turns non-finite) is masked: its state stops changing at
  once; at the next evaluation the group re-forms without it (a narrower fused step), so it
  stops costing compute too (``reform=False`` keeps the mask only);
- each member checkpoints into its own directory with exactly the state its solo run would save,
  so a member can resume solo or in another group (a group resumes when its members' newest
  checkpoints are at the same step);
- each member ends as a `RunResult` with the solo runner's states (``complete``, ``pruned``,
  ``failed``, ``oom``, ``interrupted``).
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
from scamp_jax.hpo.member_streams import StackedStreams, parallel_streams
from scamp_jax.hpo.program_key import ProgramKey
from scamp_jax.hpo.runner import (
    StepCache,
    _batches,
    make_optimizer,
    peak_bytes,
)
from scamp_jax.hpo.trial import OPTIMIZER_KEYS, RunResult, TrialStatus, model_config
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.evaluation import EvalCompiler
from scamp_jax.planning.fusion import (
    FusionPlan,
    hyperparam_arrays,
    is_key,
    jit_fused_step,
    stack_shardings,
)
from scamp_jax.planning.initial_state import abstract_initial_state
from scamp_jax.planning.train_step import split_model
from scamp_jax.space import SearchSpace, Task

PyTree = Any


@dataclass(frozen=True)
class GroupSpec:
    """What a group runs.

    Attributes:
      group: the group's id (recorded per member as ``fused_group``).
      members: the members, in slot order (at most ``plan.width``).
      plan: the `FusionPlan`, already on the group's devices.
      steps: training steps per member.
      memory_per_device: device budget in bytes (the plan's safety margin is held back from it).
      checkpoint_every, eval_every, log_every: steps between checkpoints (0: only at the end),
        intermediate evaluations (0: none) and loss read-backs, as for `RunSpec`.
      checkpoint_min_seconds: least seconds of training between two checkpoints before the
        last, as for `RunSpec`.
      reform: re-form the group without stopped members at the next evaluation (one compile
        per new width) instead of only masking them.
      report_every: as for `RunSpec` (the step the pruner hears per evaluation).
    """

    group: int
    members: tuple[MemberSpec, ...]
    plan: FusionPlan
    steps: int
    memory_per_device: int
    checkpoint_every: int = 0
    eval_every: int = 0
    log_every: int = 10
    reform: bool = True
    booked_bytes: int | None = None
    report_every: int = 0
    evaluations_per_step: Fraction = Fraction(0)
    checkpoint_min_seconds: float = 0.0

    @classmethod
    def of(cls, group: int, members: tuple[MemberSpec, ...], plan: FusionPlan,
           schedule: Schedule, memory_per_device: int) -> GroupSpec:
        """The spec of ``members`` trained as group ``group`` on ``plan`` by ``schedule`` (its
        ``share_bytes`` is the booked share), with a device budget of ``memory_per_device``
        bytes."""
        return cls(group=group, members=members, plan=plan, steps=schedule.steps,
                   memory_per_device=memory_per_device,
                   checkpoint_every=schedule.checkpoint_every, eval_every=schedule.eval_every,
                   log_every=schedule.log_every, reform=schedule.reform,
                   booked_bytes=schedule.share_bytes, report_every=schedule.report_every,
                   evaluations_per_step=schedule.evaluations_per_step,
                   checkpoint_min_seconds=schedule.checkpoint_min_seconds)

    def schedule(self) -> Schedule:
        """How long the group trains and what it does on the way (the lifecycle's schedule)."""
        return Schedule(self.steps, self.share_bytes(), self.checkpoint_every, self.eval_every,
                        self.log_every, reform=self.reform, report_every=self.report_every,
                        checkpoint_min_seconds=self.checkpoint_min_seconds,
                        evaluations_per_step=self.evaluations_per_step)

    def share_bytes(self) -> int:
        """The bytes per device the group may hold: ``booked_bytes`` (its share of the device
        ledger, e.g. the fused plan's ``predicted_peak_bytes``), else the usable part of
        ``memory_per_device`` (less the member plan's safety margin). Training (fused step +
        prefetched batches) and evaluation (a member's forward + the stacked state + those
        batches) must fit in it."""
        return share_bytes(self.booked_bytes, self.memory_per_device, self.plan.plan)


@dataclass(frozen=True)
class GroupResult:
    """How a group ended: one `RunResult` per member (in member order) and the group's costs.

    ``losses[i]`` holds member ``i``'s ``(step, loss)`` at every read-back (the loss before the
    update of that step, as the solo runner reports it); ``widths`` the group's width after each
    re-form, starting with the first; ``compile_seconds`` the time spent compiling fused steps.
    """

    group: int
    members: tuple[RunResult, ...]
    losses: tuple[tuple[tuple[int, float], ...], ...]
    wall_seconds: float
    compile_seconds: float
    widths: tuple[int, ...] = ()
    params: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)

    def records(self) -> list[dict[str, Any]]:
        """Per-member result records (JSON-ready), with ``fused_group`` and ``fusion_width``."""
        out = []
        for i, r in enumerate(self.members):
            out.append({
                "number": r.number, "state": r.state, "steps": r.steps,
                "params": dict(self.params[i]) if self.params else {},
                "loss": r.loss if math.isfinite(r.loss) else None,
                "metrics": dict(r.metrics), "reason": r.reason,
                "wall_seconds": r.wall_seconds, "resumed_from": r.resumed_from,
                "checkpoint": str(r.checkpoint) if r.checkpoint else None,
                "fused_group": self.group, "fusion_width": self.widths[0] if self.widths else 0,
                "losses": [[s, v if math.isfinite(v) else None] for s, v in self.losses[i]],
            })
        return out

    def write(self, path: str | Path) -> Path:
        """Write `records` to ``path`` as JSON; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"group": self.group, "widths": list(self.widths),
                                    "wall_seconds": self.wall_seconds,
                                    "compile_seconds": self.compile_seconds,
                                    "members": self.records()}, indent=2))
        return path


def architecture_signature(space: SearchSpace, params: Mapping[str, Any],
                           mesh: jax.sharding.Mesh | None = None) -> tuple[Any, Any]:
    """What decides whether trials can share a fused step: ``(graphdef, shapes and dtypes of
    every variable)`` of the model ``params`` builds (abstractly; nothing is allocated).

    Two configurations with equal signatures compile to the same program, whatever their
    optimizer hyperparameters; an engine groups queued trials by it.
    """
    def build() -> tuple[Any, Any]:
        abstract = nnx.eval_shape(lambda: space.model(params, nnx.Rngs(0)))
        return split_model(abstract)[0], jax.tree.map(lambda x: (x.shape, x.dtype),
                                                      nnx.state(abstract))

    if mesh is None:
        return build()
    with jax.set_mesh(mesh):
        return build()


def signature_key(signature: tuple[Any, Any]) -> str:
    """A comparable, hashable form of an `architecture_signature`: the SHA-256 of the texts of
    its graph definition and of its shapes and dtypes.

    Graph definitions of two separate builds may compare unequal although they describe the
    same program (static attributes such as index arrays compare by identity); their texts
    are equal.
    """
    graphdef, shapes = signature
    return hashlib.sha256(f"{graphdef!r}\n{shapes!r}".encode()).hexdigest()


def _check_architecture(space: SearchSpace, members: Sequence[MemberSpec],
                        mesh: jax.sharding.Mesh) -> nnx.GraphDef:
    """The members' common graph definition; raises if any member builds another program,
    or sets another value than the first member for a key that is not an optimizer's: the
    group builds every member's initial state with the first member's configuration, and
    ``build`` may read any of its values (an initialisation scale changes no graph)."""
    first = members[0]
    arch = model_config(first.params)
    for m in members[1:]:
        other = model_config(m.params)
        if other != arch:
            keys = sorted({k for k, _ in set(arch) ^ set(other)})
            raise ValueError(
                f"trial {m.number} ({dict(m.params)}) differs from trial {first.number} "
                f"({dict(first.params)}) in {', '.join(keys)}; a fused group holds trials of one "
                "configuration but for their optimizer hyperparameters "
                f"({', '.join(OPTIMIZER_KEYS)}): run it in its own group"
            )
    return architecture_signature(space, first.params, mesh)[0]


def _take(tree: PyTree, index: np.ndarray, shardings: PyTree) -> PyTree:
    """Members ``index`` of a stacked tree, placed with ``shardings``."""
    def take(x: jax.Array) -> jax.Array:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jnp.take(jax.random.key_data(x), index, axis=0)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jnp.take(x, index, axis=0)

    return jax.device_put(jax.tree.map(take, tree), shardings)


def run_fused_group(
    spec: GroupSpec,
    space: SearchSpace,
    task: Task,
    *,
    report: Callable[[int, int, float], bool] | None = None,
    on_loss: Callable[[int, int, float], None] | None = None,
    statuses: Sequence[TrialStatus] | None = None,
    stop: threading.Event | None = None,
    results_path: str | Path | None = None,
    cache: StepCache | None = None,
    on_checkpoint: Callable[[int, int, float], None] | None = None,
) -> GroupResult:
    """Train and evaluate a fused group on ``spec.plan``'s devices; never raises.

    The one trial lifecycle (`scamp_jax.hpo.lifecycle.Lifecycle`) with the fused program.

    Args:
      spec: the group (members, fused plan on its devices, steps, intervals).
      space: the search space (``build`` makes each member's model).
      task: the data, loss and evaluation (each member draws ``task.batches(B, seed)``).
      report: ``report(number, step, value) -> prune?`` per member after each intermediate
        evaluation, with the task's metric.
      on_loss: ``on_loss(number, step, loss)`` per active member at every loss read-back.
      statuses: one `TrialStatus` per member (live view), updated in place.
      stop: set to stop the group (active members checkpoint and end ``interrupted``).
      results_path: if given, the per-member records are written there as JSON.
      cache: where the evaluation forward is compiled and kept (shared with solo runs of the
        same architecture on the same devices).
      on_checkpoint: ``on_checkpoint(number, step, seconds)`` per member after each
        checkpoint before the last, with the seconds the group's run has taken so far.

    Returns:
      A `GroupResult`; a failure of the whole group (compile error, out of memory) ends every
      member with that state, a failure of one member (non-finite loss, evaluation error) ends
      that member only.
    """
    if not spec.members:
        raise ValueError("a fused group needs at least one member")
    if len(spec.members) > spec.plan.width:
        raise ValueError(
            f"{len(spec.members)} members exceed the plan's width {spec.plan.width}; "
            "split them into groups of at most that many"
        )
    program = FusedProgram(spec, space, task, cache or StepCache())
    run = Lifecycle(program, spec.members, spec.schedule(), task, statuses=statuses,
                    report=report, on_loss=on_loss, stop=stop, on_checkpoint=on_checkpoint)
    plan = spec.plan.plan
    for m in run.members:
        m.status.devices = tuple(d.id for d in plan.devices)
        m.status.model_parallel, m.status.batch_size = plan.model_parallel, spec.plan.batch_size
        m.status.predicted_peak_bytes = spec.plan.peak_bytes_per_device
    members = run.run()
    result = GroupResult(
        group=spec.group,
        members=tuple(members),
        losses=tuple(tuple(m.losses) for m in run.members),
        wall_seconds=time.monotonic() - run.start,
        compile_seconds=run.compile_seconds,
        widths=tuple(run.widths),
        params=tuple(m.params for m in spec.members),
    )
    if results_path is not None:
        result.write(results_path)
    return result


class FusedProgram:
    """The `scamp_jax.hpo.lifecycle.Program` of a fused group: every member's state stacked on a
    leading member axis, one vmapped step with an ``active`` mask, each member's own data
    stream and checkpoint."""

    def __init__(self, spec: GroupSpec, space: SearchSpace, task: Task,
                 cache: StepCache) -> None:
        self.spec, self.space, self.task, self.cache = spec, space, task, cache
        self.plan = spec.plan.plan
        self.batch_size = int(spec.plan.batch_size)  # a member's, the group's own plan's
        self.shardings = stack_shardings(self.plan.step_shardings)
        self.replicated = self.plan.step_shardings.replicated()
        self.width = len(spec.members)
        self._sent: np.ndarray | None = None
        #: a member's sharding of each state leaf, in the order of the state's leaves
        self._member_shardings = jax.tree.leaves(
            (self.plan.step_shardings.params, self.plan.step_shardings.opt_state,
             self.plan.step_shardings.rest),
            is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        self._host: list[np.ndarray] | None = None  # the state's leaves read out, once per step

    def prepare(self, members: Sequence[MemberSpec], first: int) -> None:
        plan = self.plan
        self.graphdef = _check_architecture(self.space, members, plan.mesh)
        configs = [m.params for m in members]
        self.optimizer = optimizer = make_optimizer(configs[0])
        self.hyper = hyperparam_arrays(OPTIMIZER_KEYS, configs)
        self.build = lambda rngs: self.space.model(configs[0], rngs)
        # Shapes and shardings only until `start`: the fused step compiles from them.
        self.state = abstract_initial_state(self.build, optimizer, plan.step_shardings,
                                            tuple(sorted(self.hyper)), width=len(members))
        self._host = None
        batch_size = self.spec.plan.batch_size
        self.streams = StackedStreams(
            [stream(_batches(self.task, batch_size, m.seed, None), first) for m in members],
            parallel_streams(self.task))
        self._next = self.streams.draw()
        self.batch = abstract_batch(self._next, self.shardings.batch)
        source = getattr(self.spec.plan, "step_source", None)
        if source is not None and source.serves(self.graphdef, optimizer, self.task.loss_fn,
                                                plan.step_shardings):
            self.step_fn = source.step  # the planner's: lowering it again traces nothing
        else:
            self.step_fn = jit_fused_step(self.graphdef, optimizer, self.task.loss_fn,
                                          plan.step_shardings)

    def start(self, members: Sequence[MemberSpec], first: int,
              checkpointers: Sequence[TrialCheckpointer | None]) -> None:
        if first:  # restored into the abstract state's shapes: the state exists once
            self.state = self._restore(self.state, first, checkpointers)
        else:
            self.state = self.cache.initial_states.make_group(
                ProgramKey.of(self.graphdef, members[0].params).architecture, self.build,
                self.optimizer,
                self.plan.step_shardings, [m.seed for m in members], self.hyper)
        self.batch = jax.device_put(self._next, self.shardings.batch)
        del self._next

    def _restore(self, state: tuple[PyTree, ...], step: int,
                 checkpointers: Sequence[TrialCheckpointer | None]) -> tuple[PyTree, ...]:
        """Members' checkpoints of ``step`` stacked into ``state``'s shape and shardings."""
        treedef = jax.tree.structure(state)
        like = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=s)
                for x, s in zip(jax.tree.leaves(state), self._member_shardings, strict=True)]
        restored = []
        for checkpointer in checkpointers:
            assert checkpointer is not None
            _, leaves = checkpointer.restore(like, step)
            restored.append(leaves)
        stacked = [_stack_leaf([r[i] for r in restored]) for i in range(len(restored[0]))]
        shardings = jax.tree.leaves((self.shardings.params, self.shardings.opt_state,
                                     self.shardings.rest),
                                    is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        stacked = [jax.device_put(x, s) for x, s in zip(stacked, shardings, strict=True)]
        return jax.tree.unflatten(treedef, stacked)

    def prefetch(self) -> None:
        batch = self.streams.draw()
        self.batch = jax.device_put(batch, self.shardings.batch)

    def take_failed(self) -> dict[int, BaseException]:
        return self.streams.take_failed()

    def _active(self, active: np.ndarray) -> jax.Array:
        if self._sent is None or not np.array_equal(self._sent, active):
            self._sent = active.copy()
            self._active_device = jax.device_put(self._sent, self.replicated)
        return self._active_device

    def compile(self) -> int | None:
        mask = jax.ShapeDtypeStruct((self.width,), np.dtype(bool), sharding=self.replicated)
        lowered = self.step_fn.lower(*self.state, self.batch, mask)
        # The planner's run-grade fused step when it is this program on these devices (a group
        # of the planned width), else one compile shared by groups of the same program.
        ready = getattr(self.spec.plan, "compiled_step", None)
        self.compiled = self.cache.executables.compiled(
            lowered, list(self.plan.mesh.devices.flat), ready)
        return peak_bytes(self.compiled)

    def prefetch_bytes(self) -> int:
        return sh.bytes_per_device(self.batch, self.shardings.batch)

    def resident_bytes(self) -> int:
        shard = self.shardings
        return sh.bytes_per_device(self.state, (shard.params, shard.opt_state, shard.rest))

    def evaluator(self) -> EvalCompiler:
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                           (self.state[0], self.state[2]))
        return self.cache.evaluator(self.graphdef, self.plan, self.task, *one)

    def step(self, active: np.ndarray) -> Any:
        *state, losses = self.compiled(*self.state, self.batch, self._active(active))
        self.state = tuple(state)
        self._host = None
        return losses

    def _read_out(self) -> list[np.ndarray]:
        """The stacked state's leaves in host memory (typed PRNG keys as their raw data), read
        once per state: the saves and evaluations of one step share one read-out and compile
        nothing, and the devices hold no copy of it."""
        if self._host is None:
            leaves = jax.tree.leaves(self.state)
            self._host = jax.device_get([jax.random.key_data(x) if is_key(x) else x
                                         for x in leaves])
        return self._host

    def checkpoint_leaves(self, slot: int) -> list[Any]:
        return [x[slot, ...] for x in self._read_out()]  # 0-d arrays stay arrays

    def member(self, slot: int) -> tuple[PyTree, PyTree, PyTree]:
        # Put back from the host read-out: one member's copy on the devices, nothing compiled.
        leaves = []
        for x, h, s in zip(jax.tree.leaves(self.state), self._read_out(), self._member_shardings,
                           strict=True):
            one = jax.device_put(h[slot, ...], s)
            leaves.append(jax.random.wrap_key_data(one, impl=jax.random.key_impl(x))
                          if is_key(x) else one)
        return jax.tree.unflatten(jax.tree.structure(self.state), leaves)

    def reform(self, keep: np.ndarray) -> None:
        shard = self.shardings
        self.state = (_take(self.state[0], keep, shard.params),
                      _take(self.state[1], keep, shard.opt_state),
                      _take(self.state[2], keep, shard.rest))
        self.batch = _take(self.batch, keep, shard.batch)
        self.streams.keep(keep)
        self.width = len(keep)
        self._sent = None
        self._host = None

    def evaluate_whole(self, slot: int, task: Task) -> Mapping[str, Any]:
        params, _, rest = self.member(slot)
        return evaluate_model(task, self.graphdef, params, rest, self.plan.mesh)


def _stack_leaf(xs: Sequence[jax.Array]) -> jax.Array:
    if is_key(xs[0]):
        data = jnp.stack([jax.random.key_data(x) for x in xs])
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(xs[0]))
    return jnp.stack(xs)
