"""Evaluation on a trial's own mesh, in chunks whose compiled peak fits the trial's share.

A task that splits its evaluation into a forward pass and a score (the `ChunkedEvalTask`
methods ``eval_inputs``, ``eval_forward`` and ``score``) is evaluated here: the forward pass is
compiled with the plan's parameter shardings on the plan's mesh, the held-out inputs are cut into
chunks of ``chunk`` samples (a multiple of the data-parallel degree, the last chunk padded),
placed on the trial's devices split over ``'data'``, and the outputs are gathered to the host for
``score``. The result equals scoring the whole set in one batch: every sample's output depends
only on that sample.

While a trial evaluates, its optimizer state and the prefetched next training batch stay on its
devices beside the forward pass's own peak; `EvalBudget` and `choose_chunk` account for them.
Tasks without these methods keep their own ``evaluate(model)`` (run under the trial's mesh,
outside this accounting).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scamp_jax.planning import sharding as sh
from scamp_jax.planning.reuse import load_on_devices

PyTree = Any


@runtime_checkable
class ChunkedEvalTask(Protocol):
    """The optional `scamp_jax.space.Task` methods that let the runner plan evaluation."""

    def eval_inputs(self) -> Sequence[np.ndarray]:
        """Held-out inputs as groups of equal-shape samples, each ``(n, ...)``."""
        ...

    def eval_forward(self, model: nnx.Module, x: jax.Array) -> jax.Array:
        """The model's evaluation output for a batch ``x`` (traced inside ``jax.jit``)."""
        ...

    def score(self, outputs: Sequence[np.ndarray]) -> dict[str, float]:
        """Scores from the outputs of every group of `eval_inputs`, in the same order."""
        ...


def supports_chunked_eval(task: Any) -> bool:
    """True if ``task`` has the `ChunkedEvalTask` methods."""
    return isinstance(task, ChunkedEvalTask)


def abstract_eval_inputs(task: Any) -> tuple[jax.ShapeDtypeStruct, ...] | None:
    """``ShapeDtypeStruct`` of every group of ``task.eval_inputs()``, or None if unsupported."""
    if not supports_chunked_eval(task):
        return None
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in task.eval_inputs())


class EvalCompiler:
    """Compiles a task's evaluation forward pass on ``mesh`` with the plan's shardings.

    Args:
      graphdef: the model's graph (from `scamp_jax.planning.train_step.split_model`).
      forward: ``forward(model, x) -> outputs`` (a task's ``eval_forward``).
      params, rest: parameter and other state trees (arrays or ``ShapeDtypeStruct``s).
      param_shardings, rest_shardings: their shardings on ``mesh``.
      mesh: the trial's ``('data', 'model')`` mesh.
      source: an `EvalCompiler` of the same forward pass and shardings on other devices of the
        same count: the chunks it has compiled are loaded onto ``mesh`` instead of compiled
        where the platform allows (`scamp_jax.planning.reuse.load_on_devices`).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        forward: Callable[[nnx.Module, jax.Array], Any],
        params: PyTree,
        rest: PyTree,
        param_shardings: PyTree,
        rest_shardings: PyTree,
        mesh: Mesh,
        source: EvalCompiler | None = None,
    ) -> None:
        self.mesh = mesh
        self.source = source
        self.forward = forward
        self.data_parallel = int(mesh.shape.get(sh.DATA_AXIS, 1))
        self.input_sharding = NamedSharding(mesh, PartitionSpec(sh.DATA_AXIS))
        self.params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rest)

        def run(p: PyTree, r: PyTree, x: jax.Array) -> Any:
            model = nnx.merge(graphdef, p, r)
            model.eval()
            return forward(model, x)

        self._jitted = jax.jit(
            run,
            in_shardings=(param_shardings, rest_shardings, self.input_sharding),
            out_shardings=self.input_sharding,
        )
        self._compiled: dict[tuple[int, tuple[int, ...], str], Any] = {}

    @property
    def device_ids(self) -> tuple[int, ...]:
        """The devices its programs are compiled for, in mesh order."""
        return tuple(d.id for d in self.mesh.devices.flat)

    def serves(self, forward: Callable[[nnx.Module, jax.Array], Any],
               device_ids: tuple[int, ...]) -> bool:
        """Whether it compiles ``forward`` (a function or a bound method: same function and
        owner) on exactly ``device_ids``, so that its compiled chunks can be run for it."""
        mine, theirs = self.forward, forward
        same = (getattr(mine, "__func__", mine) is getattr(theirs, "__func__", theirs)
                and getattr(mine, "__self__", None) is getattr(theirs, "__self__", None))
        return same and self.device_ids == tuple(device_ids)

    def compiled(self, chunk: int, sample: jax.ShapeDtypeStruct) -> Any:
        """The forward pass compiled for ``chunk`` samples shaped like ``sample[1:]``."""
        if chunk < 1 or chunk % self.data_parallel:
            raise ValueError(
                f"eval chunk {chunk} must be a positive multiple of the data-parallel degree "
                f"{self.data_parallel}"
            )
        key = (chunk, tuple(sample.shape[1:]), str(sample.dtype))
        if key not in self._compiled:
            source = self.source
            if source is not None and key in source._compiled:
                self._compiled[key] = load_on_devices(
                    source._compiled[key], source.device_ids, list(self.mesh.devices.flat))
            if self._compiled.get(key) is None:
                x = jax.ShapeDtypeStruct((chunk, *sample.shape[1:]), sample.dtype)
                with jax.set_mesh(self.mesh):
                    self._compiled[key] = self._jitted.lower(self.params, self.rest,
                                                             x).compile()
        return self._compiled[key]

    def peak(self, chunk: int, groups: Sequence[jax.ShapeDtypeStruct]) -> int:
        """Largest compiled peak per device (bytes) over the groups at ``chunk`` samples."""
        return max(_peak(self.compiled(min_chunk(chunk, g.shape[0], self.data_parallel), g))
                   for g in groups)

    def run(
        self, chunk: int, params: PyTree, rest: PyTree, groups: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """Outputs of every group, computed ``chunk`` samples at a time on the mesh's devices."""
        outputs = []
        for group in groups:
            n = group.shape[0]
            size = min_chunk(chunk, n, self.data_parallel)
            compiled = self.compiled(size, jax.ShapeDtypeStruct(group.shape, group.dtype))
            parts = []
            for start in range(0, n, size):
                piece = group[start:start + size]
                real = piece.shape[0]
                if real < size:  # pad the last chunk: one compile per group
                    pad = np.repeat(piece[-1:], size - real, axis=0)
                    piece = np.concatenate([piece, pad])
                x = jax.device_put(piece, self.input_sharding)
                out = compiled(params, rest, x)
                parts.append(jax.tree.map(lambda a, r=real: np.asarray(a)[:r], out))
            outputs.append(jax.tree.map(lambda *a: np.concatenate(a), *parts))
        return outputs


def min_chunk(chunk: int, n: int, dp: int) -> int:
    """``chunk`` samples, but no more than ``n`` rounded up to a multiple of ``dp``."""
    return min(chunk, -(-n // dp) * dp)


def _peak(compiled: Any) -> int:
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("XLA gives no memory analysis on this backend; cannot size eval chunks")
    return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes
               + stats.output_size_in_bytes - stats.alias_size_in_bytes)


@dataclass(frozen=True)
class EvalPlan:
    """The evaluation chunk and what it holds per device, bytes.

    Attributes:
      chunk: samples per forward call (a multiple of the data-parallel degree).
      peak_bytes: compiled peak of the forward pass at ``chunk`` (parameters, other state, the
        input chunk, outputs, temporaries).
      resident_bytes: what else stays on the device meanwhile (optimizer state, prefetched batch).
      compiles: forward compiles the choice made.
    """

    chunk: int
    peak_bytes: int
    resident_bytes: int
    compiles: int = 0

    @property
    def total_bytes(self) -> int:
        """Per-device bytes while evaluating: ``peak_bytes + resident_bytes``."""
        return self.peak_bytes + self.resident_bytes


def choose_chunk(
    compiler: EvalCompiler,
    groups: Sequence[jax.ShapeDtypeStruct],
    resident_bytes: int,
    budget_bytes: int,
    start: int | None = None,
) -> EvalPlan:
    """The largest chunk found (a multiple of the data-parallel degree, at most ``start``,
    default the largest group) whose compiled peak plus ``resident_bytes`` is within
    ``budget_bytes``.

    Compiles one sample per data-parallel group and ``start``; if ``start`` does not fit, the
    line through the two peaks (the forward's peak is close to affine in the chunk) gives the
    next size, halved until it fits. When even the smallest chunk does not fit, its figures are
    returned (the caller compares `EvalPlan.total_bytes` with its budget).
    """
    dp = compiler.data_parallel
    before = len(compiler._compiled)

    def done(chunk: int, peak: int) -> EvalPlan:
        return EvalPlan(chunk, peak, resident_bytes, len(compiler._compiled) - before)

    largest = max(g.shape[0] for g in groups)
    start = largest if start is None else start
    start = max(dp, min(-(-start // dp) * dp, -(-largest // dp) * dp))
    low = compiler.peak(dp, groups)
    if start == dp or low + resident_bytes > budget_bytes:
        return done(dp, low)
    high = compiler.peak(start, groups)
    if high + resident_bytes <= budget_bytes:
        return done(start, high)
    slope = (high - low) / (start - dp)
    room = budget_bytes - resident_bytes - low
    chunk = dp + int(room / slope) // dp * dp if slope > 0 else dp
    chunk = max(dp, min(chunk, start - dp))
    while chunk > dp:
        peak = compiler.peak(chunk, groups)
        if peak + resident_bytes <= budget_bytes:
            return done(chunk, peak)
        chunk = max(dp, chunk // 2 // dp * dp)
    return done(dp, low)


def plan_eval(
    compiler: EvalCompiler,
    groups: Sequence[jax.ShapeDtypeStruct],
    resident_bytes: int,
    train_bytes: int,
) -> EvalPlan:
    """The chunk whose evaluation needs no more per device than training (``train_bytes``),
    or one sample per data-parallel group when even that needs more (`choose_chunk`)."""
    before = len(compiler._compiled)
    low = compiler.peak(compiler.data_parallel, groups) + resident_bytes
    chosen = choose_chunk(compiler, groups, resident_bytes, max(train_bytes, low))
    return replace(chosen, compiles=len(compiler._compiled) - before)
