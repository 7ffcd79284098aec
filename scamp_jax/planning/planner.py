"""Memory-aware planning: the mesh, shardings and batch size for training a model on devices.

``plan_mesh`` tries model-parallel degrees in increasing order (the divisors of the device
count); the first degree whose training step fits at one sample per data-parallel group wins, and
then the largest global batch that fits is found. "Fits" means the compiled per-device peak
(``scamp_jax.planning.memory``) plus the prefetched next batch is at most the budget's
`scamp_jax.planning.budget.Budget.plan_bytes` (the pool less the safety margin and the
allowance for memory XLA does not see); with an ``eval_task``, evaluation (forward pass at its
planned chunk, optimizer state, prefetched batch) fits too (`Plan.predicted_peak_bytes`).

The batch search lets the memory model choose each compile and the compiles decide: it starts at
the batch the known points predict, or, for a new architecture, at the largest batch an estimate
from shapes alone predicts to fit (the traced backward residuals per sample), compiled exactly as
the answer; it moves by the line through the compiled points nearest the fit/no-fit boundary (one
point: proportional to the bytes beyond the persistent state), and stops when it holds a batch
that fits and the next multiple of the data-parallel degree does not (or the cap), either
compiled or put over the budget by a line: the one between the two compiles that bracket the
boundary, or, when nothing above the answer was compiled, the answer's figure plus the smallest
slope estimated from below. Memory is only piecewise affine in the batch (flat at small batches,
jumps where XLA changes strategy), so a prediction never decides a fit: the answer is always
compiled, and when secant steps stall, bisection takes over. One compile for a new architecture
whose first guess fits and whose next batch the line puts over the budget, two in the common
case otherwise (the guess and the answer beside it); fewer when earlier compiles of the same
program on the same mesh shape are known (``cache=``), none for a cached plan. On CPU only the
batches the model predicts to be the answer are compiled exactly; the others (a step up that
shows the answer is the largest) are rough compiles
(``scamp_jax.planning.memory.CPU_ROUGH_COMPILE``, 1.5-3x cheaper, peaks within 512 bytes),
trusted only further than ``ROUGH_TOLERANCE`` of the budget from the boundary and compiled again
exactly otherwise, and always when one turns out to be the answer. Degrees whose
parameters and optimizer state alone exceed the budget are rejected from shapes, without
compiling.

Planning only compiles: it allocates nothing and runs nothing on any device.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scamp_jax._units import format_bytes
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.budget import DEFAULT_SAFETY_MARGIN, Budget
from scamp_jax.planning.evaluation import EvalCompiler, abstract_eval_inputs, plan_eval
from scamp_jax.planning.memory import (
    ROUGH_TOLERANCE,
    MemoryEstimate,
    MemoryModel,
    StepCompiler,
    affine_fit,
    default_step_shardings,
    with_batch_size,
)
from scamp_jax.planning.plan_cache import (
    PlanCache,
    cache_key,
    device_identity,
    program_signature,
    resolve_allowance,
)
from scamp_jax.planning.reuse import lowered_fingerprint
from scamp_jax.planning.train_step import (
    LossFn,
    StepShardings,
    StepSource,
    abstract_state,
    default_optimizer,
    jit_train_step,
)
from scamp_jax.scheduling.booking import solo_bytes

PyTree = Any

#: Largest global batch considered when ``max_batch_size`` is not given.
DEFAULT_BATCH_CAP = 1 << 16
#: Safety loop bound for the batch search (secant steps, then bisection, converge far sooner).
_MAX_SEARCH_COMPILES = 40
#: Secant steps before the batch search falls back to bisection.
_SECANT_STEPS = 8


@dataclass(frozen=True)
class CompiledStep:
    """The planner's ahead-of-time compiled training step, for the runner to run as is.

    Attributes:
      executable: a ``jax.stages.Compiled`` of the step at the plan's batch, compiled with
        default XLA options (what the runner would compile) on the plan's devices.
      fingerprint: SHA-256 of the lowered program's text; the runner runs ``executable`` only
        when its own lowering of the step has the same fingerprint (same program, shapes,
        shardings).
      device_ids: the devices it was compiled for, in mesh order (an XLA executable is bound to
        its devices; a plan moved elsewhere keeps it for these: on CPU the run loads it onto
        its own devices, elsewhere it compiles its own).
    """

    executable: Any
    fingerprint: str
    device_ids: tuple[int, ...]


class DoesNotFitError(ValueError):
    """The model does not fit on the given devices even at the smallest batch.

    Attributes:
      bytes_needed: the smallest per-device peak found, in bytes (over model-parallel degrees).
      bytes_available: the usable bytes per device (``memory_per_device`` less the margin).
    """

    def __init__(self, message: str, bytes_needed: int, bytes_available: int) -> None:
        super().__init__(message)
        self.bytes_needed = bytes_needed
        self.bytes_available = bytes_available


@dataclass(frozen=True)
class Plan:
    """How to train one model on a fixed set of devices (a decision; holds no arrays).

    Attributes:
      mesh: ``Mesh`` of shape ``(data_parallel, model_parallel)``, axes ``('data', 'model')``.
      data_parallel, model_parallel: the mesh degrees; their product is ``len(devices)``.
      param_shardings: a ``NamedSharding`` per parameter, a tree matching
        ``nnx.state(model, nnx.Param)``.
      batch_sharding: sharding of every batch leaf (leading axis over ``'data'``).
      step_shardings: shardings of all training-step arguments (for ``jit_train_step``).
      batch_size: global batch size, a multiple of ``data_parallel``.
      peak_bytes_per_device: compiled peak at ``batch_size``, bytes.
      memory_per_device: the budget per device, bytes; ``safety_margin`` the fraction held back.
      estimate: the memory breakdown at ``batch_size``.
      memory_model: affine bytes-vs-batch fit on this mesh.
      devices: the devices, in mesh order.
      planning_seconds, compiles: what planning cost (wall-clock seconds, number of compiles).
      compiled_peaks: ``(global batch, peak bytes per device)`` of every compiled point on the
        chosen mesh that the search used, in the order it learnt them (points known from the
        plan cache first); on CPU all but ``batch_size`` may be rough figures (see above).
      compiled_step: the step compiled at ``batch_size`` for the runner (`CompiledStep`), or
        None (CPU plans by default compile faster code-generation settings than a run wants;
        cached plans compile nothing).
      cached: True when the plan came from a `PlanCache` without compiling.
      step_source: the jitted training step the planner lowered at ``batch_size`` (a
        `scamp_jax.planning.train_step.StepSource` of `jit_train_step`), for a trial that would
        make the same step to take instead of tracing its own; None for a plan that lowered
        no step (cached or provisional).
      prefetch_bytes: per-device bytes of one training batch at ``batch_size``: the next batch
        is placed on the devices while the current step runs.
      eval_chunk: held-out samples per evaluation forward call (0: evaluation not planned).
      eval_peak_bytes: compiled peak per device of the evaluation forward at ``eval_chunk``.
      evaluator: the `EvalCompiler` that sized the evaluation, holding its compiled chunks
        (for its own devices, ``evaluator.device_ids``), for a trial to evaluate with: as is on
        those devices, loaded onto its own on other CPU devices (None: not planned).
      allowance_bytes: bytes per device set aside for memory XLA's figures do not include (CUDA
        context, cuBLAS/cuDNN workspaces), measured per device kind
        (`scamp_jax.planning.plan_cache.resolve_allowance`); 0 on CPU.
      provisional: the batch and figures are an estimate from shapes, not compiled
        (``plan_mesh(..., provisional=True)``): good for sizing a fused group, whose compiled
        step checks it, not for training alone.

    `predicted_peak_bytes` is the most a trial of this plan holds on a device at any time:
    training (compiled step + prefetched batch) or evaluation (forward pass + optimizer state +
    prefetched batch), whichever is larger; the batch search keeps it within `usable_bytes`.
    """

    mesh: Mesh
    data_parallel: int
    model_parallel: int
    param_shardings: PyTree
    batch_sharding: NamedSharding
    step_shardings: StepShardings
    batch_size: int
    peak_bytes_per_device: int
    memory_per_device: int
    safety_margin: float
    estimate: MemoryEstimate
    memory_model: MemoryModel
    devices: tuple[jax.Device, ...]
    planning_seconds: float = field(default=0.0, compare=False)
    compiles: int = field(default=0, compare=False)
    compiled_peaks: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    compiled_step: CompiledStep | None = field(default=None, compare=False, repr=False)
    cached: bool = field(default=False, compare=False)
    step_source: StepSource | None = field(default=None, compare=False, repr=False)
    prefetch_bytes: int = 0
    eval_chunk: int = 0
    eval_peak_bytes: int = 0
    evaluator: Any = field(default=None, compare=False, repr=False)
    allowance_bytes: int = 0
    provisional: bool = field(default=False, compare=False)

    @property
    def train_bytes(self) -> int:
        """Per-device bytes while training: the compiled step's peak + the prefetched batch."""
        return self.peak_bytes_per_device + self.prefetch_bytes

    @property
    def eval_bytes(self) -> int:
        """Per-device bytes while evaluating: the forward's peak + optimizer state + prefetched
        batch (0 when evaluation was not planned)."""
        if not self.eval_chunk:
            return 0
        return self.eval_peak_bytes + self.estimate.opt_state + self.prefetch_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        """Most bytes per device the trial holds: ``max(train_bytes, eval_bytes)`` plus the
        allowance for memory XLA does not see (``allowance_bytes``), by the byte rule the
        scheduler books with (`scamp_jax.scheduling.booking.solo_bytes`)."""
        return solo_bytes(self.peak_bytes_per_device, self.prefetch_bytes,
                          eval_peak=self.eval_peak_bytes if self.eval_chunk else 0,
                          opt_state=self.estimate.opt_state, allowance=self.allowance_bytes)

    @property
    def budget(self) -> Budget:
        """The budget the plan was made for (pool, margin and allowance per device)."""
        return Budget(self.memory_per_device, self.safety_margin, self.allowance_bytes)

    @property
    def usable_bytes(self) -> int:
        """Bytes per device that a plan may use: the budget less the safety margin."""
        return self.budget.usable_bytes

    def describe(self) -> str:
        """A short human-readable table of the plan."""
        e = self.estimate
        kinds = sorted({d.platform for d in self.devices})
        rows = [
            ("devices", f"{len(self.devices)} ({', '.join(kinds)})"),
            ("mesh (data x model)", f"{self.data_parallel} x {self.model_parallel}"),
            ("global batch", f"{self.batch_size} ({self.batch_size // self.data_parallel}"
             " per data-parallel group)"),
            ("peak per device", f"{format_bytes(self.predicted_peak_bytes)} of "
             f"{format_bytes(self.usable_bytes)} usable"),
            ("  training step", format_bytes(self.peak_bytes_per_device)),
            ("  prefetched batch", format_bytes(self.prefetch_bytes)),
            ("  evaluation", f"{format_bytes(self.eval_bytes)} (chunk {self.eval_chunk})"
             if self.eval_chunk else "not planned"),
            ("budget per device", f"{format_bytes(self.memory_per_device)} "
             f"(margin {self.safety_margin:.0%})"),
            ("  parameters", format_bytes(e.params)),
            ("  optimizer state", format_bytes(e.opt_state)),
            ("  inputs", format_bytes(e.inputs)),
            ("  activations+temps", format_bytes(e.activations_and_temps)),
            ("bytes per sample", format_bytes(self.memory_model.bytes_per_sample)),
            ("planning", f"{self.planning_seconds:.2f} s, {self.compiles} compiles"),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def with_devices(self, devices: Sequence[jax.Device]) -> Plan:
        """The same decision (degrees, specs, batch) on other devices of the same count.

        Devices fill the new mesh in the order given, like the original. The compiled step
        and evaluation stay, still for the devices they were compiled for
        (``compiled_step.device_ids``, ``evaluator.device_ids``): a run takes them as is there
        and loads them onto other CPU devices without compiling
        (`scamp_jax.planning.reuse.ExecutableCache`, `scamp_jax.hpo.runner.StepCache`).
        """
        devices = tuple(devices)
        if len(devices) != len(self.devices):
            raise ValueError(
                f"the plan is for {len(self.devices)} devices but {len(devices)} were given; "
                f"re-plan with plan_mesh(..., devices={len(devices)}) for a different count"
            )
        _check_distinct(devices)
        mesh = sh.make_mesh(devices, self.data_parallel, self.model_parallel)

        def remap(tree: PyTree) -> PyTree:
            return jax.tree.map(
                lambda s: NamedSharding(mesh, s.spec, memory_kind=s.memory_kind),
                tree,
                is_leaf=lambda x: isinstance(x, NamedSharding),
            )

        step = self.step_shardings
        return replace(
            self,
            mesh=mesh,
            param_shardings=remap(self.param_shardings),
            batch_sharding=remap(self.batch_sharding),
            step_shardings=StepShardings(
                params=remap(step.params),
                opt_state=remap(step.opt_state),
                rest=remap(step.rest),
                batch=remap(step.batch),
            ),
            devices=devices,
        )


def resolve_devices(devices: Sequence[jax.Device] | int | None) -> tuple[jax.Device, ...]:
    """The device tuple for ``devices``: all JAX devices, the first ``n`` of them, or the list."""
    if devices is None:
        return tuple(jax.devices())
    if isinstance(devices, bool | str) or not (
        isinstance(devices, int) or hasattr(devices, "__iter__")
    ):
        raise TypeError(
            f"devices must be a list of jax devices or a device count, got {devices!r}"
        )
    if isinstance(devices, int):
        available = jax.devices()
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} must be between 1 and the {len(available)} available "
                f"{available[0].platform} devices; pass a count in that range or a device list"
            )
        return tuple(available[:devices])
    result = tuple(devices)
    if not result:
        raise ValueError("devices is an empty list; pass at least one device or a count")
    for d in result:
        if not isinstance(d, jax.Device):
            raise TypeError(f"devices must hold jax.Device objects, got {d!r}")
    _check_distinct(result)
    return result


def _check_distinct(devices: Sequence[jax.Device]) -> None:
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices must be distinct, got ids {ids}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _check_model(model: nnx.Module) -> None:
    params = nnx.state(model, nnx.Param)
    if not jax.tree.leaves(params):
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param variables, so there is nothing to plan; "
            "check that its layers are attributes of the module (not in a plain list or dict "
            "of non-NNX containers)"
        )


def _check_sample_batch(sample_batch: PyTree) -> None:
    leaves = jax.tree.leaves(sample_batch)
    if not leaves:
        raise ValueError("sample_batch has no arrays; pass an array or a tuple (inputs, targets)")
    for leaf in leaves:
        if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
            raise ValueError(
                f"every sample_batch leaf needs a leading sample axis, got {leaf!r}; "
                "pass arrays or jax.ShapeDtypeStruct shaped (batch, ...)"
            )


def compile_step(
    step: jax.stages.Wrapped,
    compiler: StepCompiler,
    batch_size: int,
    options: dict[str, Any] | None,
) -> tuple[MemoryEstimate, jax.stages.Compiled, jax.stages.Lowered]:
    """Compile ``step`` (``compiler``'s training step) at global ``batch_size``; nothing runs.

    Returns the per-device memory (`MemoryEstimate`, bytes), the executable and its lowering.
    ``options`` are XLA compile options (None: defaults, what a training run compiles).
    """
    return compiler.compile(batch_size, options, step)


@dataclass
class _Search:
    """Compiled peaks known so far for one mesh (mutable, private to one plan).

    ``seen`` may start with points from a `PlanCache` (compiled earlier, same program and mesh
    shape); ``compiles`` counts the compiles this search made. Batches in ``rough`` were compiled
    with ``rough_options`` (cheaper, figures within ``tolerance`` bytes of exact ones): they guide
    the search and decide fit or no fit only when their need is more than ``tolerance`` away from
    ``usable``; otherwise, and for the answer, the batch is compiled exactly.
    """

    compiler: StepCompiler
    usable: int
    step: jax.stages.Wrapped
    options: dict[str, Any] | None
    seen: dict[int, MemoryEstimate] = field(default_factory=dict)
    #: executable, lowering and whether it was compiled with default XLA options (run grade)
    executables: dict[int, tuple[jax.stages.Compiled, jax.stages.Lowered, bool]] = field(
        default_factory=dict
    )
    compiles: int = 0
    #: per-device bytes of the prefetched next batch per global sample (exactly linear).
    prefetch_per_sample: float = 0.0
    #: compile the batches the memory model predicts to be the answer with default XLA options
    #: (when ``options`` are faster ones), so that the answer's executable is the runner's.
    run_grade_answers: bool = False
    rough_options: dict[str, Any] | None = None
    tolerance: int = 0
    rough: set[int] = field(default_factory=set)
    #: the batch step of the search: a multiple of the data-parallel degree (0: that degree).
    unit: int = 0

    def __post_init__(self) -> None:
        self.unit = self.unit or self.compiler.data_parallel

    def peak(self, batch: int, answer: bool = False) -> MemoryEstimate:
        """The compiled memory at ``batch`` (compiled now if not known); ``answer``: the memory
        model predicts ``batch`` to be the largest that fits (compiled exactly)."""
        if batch not in self.seen:
            if answer or self.rough_options is None:
                self._compile(batch, exact=True, answer=answer)
            else:
                self._compile(batch, exact=False, answer=False)
        return self.seen[batch]

    def make_exact(self, batch: int, answer: bool = False) -> None:
        """Compile a rough point again, exactly."""
        if batch in self.rough:
            self._compile(batch, exact=True, answer=answer)

    def _compile(self, batch: int, exact: bool, answer: bool) -> None:
        run_grade = exact and (self.options is None or (answer and self.run_grade_answers))
        options = None if run_grade else self.options if exact else self.rough_options
        estimate, compiled, lowered = compile_step(self.step, self.compiler, batch, options)
        self.compiles += 1
        self.seen[batch] = estimate
        self.executables[batch] = (compiled, lowered, run_grade)
        if exact:
            self.rough.discard(batch)
        else:
            self.rough.add(batch)

    def prefetch(self, batch: int) -> int:
        return round(self.prefetch_per_sample * batch)

    def shape_guess(self, cap: int) -> int:
        """The largest multiple of the unit up to ``cap`` that fits by an estimate from shapes
        alone (no compile; 0 if none): the persistent state, the gradients and one more
        parameter-sized update buffer, plus per sample the traced backward residuals and the
        batch (`StepCompiler.traced_bytes_per_sample`) and the prefetched batch. An estimate,
        not a bound: the batch it names is compiled before anything is decided.
        """
        line = self.shape_line()
        room = self.usable - line.fixed_bytes
        if room < 0:
            return 0
        per_sample = line.bytes_per_sample + self.prefetch_per_sample
        best = cap if per_sample <= 0 else min(cap, int(room // per_sample))
        return best // self.unit * self.unit

    def shape_line(self) -> MemoryModel:
        """The step's peak against the batch from shapes alone (what `shape_guess` assumes,
        without the prefetched batch): the persistent state, the gradients and one more
        parameter-sized buffer, plus the traced backward residuals and the batch per sample."""
        compiler = self.compiler
        return MemoryModel(
            fixed_bytes=float(compiler.state_bytes + 2 * compiler.params_bytes),
            bytes_per_sample=compiler.traced_bytes_per_sample(), probe_batches=(),
            probe_peaks=(), batch_multiple=compiler.data_parallel)

    def slope_below(self, batch: int) -> float:
        """Per-device bytes per global sample just above the compiled ``batch``, estimated
        from below: the smallest of the line through ``batch`` and the next smaller compiled
        batch, the one-point line (the bytes beyond the persistent state and the parameters
        taken as proportional to the batch) and the traced slope from shapes (computed only
        when the others leave it to decide). Memory grows faster, not slower, at larger
        batches where XLA changes strategy (flat at small batches, then jumps up), so the
        smallest of these tends to under-state the slope above ``batch``.
        """
        compiler = self.compiler
        peak = self.seen[batch].peak
        estimates = [(peak - compiler.state_bytes - compiler.params_bytes) / batch]
        below = [b for b in self.seen if b < batch]
        if below:
            b0 = max(below)
            estimates.append((peak - self.seen[b0].peak) / (batch - b0))
        return min(estimates)

    def need(self, batch: int) -> int:
        """Per-device bytes of training at ``batch``: compiled peak + prefetched batch."""
        return self.peak(batch).peak + self.prefetch(batch)

    def fits(self, batch: int) -> bool:
        """Whether ``batch`` fits (a rough point too close to call is compiled exactly)."""
        need = self.need(batch)
        if batch in self.rough and abs(need - self.usable) <= self.tolerance:
            self.make_exact(batch)
            need = self.need(batch)
        return need <= self.usable

    def affine(self, a: int, b: int) -> MemoryModel:
        return affine_fit(self.seen[a], self.seen[b], self.compiler.data_parallel)

    def bracket(self, cap: int) -> tuple[int | None, int]:
        """``(lo, hi)``: the smallest known batch that does not fit (``cap + unit`` if none)
        and the largest known multiple of ``unit`` below it that fits (None if none)."""
        dp = self.unit
        over = [b for b in list(self.seen) if b <= cap and not self.fits(b)]
        hi = min(over, default=cap + dp)
        under = [b for b in list(self.seen) if b < hi and b % dp == 0 and self.fits(b)]
        return max(under, default=None), hi


class _NoFit(Exception):
    """Even one sample per data-parallel group does not fit this mesh."""


def _largest_batch(search: _Search, cap: int) -> int:
    """Largest multiple of the search's unit in ``[unit, cap]`` that fits, such that the next
    one does not.

    Each compile is chosen by the memory model through the known points (`_next_guess`); the
    answer ``lo`` is returned only when ``lo`` fits and ``lo + unit`` (or a smaller batch) was
    compiled and does not (or ``lo == cap``). Raises `_NoFit` when ``unit`` itself does not fit.
    """
    dp = search.unit
    secant_steps = 0
    while True:
        lo, hi = search.bracket(cap)
        if lo is not None and (hi - lo <= dp or _line_proves_largest(search, lo, hi)):
            return lo
        if lo is None and hi == dp:
            raise _NoFit
        if search.compiles >= _MAX_SEARCH_COMPILES:
            raise RuntimeError(
                f"batch search did not converge in {_MAX_SEARCH_COMPILES} compiles (fits at "
                f"{lo}, not at {hi}); pass max_batch_size to bound it"
            )
        guess = None
        answer = False
        if secant_steps < _SECANT_STEPS:
            secant_steps += len(search.seen) >= 2
            guess = _model_guess(search, lo, hi, cap)
            # A guess other than the step up from a fitting batch is the prediction of the
            # answer: the first from shapes, later ones from the known points.
            answer = guess is not None and (guess == cap or not search.seen or lo is None
                                            or guess != lo + dp)
        if guess is None:  # bisection
            low = lo if lo is not None else 0
            guess = max(dp, low + ((hi - low) // dp // 2) * dp)
        search.peak(guess, answer)


def _line_proves_largest(search: _Search, lo: int, hi: int) -> bool:
    """Whether a line through compiled points puts the next batch up, ``lo + unit``, over the
    usable bytes; ``lo`` is exact and fits.

    With a compiled ``hi`` that does not fit, the line between the two; otherwise (``lo`` is
    the largest batch compiled) the figure at ``lo`` plus the slope estimated from below
    (`_Search.slope_below`), and the traced slope from shapes too. The step up is then not
    compiled: the answer is compiled exactly (its figures are the plan's and it fits for
    certain), and only its being the largest rests on the line. Memory is piecewise affine in
    the batch, so a line errs where XLA changes strategy; the cost of such an error is a batch
    a step or two smaller than the largest, never one that does not fit.
    """
    if lo in search.rough or lo not in search.seen:
        return False
    nxt = lo + search.unit
    if hi in search.seen:
        line = search.affine(lo, hi)
        predicted = line.fixed_bytes + line.bytes_per_sample * nxt + search.prefetch(nxt)
        return line.bytes_per_sample > 0 and predicted > search.usable
    peak = search.seen[lo].peak

    def over(slope: float) -> bool:
        return slope > 0 and peak + slope * search.unit + search.prefetch(nxt) > search.usable

    # the traced slope is the dearer estimate (two traces): only when the others agree
    return over(search.slope_below(lo)) and over(search.compiler.traced_bytes_per_sample())


def _exact_largest(search: _Search, cap: int) -> int | None:
    """`_largest_batch` whose answer is compiled exactly (its figures are the plan's); None
    when not even the search's unit fits."""
    try:
        while True:
            batch = _largest_batch(search, cap)
            if batch not in search.rough:
                return batch
            # the answer's figures are the plan's: compile it exactly, then look again
            search.make_exact(batch, answer=True)
    except _NoFit:
        return None


def _model_guess(search: _Search, lo: int | None, hi: int, cap: int) -> int | None:
    """The next batch to compile as the memory model through the known points predicts it,
    strictly inside ``(lo, hi)``, a multiple of the search's unit; None when the points say
    nothing useful (then bisect)."""
    dp = search.unit
    seen = search.seen
    low = lo if lo is not None else 0
    if not seen:
        # compiled exactly as the answer: one compile when it fits and the step up does not
        return max(dp, search.shape_guess(cap))
    if len(seen) == 1:
        # One point: the bytes beyond the persistent state and the gradients taken as
        # proportional to the batch (activations); exact when they dominate, as in
        # convolutional and attention models, an over-estimate of the slope otherwise.
        (b0, e0), = seen.items()
        base = search.compiler.state_bytes + search.compiler.params_bytes
        if e0.peak <= base:
            return None
        lines = [MemoryModel(
            fixed_bytes=float(base), bytes_per_sample=(e0.peak - base) / b0,
            probe_batches=(b0,), probe_peaks=(e0.peak,), batch_multiple=dp,
        )]
    else:
        lines = _candidate_lines(search, lo, hi)
    fallback = None
    for line in lines:
        if line.bytes_per_sample <= 0:
            continue
        # the prefetched batch adds its bytes per sample to the compiled slope
        line = replace(line, bytes_per_sample=line.bytes_per_sample + search.prefetch_per_sample)
        predicted = line.max_batch(search.usable, cap=cap) // dp * dp
        if low + dp <= predicted <= hi - dp:
            return predicted
        if fallback is None:
            fallback = min(max(predicted, low + dp), hi - dp)
    return fallback


def _candidate_lines(search: _Search, lo: int | None, hi: int) -> list[MemoryModel]:
    """Pure lines (no floor), best first: through the two latest compiles (secant), the two
    largest batches that fit (the local slope below the boundary), and the bracket's ends."""
    order = list(search.seen)  # insertion order: cached points first, then compiles
    pairs = [(order[-2], order[-1])]
    fitting = sorted(b for b in search.seen if lo is not None and b <= lo)
    if len(fitting) >= 2:
        pairs.append((fitting[-2], fitting[-1]))
    if lo is not None and hi in search.seen:
        pairs.append((lo, hi))
    return [replace(search.affine(a, b), floor_bytes=0.0) for a, b in pairs]


def _shape_figures(search: _Search, batch: int) -> tuple[MemoryEstimate, MemoryModel]:
    """The step's memory at ``batch`` and its line from shapes alone (`_Search.shape_line`).
    The compiled figures (``temp``, ``argument``, ``output``, ``alias``) are 0: nothing was
    compiled."""
    compiler, line = search.compiler, search.shape_line()
    peak = line.predict(batch)
    inputs = sh.bytes_per_device(with_batch_size(compiler.sample_batch, batch),
                                 compiler.shardings.batch)
    estimate = MemoryEstimate(
        batch_size=batch, params=compiler.params_bytes, grads=compiler.params_bytes,
        opt_state=compiler.opt_state_bytes, rest=compiler.rest_bytes, inputs=inputs,
        activations_and_temps=peak - compiler.state_bytes - inputs, peak=peak,
        temp=0, argument=0, output=0, alias=0,
    )
    return estimate, line


def _local_fit(search: _Search, lo: int, hi: int) -> MemoryModel:
    """Affine model through the compiled points that bracket the fit/no-fit boundary."""
    if hi in search.seen:
        return search.affine(lo, hi)
    below = sorted(b for b in search.seen if b <= lo)
    if len(below) >= 2:
        return search.affine(below[-2], below[-1])
    only = search.seen[lo]
    slope = max(0.0, search.slope_below(lo))  # one compile: the slope estimated from below
    return MemoryModel(
        fixed_bytes=only.peak - slope * lo,
        bytes_per_sample=slope,
        probe_batches=(lo,),
        probe_peaks=(only.peak,),
        batch_multiple=search.compiler.data_parallel,
    )


def plan_budget(
    memory_per_device: int | float | str | Budget | None,
    devices: Sequence[jax.Device],
    safety_margin: float | None = None,
    allowance_bytes: int | None = None,
    cache: PlanCache | None = None,
) -> Budget:
    """The `Budget` a plan on ``devices`` fits into (the one place ``plan_mesh`` reads it).

    ``memory_per_device``: a `Budget` (used as it is, its margin and allowance included), bytes
    or a text like ``"2GiB"``, or None (the devices' ``bytes_limit``). ``safety_margin``: None
    for the Budget's own, else 0.1. ``allowance_bytes``: None for the Budget's own, or for the
    allowance stored in ``cache`` for these devices' kind
    (`scamp_jax.planning.plan_cache.resolve_allowance`).
    """
    if isinstance(memory_per_device, Budget):
        budget = memory_per_device
        if safety_margin is not None and safety_margin != budget.safety_margin:
            raise ValueError(
                f"{safety_margin=} differs from the budget's {budget.safety_margin}; pass the "
                "margin in the Budget (Budget(..., safety_margin=...)) or leave it out")
        return budget if allowance_bytes is None else budget.with_allowance(allowance_bytes)
    margin = DEFAULT_SAFETY_MARGIN if safety_margin is None else safety_margin
    budget = Budget.of_devices(devices, memory_per_device, safety_margin=margin)
    # Memory outside XLA's buffer assignment, measured per device kind: booked with the plan.
    return budget.with_allowance(resolve_allowance(allowance_bytes, devices, cache))


def _validate_common(
    model: nnx.Module,
    sample_batch: PyTree,
    max_batch_size: int | None,
) -> None:
    _check_model(model)
    _check_sample_batch(sample_batch)
    if max_batch_size is not None and (
        isinstance(max_batch_size, bool)
        or not isinstance(max_batch_size, int)
        or max_batch_size < 1
    ):
        raise ValueError(f"{max_batch_size=} must be a positive int or None")


def plan_mesh(
    model: nnx.Module,
    sample_batch: PyTree,
    *,
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | float | str | Budget | None = None,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: LossFn | None = None,
    safety_margin: float | None = None,
    max_batch_size: int | None = None,
    model_parallel: int | None = None,
    min_shard_elements: int = sh.MIN_SHARD_ELEMENTS,
    cache: PlanCache | None = None,
    compile_for_run: bool | None = None,
    eval_task: Any = None,
    batch_multiple: int = 1,
    allowance_bytes: int | None = None,
    provisional: bool = False,
) -> Plan:
    """Plan training of ``model`` on exactly ``devices``: mesh, shardings and largest batch.

    Args:
      model: a Flax NNX module, real or abstract (``nnx.eval_shape(lambda: Model(...))``).
      sample_batch: arrays or ``ShapeDtypeStruct``s shaped ``(B, ...)``; only the per-sample
        shapes and dtypes are used (an array, or a tuple whose first element is the input).
      devices: a list of devices, a count (the first ``n`` of ``jax.devices()``), or None (all).
      memory_per_device: budget per device: a `scamp_jax.planning.budget.Budget` (with its
        margin and allowance), bytes or a string like ``"2GiB"``; default the device's
        ``bytes_limit`` on GPUs; required on CPU.
      optimizer: optax transformation (default Adam via ``optax.inject_hyperparams``).
      loss_fn: ``loss_fn(model, batch) -> scalar`` (default: mean squared output).
      safety_margin: fraction of ``memory_per_device`` held back (allocator fragmentation,
        runtime buffers; None: the Budget's, else 0.1); a plan's compiled peak is at most the
        budget's ``usable_bytes`` less the allowance (`Budget.plan_bytes`).
      max_batch_size: cap on the global batch (default ``DEFAULT_BATCH_CAP``).
      model_parallel: force this model-parallel degree (must divide the device count).
      min_shard_elements: parameters with fewer elements are replicated.
      cache: a `PlanCache`: a plan stored under the same key is returned without compiling, a
        new plan is stored, and compiled points of the same program and mesh shape seed the
        batch search (see `scamp_jax.planning.plan_cache`).
      compile_for_run: keep the step compiled at the plan's batch with default XLA options as
        ``plan.compiled_step`` for the runner (default True). On accelerators the search
        compiles with default options anyway, so it is free. On CPU the search compiles with
        fast code-generation settings (LLVM level 0: half the compile time, half-speed code);
        with it, the batches the memory model predicts to be the answer are compiled with
        default options instead, so a plan takes as many compiles as without it (the
        answer's a slower, run-grade one) and a trial on the planned devices none
        (`scamp_jax.planning.reuse.ExecutableCache`); one more (run-grade) compile only when
        the prediction missed. False: planning only, at the fast settings. A plan answered
        by ``cache`` compiles nothing and has no compiled step.
      eval_task: a task with the `scamp_jax.planning.evaluation.ChunkedEvalTask` methods: its
      evaluation
        forward is compiled on the same mesh and its chunk chosen (`Plan.eval_chunk`) so that
        evaluating never needs more per device than training, unless one sample per
        data-parallel group already does; None (or a task without them): not planned.
      batch_multiple: the batch is also a multiple of this (with the data-parallel degree:
        their least common multiple) when one such batch fits, so that a trial can later run on
        more devices with the same batch (a batch of 41 cannot be split over 2 or 4 devices;
        one of 40 can). Default 1: any multiple of the data-parallel degree.

    Every plan counts the prefetched next batch: the step's compiled peak plus one batch
    (and, with ``eval_task``, the evaluation's bytes) fit within the usable bytes.

    Returns:
      A ``Plan`` with the smallest model-parallel degree that fits and the largest global batch
      (a multiple of the data-parallel degree) whose compiled peak fits, such that the next
      multiple does not fit (unless the cap is reached).

      allowance_bytes: bytes per device held back for memory XLA does not see (added to the
        plan's predicted peak); None: the allowance measured for these devices' kind and stored
        in ``cache`` (0 on CPU, or when none was measured).
      provisional: when the estimate from shapes alone (`_Search.shape_guess`) puts the batch
        cap within the budget, return the cap at once, without compiling the training step
        (the evaluation is still planned): a ``Plan`` with ``provisional=True``, whose figures
        are that estimate, no compiled step, and which is not stored in ``cache``. For a member
        of a fused group, whose own compiled fused step checks the fit
        (`scamp_jax.planning.fusion.plan_fusion`); a trial that trains alone on it must be
        planned again without it. When the shapes leave the cap out of reach, the batch is
        searched as usual and the plan is not provisional.

    Raises:
      DoesNotFitError: no degree fits even at one sample per data-parallel group.
      ValueError, TypeError: bad arguments (raised before any compile).
    """
    start = time.perf_counter()
    devs = resolve_devices(devices)
    n = len(devs)
    _validate_common(model, sample_batch, max_batch_size)
    if isinstance(batch_multiple, bool) or not isinstance(batch_multiple, int) or (
            batch_multiple < 1):
        raise ValueError(f"{batch_multiple=} must be a positive int")
    if model_parallel is not None:
        if isinstance(model_parallel, bool) or not isinstance(model_parallel, int):
            raise TypeError(f"model_parallel must be an int, got {model_parallel!r}")
        if model_parallel < 1 or n % model_parallel:
            raise ValueError(
                f"{model_parallel=} must divide the device count {n}; choose one of "
                f"{_divisors(n)}"
            )
        candidates = [model_parallel]
    else:
        candidates = _divisors(n)
    budget = plan_budget(memory_per_device, devs, safety_margin, allowance_bytes, cache)
    usable, allowance = budget.plan_bytes, budget.allowance_bytes
    safety_margin = budget.safety_margin
    optimizer = optimizer if optimizer is not None else default_optimizer()
    cap = max_batch_size if max_batch_size is not None else DEFAULT_BATCH_CAP
    if all(cap < n // mp for mp in candidates):
        raise ValueError(
            f"max_batch_size={cap} is smaller than every data-parallel degree "
            f"{[n // mp for mp in candidates]} on {n} devices; raise it to at least "
            f"{min(n // mp for mp in candidates)} or use fewer devices"
        )
    params, opt_state, rest = abstract_state(model, optimizer)
    eval_groups = abstract_eval_inputs(eval_task) if eval_task is not None else None
    key = None
    if cache is not None:
        signature = program_signature(model, sample_batch, optimizer, loss_fn)
        identity = device_identity(devs)
        key = cache_key({
            "kind": "plan", "signature": signature, "devices": identity,
            "memory_per_device": budget.memory_per_device, "safety_margin": safety_margin,
            "cap": cap,
            "model_parallel": model_parallel, "min_shard_elements": min_shard_elements,
            "batch_multiple": batch_multiple, "allowance": allowance,
            "eval": None if not eval_groups else {
                "forward": getattr(eval_task.eval_forward, "__qualname__", ""),
                "inputs": [[list(x.shape), str(x.dtype)] for x in eval_groups],
            },
        })
        record = cache.get_plan(key)
        if record is not None:
            return _plan_from_record(
                record, devs, params, opt_state, rest, optimizer, budget, min_shard_elements,
                start,
            )
    compiles = 0
    best_need: tuple[int, str] | None = None
    for mp in candidates:
        dp = n // mp
        if cap < dp:
            continue
        mesh = sh.make_mesh(devs, dp, mp)
        shardings = default_step_shardings(
            mesh, params, opt_state, rest, optimizer, min_shard_elements=min_shard_elements
        )
        compiler = StepCompiler(model, sample_batch, mesh, shardings, optimizer, loss_fn)
        if compiler.state_bytes > usable:
            need = (compiler.state_bytes, f"parameters + optimizer state at model_parallel={mp}")
            best_need = need if best_need is None or need[0] < best_need[0] else best_need
            continue
        step = jit_train_step(compiler.graphdef, compiler.optimizer, compiler.loss_fn, shardings)
        one_sample = sh.bytes_per_device(with_batch_size(sample_batch, dp), shardings.batch)
        want_step = compile_for_run if compile_for_run is not None else True
        search = _Search(compiler, usable, step, compiler.compiler_options,
                         prefetch_per_sample=one_sample / dp, run_grade_answers=want_step,
                         rough_options=compiler.rough_options,
                         tolerance=int(ROUGH_TOLERANCE * usable))
        mp_cap = (cap // dp) * dp
        evaluator, eval_floor = None, 0
        if eval_groups:
            evaluator = EvalCompiler(compiler.graphdef, eval_task.eval_forward, params, rest,
                                     shardings.params, shardings.rest, mesh)
            eval_floor = evaluator.peak(dp, eval_groups) + compiler.opt_state_bytes
            compiles += len(eval_groups)
            # while evaluating, the prefetched batch stays too: it bounds the batch
            room = usable - eval_floor
            mp_cap = min(mp_cap, int(room // search.prefetch_per_sample) // dp * dp
                         if search.prefetch_per_sample > 0 else mp_cap)
            if mp_cap < dp:
                need = (eval_floor + search.prefetch(dp),
                        f"evaluation at {dp} sample(s) with model_parallel={mp}")
                best_need = need if best_need is None or need[0] < best_need[0] else best_need
                continue
        peaks_key = None
        if cache is not None:
            peaks_key = cache_key({
                "kind": "peaks", "signature": signature,
                "devices": {**identity, "count": n}, "mesh": [dp, mp],
                "min_shard_elements": min_shard_elements,
            })
            for b, r in sorted(cache.get_peaks(peaks_key).items()):
                r = dict(r)
                if r.pop("rough", False):
                    search.rough.add(b)
                search.seen[b] = MemoryEstimate(**r)
        known = set(search.seen)
        known_rough = set(search.rough)
        search.unit = math.lcm(dp, batch_multiple)
        if (mp_cap // search.unit) * search.unit < search.unit:
            search.unit = dp  # the cap leaves no multiple: plain data-parallel steps
        top = (mp_cap // search.unit) * search.unit
        shaped = provisional and top >= search.unit and search.shape_guess(top) >= top
        if shaped:
            # The shapes put the cap in reach: no step compiled here (a fused group's
            # compiled step checks the fit; a trial alone is planned again).
            batch = top
            estimate, memory_model = _shape_figures(search, batch)
            compiled_step = None
        else:
            batch = _exact_largest(search, top)
            if batch is None and search.unit > dp:
                # not even one multiple fits: the largest plain data-parallel batch instead
                search.unit = dp
                batch = _exact_largest(search, mp_cap)
            compiles += search.compiles
            if cache is not None and peaks_key is not None:
                cache.put_peaks(peaks_key, {
                    b: {**_estimate_record(e), "rough": b in search.rough}
                    for b, e in search.seen.items()
                    if b not in known or (b in known_rough and b not in search.rough)
                })
            if batch is None:
                need = (search.need(dp), f"peak at batch {dp} with model_parallel={mp}, "
                        "prefetched batch included")
                best_need = need if best_need is None or need[0] < best_need[0] else best_need
                continue
            _, hi = search.bracket((mp_cap // search.unit) * search.unit)
            memory_model = _local_fit(search, batch, hi)
            estimate = search.seen[batch]
            compiled_step = None
            if want_step:
                if batch in search.executables and search.executables[batch][2]:
                    executable, lowered, _ = search.executables[batch]
                else:
                    run_estimate, executable, lowered = compile_step(step, compiler, batch,
                                                                     None)
                    compiles += 1
                    if run_estimate.peak != estimate.peak:
                        # Code-generation settings are not meant to change buffer assignment;
                        # if they do, the run's own figure is the one that must fit.
                        estimate = run_estimate
                compiled_step = CompiledStep(
                    executable, lowered_fingerprint(lowered), tuple(d.id for d in devs)
                )
        prefetch = search.prefetch(batch)
        eval_plan = None
        if evaluator is not None:
            eval_plan = plan_eval(evaluator, eval_groups, compiler.opt_state_bytes + prefetch,
                                  estimate.peak + prefetch)
            compiles += eval_plan.compiles
        plan = Plan(
            mesh=mesh,
            data_parallel=dp,
            model_parallel=mp,
            param_shardings=shardings.params,
            batch_sharding=shardings.batch,
            step_shardings=shardings,
            batch_size=batch,
            peak_bytes_per_device=estimate.peak,
            memory_per_device=budget.memory_per_device,
            safety_margin=safety_margin,
            estimate=estimate,
            memory_model=memory_model,
            devices=devs,
            planning_seconds=time.perf_counter() - start,
            compiles=compiles,
            compiled_peaks=tuple((b, e.peak) for b, e in search.seen.items()),
            compiled_step=compiled_step,
            step_source=None if shaped else StepSource(
                step, compiler.graphdef, compiler.optimizer, compiler.loss_fn, shardings),
            prefetch_bytes=prefetch,
            eval_chunk=eval_plan.chunk if eval_plan else 0,
            eval_peak_bytes=eval_plan.peak_bytes if eval_plan else 0,
            evaluator=evaluator if eval_plan else None,
            allowance_bytes=allowance,
            provisional=shaped,
        )
        if not shaped and cache is not None and key is not None and (
                plan.predicted_peak_bytes - allowance <= usable):
            cache.put_plan(key, _plan_record(plan))
        return plan
    assert best_need is not None
    needed, what = best_need
    raise DoesNotFitError(
        f"{type(model).__name__} does not fit on {n} device(s): it needs at least "
        f"{needed} bytes ({format_bytes(needed)}) per device ({what}) but {usable} bytes "
        f"({format_bytes(usable)}) are available ({format_bytes(budget.memory_per_device)} "
        f"less a {safety_margin:.0%} margin"
        + (f" and a {format_bytes(allowance)} allowance" if allowance else "")
        + "); use more devices, more memory_per_device, or a smaller model",
        bytes_needed=needed,
        bytes_available=usable,
    )


def _estimate_record(estimate: MemoryEstimate) -> dict[str, Any]:
    record = asdict(estimate)
    record.pop("compile_seconds")
    return record


def _plan_record(plan: Plan) -> dict[str, Any]:
    """What a `PlanCache` stores of a plan: the decision and its compiled figures."""
    return {
        "data_parallel": plan.data_parallel,
        "model_parallel": plan.model_parallel,
        "batch_size": plan.batch_size,
        "estimate": _estimate_record(plan.estimate),
        "memory_model": {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(plan.memory_model).items()
        },
        "compiled_peaks": [list(p) for p in plan.compiled_peaks],
        "prefetch_bytes": plan.prefetch_bytes,
        "eval_chunk": plan.eval_chunk,
        "eval_peak_bytes": plan.eval_peak_bytes,
    }


def _plan_from_record(
    record: dict[str, Any],
    devs: tuple[jax.Device, ...],
    params: PyTree,
    opt_state: PyTree,
    rest: PyTree,
    optimizer: optax.GradientTransformation,
    budget: Budget,
    min_shard_elements: int,
    start: float,
) -> Plan:
    """A cached plan on ``devs``: mesh and shardings rebuilt from the sharding rules."""
    dp, mp = int(record["data_parallel"]), int(record["model_parallel"])
    mesh = sh.make_mesh(devs, dp, mp)
    shardings = default_step_shardings(
        mesh, params, opt_state, rest, optimizer, min_shard_elements=min_shard_elements
    )
    estimate = MemoryEstimate(**record["estimate"])
    model = record["memory_model"]
    memory_model = MemoryModel(
        fixed_bytes=float(model["fixed_bytes"]),
        bytes_per_sample=float(model["bytes_per_sample"]),
        probe_batches=tuple(int(b) for b in model["probe_batches"]),
        probe_peaks=tuple(int(p) for p in model["probe_peaks"]),
        batch_multiple=int(model["batch_multiple"]),
        floor_bytes=float(model["floor_bytes"]),
    )
    return Plan(
        mesh=mesh,
        data_parallel=dp,
        model_parallel=mp,
        param_shardings=shardings.params,
        batch_sharding=shardings.batch,
        step_shardings=shardings,
        batch_size=int(record["batch_size"]),
        peak_bytes_per_device=estimate.peak,
        memory_per_device=budget.memory_per_device,
        safety_margin=budget.safety_margin,
        estimate=estimate,
        memory_model=memory_model,
        devices=devs,
        planning_seconds=time.perf_counter() - start,
        compiles=0,
        compiled_peaks=tuple((int(b), int(p)) for b, p in record["compiled_peaks"]),
        cached=True,
        prefetch_bytes=int(record.get("prefetch_bytes", 0)),
        eval_chunk=int(record.get("eval_chunk", 0)),
        eval_peak_bytes=int(record.get("eval_peak_bytes", 0)),
        allowance_bytes=budget.allowance_bytes,
    )


def min_devices_plan(
    model: nnx.Module,
    sample_batch: PyTree,
    *,
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | float | str | None = None,
    counts: Sequence[int] | None = None,
    **plan_kwargs: Any,
) -> tuple[int, Plan]:
    """The fewest devices (a prefix of ``devices``) on which a plan exists, and that plan.

    ``counts`` restricts the device counts tried (default ``1 .. len(devices)``, increasing),
    e.g. powers of two. Other keyword arguments go to ``plan_mesh``. Raises ``DoesNotFitError``
    (with the figures for the largest count) when no count works.
    """
    devs = resolve_devices(devices)
    budget = (memory_per_device if isinstance(memory_per_device, Budget)
              else Budget.of_devices(devs, memory_per_device).memory_per_device)
    tried = sorted(set(counts)) if counts is not None else list(range(1, len(devs) + 1))
    if not tried or tried[0] < 1 or tried[-1] > len(devs):
        raise ValueError(
            f"counts={counts} must be device counts between 1 and {len(devs)}"
        )
    last_error: DoesNotFitError | None = None
    for count in tried:
        try:
            plan = plan_mesh(
                model, sample_batch, devices=devs[:count], memory_per_device=budget,
                **plan_kwargs,
            )
        except DoesNotFitError as err:
            last_error = err
            continue
        return count, plan
    assert last_error is not None
    raise last_error


def min_devices(
    model: nnx.Module,
    sample_batch: PyTree,
    *,
    devices: Sequence[jax.Device] | int | None = None,
    memory_per_device: int | float | str | None = None,
    **plan_kwargs: Any,
) -> int:
    """The fewest devices on which ``plan_mesh`` finds a plan (see ``min_devices_plan``)."""
    count, _ = min_devices_plan(
        model, sample_batch, devices=devices, memory_per_device=memory_per_device, **plan_kwargs
    )
    return count
