"""Evaluation on a trial's own mesh, in chunks whose compiled peak fits the trial's share.

A task that splits its evaluation into a forward pass and a score (the `ChunkedEvalTask`
methods ``eval_inputs``, ``eval_forward`` and ``score``) is evaluated here: the forward pass is
compiled with the plan's parameter shardings on the plan's mesh, the held-out inputs are cut into
chunks of ``chunk`` samples (a multiple of the data-parallel degree, the last chunk padded),
placed on the trial's devices split over ``'data'``, and the outputs are gathered to the host for
``score``. The result equals scoring the whole set in one batch: every sample's output depends
only on that sample.

While a trial evaluates, its optimizer state and the prefetched next training batch stay on its
devices beside the forward pass's own peak; `plan_eval` accounts for them.
`plan_eval` picks the chunk from shapes (the forward's jaxpr, `scamp_jax.planning.liveness`) and
compiles only that chunk, which the trial then runs: one compile of the forward per architecture
unless the shapes guessed too high (then one more, at the chunk the compiled figure allows).
Tasks without these methods keep their own ``evaluate(model)`` (run under the trial's mesh,
outside this accounting).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, runtime_checkable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scamp_jax._once import OncePerKey
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.compile_options import Purpose, device_options
from scamp_jax.planning.liveness import live_bytes
from scamp_jax.planning.reuse import compile_lowered, load_on_devices

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


def supports_chunked_eval(task: Any) -> TypeGuard[ChunkedEvalTask]:
    """True if ``task`` has the `ChunkedEvalTask` methods."""
    return isinstance(task, ChunkedEvalTask)


def abstract_eval_inputs(task: Any) -> tuple[jax.ShapeDtypeStruct, ...] | None:
    """``ShapeDtypeStruct`` of every group of ``task.eval_inputs()`` in the dtypes JAX gives
    such arrays (NumPy's float64 becomes float32 unless 64-bit mode is on), or None if
    unsupported."""
    if not supports_chunked_eval(task):
        return None
    return tuple(jax.ShapeDtypeStruct(
        x.shape, jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True))
        for x in task.eval_inputs())


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

    Its compiles use the evaluation's XLA options (`scamp_jax.planning.compile_options`, the
    same for the planner and the trial, so a planned chunk is the chunk the trial runs).
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
        #: per-device bytes of the parameters and other state the forward takes (from shapes)
        self.state_bytes = (sh.bytes_per_device(self.params, param_shardings)
                            + sh.bytes_per_device(self.rest, rest_shardings))
        self.options = device_options(mesh.devices.flat, Purpose.EVAL)
        self._live_per_sample: OncePerKey[float] = OncePerKey()

        def run(p: PyTree, r: PyTree, x: jax.Array) -> Any:
            model = nnx.merge(graphdef, p, r)
            model.eval()
            return forward(model, x)

        self._jitted = jax.jit(
            run,
            in_shardings=(param_shardings, rest_shardings, self.input_sharding),
            out_shardings=self.input_sharding,
        )
        # Trials of one architecture share an evaluator (`scamp_jax.hpo.runner.StepCache`) and
        # may evaluate at once: one of them compiles a chunk, the others wait for it.
        self._compiled: OncePerKey[Any] = OncePerKey()

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

        def make() -> Any:
            source = self.source
            theirs = None if source is None else dict(source._compiled.items()).get(key)
            if source is not None and theirs is not None:
                moved = load_on_devices(theirs, source.device_ids, list(self.mesh.devices.flat))
                if moved is not None:
                    return moved
            x = jax.ShapeDtypeStruct((chunk, *sample.shape[1:]), sample.dtype)
            with jax.set_mesh(self.mesh):
                lowered = self._jitted.lower(self.params, self.rest, x)
            return compile_lowered(lowered, self.options)

        return self._compiled.get(key, make)[0]

    def compiled_chunks(self) -> int:
        """Chunks (one per chunk size and group shape) compiled or loaded so far."""
        return len(self._compiled)

    def estimate(self, chunk: int, groups: Sequence[jax.ShapeDtypeStruct]) -> int:
        """Per-device bytes of the forward at ``chunk`` samples from shapes alone (nothing
        compiled), the most over ``groups``: the parameters and other state, the input chunk,
        and what its jaxpr holds at once (`scamp_jax.planning.liveness.live_bytes`, traced at
        one sample per data-parallel group, taken as proportional to the chunk and split over
        the ``'data'`` axis). An estimate: `plan_eval` compiles the chunk it picks with it."""
        dp = self.data_parallel
        most = 0
        for g in groups:
            size = min_chunk(chunk, g.shape[0], dp)
            sample = math.prod(g.shape[1:]) * g.dtype.itemsize
            most = max(most, round(size * (self._live_per_sample_of(g) + sample / dp)))
        return self.state_bytes + most

    def _live_per_sample_of(self, group: jax.ShapeDtypeStruct) -> float:
        """Per-device bytes per global sample the forward holds at once (``live_bytes`` of its
        jaxpr at ``dp`` samples, over ``dp`` samples and ``dp`` devices), traced once."""
        key = (tuple(group.shape[1:]), str(group.dtype))

        def make() -> float:
            dp = self.data_parallel
            x = jax.ShapeDtypeStruct((dp, *group.shape[1:]), group.dtype)
            with jax.set_mesh(self.mesh):
                traced = self._jitted.trace(self.params, self.rest, x)
            return live_bytes(traced.jaxpr) / dp / dp

        return self._live_per_sample.get(key, make)[0]

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


#: Factor on the shape estimate of the evaluation forward's bytes when picking a chunk
#: (`plan_eval`): compiled figures of three small SwinIRs' forwards were 0.76-1.30x of it.
EVAL_SHAPE_MARGIN = 1.5


def shape_chunk(compiler: EvalCompiler, groups: Sequence[jax.ShapeDtypeStruct],
                resident_bytes: int, budget_bytes: int) -> int:
    """The largest chunk (a multiple of the data-parallel degree, at most the largest group)
    whose estimate from shapes (`EvalCompiler.estimate` x `EVAL_SHAPE_MARGIN`) plus
    ``resident_bytes`` is within ``budget_bytes``; one sample per data-parallel group when
    none is. Nothing is compiled."""
    dp = compiler.data_parallel
    largest = -(-max(g.shape[0] for g in groups) // dp) * dp

    def fits(chunk: int) -> bool:
        return compiler.estimate(chunk, groups) * EVAL_SHAPE_MARGIN + resident_bytes <= (
            budget_bytes)

    if fits(largest):
        return largest
    low, high = dp, largest  # fits(low) or low == dp; not fits(high)
    while high - low > dp:
        mid = (low + high) // 2 // dp * dp
        if mid <= low:
            break
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def plan_eval(
    compiler: EvalCompiler,
    groups: Sequence[jax.ShapeDtypeStruct],
    resident_bytes: int,
    train_bytes: int,
) -> EvalPlan:
    """The chunk whose evaluation needs no more per device than training (``train_bytes``),
    or one sample per data-parallel group when even that needs more.

    The chunk is picked from shapes (`shape_chunk`) and compiled: that one compile is the
    chunk the trial runs. When its compiled peak is over, the line from the state alone
    (chunk 0) through it picks a smaller chunk, compiled next, down to one sample per
    data-parallel group.
    """
    before = compiler.compiled_chunks()
    dp = compiler.data_parallel
    chunk = shape_chunk(compiler, groups, resident_bytes, train_bytes)
    peak = compiler.peak(chunk, groups)
    while chunk > dp and peak + resident_bytes > train_bytes:
        slope = max(peak - compiler.state_bytes, 1) / chunk
        room = train_bytes - resident_bytes - compiler.state_bytes
        smaller = max(dp, min(int(room / slope) // dp * dp, chunk - dp))
        chunk, peak = smaller, compiler.peak(smaller, groups)
    return EvalPlan(chunk, peak, resident_bytes, compiler.compiled_chunks() - before)
