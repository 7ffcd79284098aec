"""Run a fused group: ``K`` trials of one architecture trained together on one device set.

`run_fused_group` is `scamp_jax.hpo.runner.run_trial` for a group (`scamp_jax.planning.fusion`): it
builds every member from its own seed, trains all of them with one compiled fused step on the
group's devices, and reports, evaluates, prunes, checkpoints and ends each member on its own:

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scamp_jax.hpo.checkpoint import TrialCheckpointer
from scamp_jax.hpo.runner import (
    OPTIMIZER_KEYS,
    RunResult,
    TrialOutOfMemory,
    TrialStatus,
    _batches,
    _evaluate,
    is_oom_error,
    make_optimizer,
    peak_bytes,
)
from scamp_jax.planning.fusion import (
    FusionPlan,
    fused_initial_state,
    hyperparam_arrays,
    jit_fused_step,
    member_slice,
    stack_batches,
    stack_shardings,
)
from scamp_jax.planning.train_step import split_model
from scamp_jax.space import SearchSpace, Task

PyTree = Any


@dataclass(frozen=True)
class MemberSpec:
    """One trial of a group.

    Attributes:
      number: the study's trial number.
      params: the configuration; its architecture must match the group's.
      seed: seed of the member's parameter initialisation and data stream (the seed its solo
        run would get, e.g. `scamp_jax.hpo.runner.trial_seed`).
      checkpoint_dir: the member's checkpoint directory, or ``None``.
    """

    number: int
    params: Mapping[str, Any]
    seed: int = 0
    checkpoint_dir: Path | None = None


@dataclass(frozen=True)
class GroupSpec:
    """What a group runs.

    Attributes:
      group: the group's id (recorded per member as ``fused_group``).
      members: the members, in slot order (at most ``plan.width``).
      plan: the `FusionPlan`, already on the group's devices.
      steps: training steps per member.
      memory_per_device: device budget in bytes the compiled fused step's peak must stay within.
      checkpoint_every, eval_every, log_every: steps between checkpoints (0: only at the end),
        intermediate evaluations (0: none) and loss read-backs, as for `RunSpec`.
      reform: re-form the group without stopped members at the next evaluation (one compile
        per new width) instead of only masking them.
      mode: ``"vmap"`` (wide kernels) or ``"map"`` (the solo step's kernels member by member;
        see `scamp_jax.planning.fusion.FUSION_MODES`).
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
    mode: str = "vmap"


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


class _Member:
    """Mutable bookkeeping of one member while the group runs."""

    def __init__(self, spec: MemberSpec, status: TrialStatus) -> None:
        self.spec = spec
        self.status = status
        self.result: RunResult | None = None
        self.losses: list[tuple[int, float]] = []
        self.batches: Iterator[Any] | None = None
        self.checkpointer: TrialCheckpointer | None = None


def architecture_signature(space: SearchSpace, params: Mapping[str, Any],
                           mesh: jax.sharding.Mesh | None = None) -> tuple[Any, Any]:
    """What decides whether trials can share a fused step: ``(graphdef, shapes and dtypes of
    every variable)`` of the model ``params`` builds (abstractly; nothing is allocated).

    Two configurations with equal signatures compile to the same program, whatever their
    optimizer hyperparameters; an engine groups queued trials by it.
    """
    def build() -> tuple[Any, Any]:
        abstract = nnx.eval_shape(lambda: space.build(params, nnx.Rngs(0)))
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
    """The members' common graph definition; raises if any member builds another program."""
    signatures = []
    built: dict[str, Any] = {}  # configurations equal but for optimizer keys build once
    for m in members:
        arch = repr(sorted((k, repr(v)) for k, v in m.params.items() if k not in OPTIMIZER_KEYS))
        if arch not in built:
            built[arch] = architecture_signature(space, m.params, mesh)
        signatures.append(built[arch])
    for m, g in zip(members[1:], signatures[1:], strict=True):
        if signature_key(g) != signature_key(signatures[0]):
            raise ValueError(
                f"trial {m.number} ({dict(m.params)}) builds another architecture than trial "
                f"{members[0].number} ({dict(members[0].params)}); a fused group holds trials "
                "of one architecture only: run it in its own group"
            )
    return signatures[0][0]


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
) -> GroupResult:
    """Train and evaluate a fused group on ``spec.plan``'s devices; never raises.

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

    Returns:
      A `GroupResult`; a failure of the whole group (compile error, out of memory) ends every
      member with that state, a failure of one member (non-finite loss, evaluation error) ends
      that member only.
    """
    start = time.monotonic()
    if not spec.members:
        raise ValueError("a fused group needs at least one member")
    if len(spec.members) > spec.plan.width:
        raise ValueError(
            f"{len(spec.members)} members exceed the plan's width {spec.plan.width}; "
            "split them into groups of at most that many"
        )
    if statuses is not None and len(statuses) != len(spec.members):
        raise ValueError(f"{len(statuses)} statuses given for {len(spec.members)} members")
    members = [_Member(m, statuses[i] if statuses is not None else TrialStatus(m.number, m.params))
               for i, m in enumerate(spec.members)]
    for m in members:
        m.status.state, m.status.steps = "compiling", spec.steps
    group = _Group(spec, space, task, members, report, on_loss, stop, start)
    try:
        group.run()
    except Exception as err:  # noqa: BLE001 - one group's failure must not stop the study
        group.fail_all(err)
    finally:
        for m in members:
            if m.checkpointer is not None:
                m.checkpointer.close()
    group.fail_all(RuntimeError("the group ended before this member did"))  # none expected
    result = GroupResult(
        group=spec.group,
        members=tuple(m.result for m in members if m.result is not None),
        losses=tuple(tuple(m.losses) for m in members),
        wall_seconds=time.monotonic() - start,
        compile_seconds=group.compile_seconds,
        widths=tuple(group.widths),
        params=tuple(m.spec.params for m in members),
    )
    if results_path is not None:
        result.write(results_path)
    return result


class _Group:
    """The training loop of one group (private; `run_fused_group` is the entry point)."""

    def __init__(self, spec: GroupSpec, space: SearchSpace, task: Task, members: list[_Member],
                 report: Callable[[int, int, float], bool] | None,
                 on_loss: Callable[[int, int, float], None] | None,
                 stop: threading.Event | None, start: float) -> None:
        self.spec, self.space, self.task, self.members = spec, space, task, members
        self.report, self.on_loss, self.stop, self.start = report, on_loss, stop, start
        self.plan = spec.plan.plan
        self.shardings = stack_shardings(self.plan.step_shardings)
        self.replicated = self.plan.step_shardings.replicated()
        self.compile_seconds = 0.0
        self.widths: list[int] = []
        self.slots: list[_Member] = list(members)  # members in the stacked arrays, in order
        self.first = 0  # the step training (re)starts from

    # ---- endings

    def _end(self, m: _Member, state: str, reason: str = "", metrics: Mapping[str, float] | None
             = None, checkpoint: Path | None = None, bytes_needed: int | None = None) -> None:
        if m.result is not None:
            return
        m.status.state = state
        if reason:
            m.status.reason = reason
        m.result = RunResult(m.spec.number, state, m.status.step, time.monotonic() - self.start,
                             metrics=dict(metrics or {}), reason=reason,
                             bytes_needed=bytes_needed, loss=m.status.loss,
                             checkpoint=checkpoint, resumed_from=self.first)

    def fail_all(self, err: BaseException) -> None:
        """End every member still running with ``err`` (``oom`` or ``failed``)."""
        if is_oom_error(err):
            reason = f"out of memory: {err}".splitlines()[0][:300]
            for m in self.members:
                self._end(m, "oom", reason, bytes_needed=getattr(err, "bytes_needed", None))
            return
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        for m in self.members:
            self._end(m, "failed", reason)

    # ---- state

    def _leaves(self, state: tuple[PyTree, PyTree, PyTree], slot: int) -> list[jax.Array]:
        return jax.tree.leaves(member_slice(state, slot))

    def _restore(self, state: tuple[PyTree, PyTree, PyTree]) -> tuple[tuple[PyTree, ...], int]:
        """Members' checkpoints stacked into ``state``; the common step (0: none)."""
        steps = {m.spec.number: m.checkpointer.latest_step() if m.checkpointer else None
                 for m in self.members}
        found = set(steps.values())
        if found == {None}:
            return state, 0
        if len(found) != 1:
            raise ValueError(
                f"group members have checkpoints at different steps {steps}; a group resumes "
                "only members at the same step: run the others in their own groups"
            )
        treedef = jax.tree.structure(state)
        restored = []
        for slot, m in enumerate(self.slots):
            assert m.checkpointer is not None
            _, leaves = m.checkpointer.restore(self._leaves(state, slot))
            restored.append(leaves)
        stacked = [
            _stack_leaf([r[i] for r in restored]) for i in range(len(restored[0]))
        ]
        shardings = jax.tree.leaves((self.shardings.params, self.shardings.opt_state,
                                     self.shardings.rest),
                                    is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        stacked = [jax.device_put(x, s) for x, s in zip(stacked, shardings, strict=True)]
        step = found.pop()
        assert step is not None
        return jax.tree.unflatten(treedef, stacked), min(step, self.spec.steps)

    def _save(self, state: tuple[PyTree, PyTree, PyTree], step: int) -> None:
        for slot, m in enumerate(self.slots):
            if m.result is None and m.checkpointer is not None:
                m.checkpointer.save(step, self._leaves(state, slot))

    def _batch(self) -> Any:
        batch = stack_batches([next(m.batches) for m in self.slots])  # type: ignore[arg-type]
        return jax.device_put(batch, self.shardings.batch)

    def _compile(self, step_fn: Any, state: tuple[PyTree, ...], batch: Any,
                 active: jax.Array) -> Any:
        t0 = time.monotonic()
        compiled = step_fn.lower(*state, batch, active).compile()
        self.compile_seconds += time.monotonic() - t0
        self.widths.append(len(self.slots))
        peak = peak_bytes(compiled)
        if peak is not None and peak > self.spec.memory_per_device:
            raise TrialOutOfMemory(
                f"compiled fused step of {len(self.slots)} members needs {peak} bytes per "
                f"device, budget is {self.spec.memory_per_device}", bytes_needed=peak)
        return compiled

    def _evaluate(self, state: tuple[PyTree, PyTree, PyTree], slot: int) -> dict[str, float]:
        params, _, rest = state
        return _evaluate(self.task, self.graphdef, member_slice(params, slot),
                         member_slice(rest, slot), self.plan)

    # ---- the loop

    def run(self) -> None:
        spec, plan = self.spec, self.plan
        self.graphdef = _check_architecture(self.space, [m.spec for m in self.members],
                                            plan.mesh)
        configs = [m.spec.params for m in self.members]
        optimizer = make_optimizer(configs[0])
        hyper = hyperparam_arrays(OPTIMIZER_KEYS, configs)
        arch = configs[0]
        state = fused_initial_state(
            lambda rngs: self.space.build(arch, rngs), optimizer,
            [m.spec.seed for m in self.members], hyper, plan.step_shardings, plan.mesh)
        for m in self.members:
            if m.spec.checkpoint_dir is not None:
                m.checkpointer = TrialCheckpointer(m.spec.checkpoint_dir)
        state, self.first = self._restore(state)
        batch_size = spec.plan.batch_size
        for m in self.members:
            m.batches = _batches(self.task, batch_size, m.spec.seed, None)
            for _ in range(self.first):  # the stream an uninterrupted run would be at
                next(m.batches)
            m.status.devices = tuple(d.id for d in plan.devices)
            m.status.model_parallel, m.status.batch_size = plan.model_parallel, batch_size
            m.status.predicted_peak_bytes = spec.plan.peak_bytes_per_device
        step_fn = jit_fused_step(self.graphdef, optimizer, self.task.loss_fn,
                                 plan.step_shardings, spec.mode)
        active_host = sent = np.ones(len(self.slots), bool)
        active = jax.device_put(sent, self.replicated)
        batch = self._batch()
        compiled = self._compile(step_fn, state, batch, active)
        now = time.monotonic()
        for m in self.members:
            m.status.training_since, m.status.first_step = now, self.first
            m.status.state, m.status.step = "training", self.first
        losses = None
        for step in range(self.first, spec.steps):
            if self.stop is not None and self.stop.is_set():
                self._save(state, step)
                for m in self.slots:
                    self._end(m, "interrupted", f"stopped at step {step}")
                return
            *new_state, losses = compiled(*state, batch, active)
            state = tuple(new_state)
            done = step + 1
            if done < spec.steps:
                batch = self._batch()
            if done % spec.log_every == 0 or done == spec.steps:
                active_host = self._read_losses(losses, done, active_host)
            for m in self.slots:
                if m.result is None:
                    m.status.step = done
            if spec.eval_every and done % spec.eval_every == 0 and done < spec.steps:
                active_host = self._intermediate(state, done, active_host)
                if not active_host.any():
                    return
                if spec.reform and not active_host.all():
                    state, batch = self._reform(state, batch, active_host)
                    active_host = sent = np.ones(len(self.slots), bool)
                    active = jax.device_put(sent, self.replicated)
                    compiled = self._compile(step_fn, state, batch, active)
            if not np.array_equal(sent, active_host):
                sent = active_host.copy()
                active = jax.device_put(sent, self.replicated)
            if spec.checkpoint_every and done % spec.checkpoint_every == 0:
                self._save(state, done)
            if not active_host.any():
                return
        self._finish(state)

    def _read_losses(self, losses: jax.Array, done: int, active: np.ndarray) -> np.ndarray:
        values = np.asarray(losses)
        active = active.copy()
        for slot, m in enumerate(self.slots):
            if m.result is not None or not active[slot]:
                continue
            loss = float(values[slot])
            m.status.loss = loss
            m.losses.append((done, loss))
            if self.on_loss is not None:
                self.on_loss(m.spec.number, done, loss)
            if not math.isfinite(loss):
                active[slot] = False
                m.status.step = done
                self._end(m, "failed", f"loss is {loss} at step {done}")
        return active

    def _intermediate(self, state: tuple[PyTree, ...], done: int,
                      active: np.ndarray) -> np.ndarray:
        active = active.copy()
        metric = self.task.metric
        for slot, m in enumerate(self.slots):
            if m.result is not None or not active[slot]:
                continue
            try:
                value = self._evaluate(state, slot)[metric]  # type: ignore[arg-type]
            except Exception as err:  # noqa: BLE001 - one member's failure ends that member
                active[slot] = False
                self._end(m, "failed", f"{type(err).__name__}: {err}".splitlines()[0][:300])
                continue
            m.status.metric = value
            if self.report is not None and self.report(m.spec.number, done, value):
                active[slot] = False
                self._end(m, "pruned", f"pruned at step {done} ({metric}={value:.4g})",
                          metrics={metric: value})
        return active

    def _reform(self, state: tuple[PyTree, ...], batch: Any,
                active: np.ndarray) -> tuple[tuple[PyTree, ...], Any]:
        """Drop inactive slots from the stacked state and the pending batch."""
        keep = np.flatnonzero(active)
        shard = self.shardings
        state = (_take(state[0], keep, shard.params), _take(state[1], keep, shard.opt_state),
                 _take(state[2], keep, shard.rest))
        batch = _take(batch, keep, shard.batch)
        self.slots = [self.slots[i] for i in keep]
        return state, batch

    def _finish(self, state: tuple[PyTree, ...]) -> None:
        steps = self.spec.steps
        for slot, m in enumerate(self.slots):
            if m.result is not None:
                continue
            m.status.step = steps
            try:
                m.status.state = "evaluating"
                metrics = self._evaluate(state, slot)  # type: ignore[arg-type]
                value = metrics[self.task.metric]
                if not math.isfinite(value):
                    raise FloatingPointError(f"{self.task.metric} is {value} after training")
            except Exception as err:  # noqa: BLE001 - one member's failure ends that member
                self._end(m, "failed", f"{type(err).__name__}: {err}".splitlines()[0][:300])
                continue
            m.status.metric = value
            final = None
            if m.checkpointer is not None:
                if m.checkpointer.latest_step() != steps:
                    m.checkpointer.save(steps, self._leaves(state, slot))  # type: ignore[arg-type]
                final = m.checkpointer.step_directory(steps)
            self._end(m, "complete", metrics=metrics, checkpoint=final)


def _stack_leaf(xs: Sequence[jax.Array]) -> jax.Array:
    if jax.dtypes.issubdtype(xs[0].dtype, jax.dtypes.prng_key):
        data = jnp.stack([jax.random.key_data(x) for x in xs])
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(xs[0]))
    return jnp.stack(xs)
