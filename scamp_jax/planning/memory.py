"""Training memory per device, from abstract shapes and XLA's compiled memory analysis.

- Parameters, optimizer state and the model's other state come from ``nnx.eval_shape`` /
  ``jax.eval_shape`` and the planned shardings: nothing is allocated.
- Activations and temporaries come from compiling the training step
(``scamp_jax.planning.train_step``,
  the same step the runner trains with) on abstract arguments for the target mesh and reading
  ``compiled.memory_analysis()``; XLA reports per-device sizes for sharded programs.
- The peak per device is ``temp + argument + output - alias`` (donated parameters and optimizer
  state alias their updated values).

Memory is close to affine in the batch size once activations outgrow the buffers XLA needs
anyway (below that it is flat), so ``fit_memory_model`` compiles two probe sizes, fits
``fixed_bytes + bytes_per_sample * batch`` and checks the fit with a third compile. The fit is
within a few percent over a range of batches, but XLA changes strategy at some sizes (a jump of
about 12% was seen on CPU), so the planner confirms its pick by compiling.
The options of every compile are chosen in `scamp_jax.planning.compile_options`.
On CPU, planning compiles use LLVM optimisation level 0 (``CPU_FAST_COMPILE``): same buffer
assignment, roughly half the compile time. The planner's guidance compiles (batches it only
needs to place the fit/no-fit boundary, not to report) also turn off XLA's MLIR fusion emitters
(``CPU_ROUGH_COMPILE``): 1.5-3x cheaper again, but XLA then fuses a few operations differently,
so the figure is close, not equal (``ROUGH_TOLERANCE``). XLA releases without that option
(jax 0.12 and later) have no rough setting: every compile is exact there (``cpu_rough_options``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Final, Literal

import jax
import optax
from flax import nnx
from jax import export
from jax.sharding import Mesh

from scamp_jax._units import format_bytes
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.compile_options import (
    Purpose,
    cpu_rough_options,
    device_options,
    platform_of,
)
from scamp_jax.planning.reuse import compile_lowered
from scamp_jax.planning.train_step import (
    LossFn,
    StepShardings,
    abstract_state,
    default_loss,
    default_optimizer,
    jit_train_step,
    placed,
    split_model,
)

PyTree = Any
log = logging.getLogger(__name__)

#: Largest difference, as a fraction of the budget, that the planner allows between a rough and
#: an exact peak: a rough figure within this of the usable bytes decides nothing (the planner
#: compiles that batch exactly). Tests pin rough figures far inside it.
ROUGH_TOLERANCE = 0.005


@dataclass(frozen=True)
class MemoryEstimate:
    """Training memory of one step on one device, in bytes, at global batch ``batch_size``.

    ``params``, ``grads``, ``opt_state``, ``rest`` (RNG state, batch statistics) and ``inputs`` (the
    batch) are exact per-device sizes from shapes and shardings. ``peak`` is the compiled peak
    ``temp + argument + output - alias``; ``activations_and_temps`` is what the peak holds beyond
    the persistent state and the batch: activations saved for the backward pass, gradients, and
    XLA's scratch buffers (``temp``), plus outputs that do not alias an input. ``grads`` is listed
    for reference (gradients have the parameters' shardings); it is part of
    ``activations_and_temps``, because XLA may fuse a gradient into the update and never hold it
    whole. The raw compiled figures are kept in ``temp``, ``argument``, ``output`` and ``alias``.
    """

    batch_size: int
    params: int
    grads: int
    opt_state: int
    rest: int
    inputs: int
    activations_and_temps: int
    peak: int
    temp: int
    argument: int
    output: int
    alias: int
    compile_seconds: float = field(default=0.0, compare=False)

    @property
    def state(self) -> int:
        """Persistent bytes per device: parameters + optimizer state + other model state."""
        return self.params + self.opt_state + self.rest

    def describe(self) -> str:
        """A short table of the breakdown, one item per line."""
        rows = [
            ("parameters", self.params),
            ("gradients (in temps)", self.grads),
            ("optimizer state", self.opt_state),
            ("other model state", self.rest),
            ("inputs", self.inputs),
            ("activations + temps", self.activations_and_temps),
            ("peak", self.peak),
        ]
        lines = [f"memory per device at global batch {self.batch_size}:"]
        lines += [f"  {name:<22}{format_bytes(value):>12}" for name, value in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class MemoryModel:
    """Per-device peak bytes as a function of the global batch size.

    ``predict(b) = max(floor_bytes, fixed_bytes + bytes_per_sample * b)``, fitted from compiles at
    ``probe_batches`` (whose compiled peaks are ``probe_peaks``). The affine part describes large
    batches, where activations grow with the batch; ``floor_bytes`` (the peak at the smallest
    probe) covers small ones, where XLA fits the activations into buffers it needs anyway (the
    gradients, the optimizer update) and memory stays flat. Batches are multiples of
    ``batch_multiple`` (the data-parallel degree).
    """

    fixed_bytes: float
    bytes_per_sample: float
    probe_batches: tuple[int, ...]
    probe_peaks: tuple[int, ...]
    batch_multiple: int = 1
    floor_bytes: float = 0.0

    def predict(self, batch_size: int) -> int:
        """Predicted peak bytes per device at global ``batch_size``."""
        affine = self.fixed_bytes + self.bytes_per_sample * batch_size
        return int(math.ceil(max(self.floor_bytes, affine)))

    def max_batch(self, budget_bytes: int, cap: int | None = None) -> int:
        """Largest multiple of ``batch_multiple`` predicted to fit ``budget_bytes`` (0 if none).

        ``cap`` bounds the answer (rounded down to a multiple). With no per-sample growth the
        answer is ``cap``, which must then be given.
        """
        k = self.batch_multiple
        if self.floor_bytes > budget_bytes:
            return 0
        if self.bytes_per_sample <= 0:
            if cap is None:
                raise ValueError(
                    "memory does not grow with the batch size, so the largest batch is unbounded; "
                    "pass cap= (e.g. the data set size)"
                )
            best = cap
        else:
            best = int((budget_bytes - self.fixed_bytes) // self.bytes_per_sample)
            if cap is not None:
                best = min(best, cap)
        best = (best // k) * k
        while best > 0 and self.predict(best) > budget_bytes:  # guard float rounding
            best -= k
        return max(best, 0)


def with_batch_size(sample_batch: PyTree, batch_size: int) -> PyTree:
    """``ShapeDtypeStruct`` tree of ``sample_batch``, each leading axis set to ``batch_size``,
    in the dtypes JAX gives such arrays (NumPy's float64 becomes float32 unless 64-bit mode is
    on), so that the batch's bytes are those the devices hold."""
    leaves = jax.tree.leaves(sample_batch)
    if not leaves:
        raise ValueError("the sample batch has no arrays; pass an array or a tuple of arrays")
    for leaf in leaves:
        if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
            raise ValueError(
                f"every batch leaf needs a leading sample axis, got {leaf!r}; "
                "pass arrays shaped (batch, ...)"
            )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (batch_size, *x.shape[1:]),
            jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True)),
        sample_batch)


def _growth_per_group(total: Callable[[Any], Any], dp: int) -> int | None:
    """``total(2 * dp) - total(dp)`` from one trace: ``total`` (bytes of a traced program's
    values against its global batch) at the symbolic batch ``dp * b``, ``1 <= b <= 2``, whose
    bounds (``jax.export.symbolic_dim_bounds``) are its figures at ``b = 1`` and ``b = 2`` when
    it is a polynomial in ``b`` with no negative coefficient (`_plain_polynomial`: sizes
    that only grow with the batch). None, and the caller traces twice, where this JAX has no
    such bounds (jax 0.10.2 has none, 0.11.2 has), the model's code needs a concrete batch (a
    Python branch on an inequality of it, ``int()`` of it), or the sizes hold ``mod``,
    ``floordiv``, ``max`` or a negative term (padding the batch to a multiple, say), whose
    bounds JAX gives loosely. A model that compares the batch for equality traces the branch
    a batch of ``dp * b`` takes for ``b`` unknown (JAX decides ``==`` as "not provably
    equal")."""
    bounds = getattr(export, "symbolic_dim_bounds", None)
    if bounds is None:
        return None
    (b,) = export.symbolic_shape("b", constraints=("b <= 2",))
    try:
        size = total(dp * b)
        if not export.is_symbolic_dim(size):
            return 0
        if not _plain_polynomial(size):
            return None
        low, high = bounds(size)
    except Exception as err:  # noqa: BLE001 - any failure of the model's code: trace concretely
        log.debug("no trace at a symbolic batch (%s: %s); tracing at two batches",
                  type(err).__name__, err)
        return None
    if not all(isinstance(x, int) for x in (low, high)):
        return None  # an infinite bound: not a figure
    return high - low


#: What a shape error while the loss is traced asks the user to check (`tracing_note`).
_TRACING_ADVICE = ("check that the sample batch has a leading batch axis and then one sample's "
                   "shape as the model takes it, and that the loss is loss_fn(model, batch) -> "
                   "scalar")


@contextlib.contextmanager
def tracing_note(batch: PyTree) -> Iterator[None]:
    """Name ``batch``'s shapes in a ``TypeError`` or ``ValueError`` raised while the loss is
    traced on it (JAX's shape errors name the operation, not the input): a plain one is raised
    again, of its type, as ``traced on a batch of N samples, each [...]: <message>`` (one
    sample's shapes: the planner traces at batch sizes of its own; a trial's failure reason
    and a command line's error show it) with what to check as a note; another keeps its
    message and gets both as a note."""
    try:
        yield
    except (TypeError, ValueError) as err:
        leaves = jax.tree.leaves(batch)
        sizes = {x.shape[0] if x.shape else None for x in leaves}
        if len(sizes) == 1 and None not in sizes:
            shapes = ", ".join(f"{tuple(x.shape[1:])} {x.dtype}" for x in leaves)
            where = f"traced on a batch of {sizes.pop()} samples, each [{shapes}]"
        else:
            shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in leaves)
            where = f"traced on a batch of [{shapes}]"
        if type(err) in (TypeError, ValueError):
            named = type(err)(f"{where}: {err}")
            named.add_note(f"({_TRACING_ADVICE})")
            raise named from err
        err.add_note(f"({where}: {_TRACING_ADVICE})")
        raise


def _plain_polynomial(expr: Any) -> bool:
    """Whether the symbolic dimension expression ``expr`` is a polynomial with no negative
    coefficient and no ``mod``, ``floordiv``, ``max``, ``min`` (JAX has no public accessor of
    an expression's terms; its text, e.g. ``"137822208*b + 249776"``, names each operation as
    a function and each negative term with a minus sign). Its bounds over ``1 <= b <= 2`` are
    then its values at the ends."""
    text = str(expr)
    return "(" not in text and "-" not in text


class _Default(Enum):
    """Defaults told apart from None (an enum member: the type checker narrows on it)."""

    OPTIONS = "default"


#: `StepCompiler.compile`'s default: the compiler's own options.
_DEFAULT_OPTIONS: Final = _Default.OPTIONS

class StepCompiler:
    """Compiles the training step on abstract arguments for one mesh and sharding choice.

    Holds the split model, the abstract state trees and the jitted step so that probes at several
    batch sizes only re-lower and re-compile; nothing is allocated on any device.
    """

    def __init__(
        self,
        model: nnx.Module,
        sample_batch: PyTree,
        mesh: Mesh,
        shardings: StepShardings | None = None,
        optimizer: optax.GradientTransformation | None = None,
        loss_fn: LossFn | None = None,
    ) -> None:
        self.mesh = mesh
        self.optimizer = optimizer if optimizer is not None else default_optimizer()
        self.loss_fn = loss_fn if loss_fn is not None else default_loss
        self.sample_batch = sample_batch
        self.graphdef, _, _ = split_model(model)
        self.params, self.opt_state, self.rest = abstract_state(model, self.optimizer)
        if not jax.tree.leaves(self.params):
            raise ValueError(
                f"{type(model).__name__} has no nnx.Param variables, so there is nothing to "
                "train; check that its layers are attributes of the module"
            )
        if shardings is None:
            shardings = default_step_shardings(
                mesh, self.params, self.opt_state, self.rest, self.optimizer
            )
        self.shardings = shardings
        self.data_parallel = int(mesh.shape.get(sh.DATA_AXIS, 1))
        self.params_bytes = sh.bytes_per_device(self.params, shardings.params)
        self.opt_state_bytes = sh.bytes_per_device(self.opt_state, shardings.opt_state)
        self.rest_bytes = sh.bytes_per_device(self.rest, shardings.rest)
        self._traced_per_sample: float | None = None
        self._step = jit_train_step(self.graphdef, self.optimizer, self.loss_fn, shardings)
        platform = platform_of(mesh.devices.flat)
        devices = list(mesh.devices.flat)
        #: options of guidance compiles (`scamp_jax.planning.compile_options`: on CPU LLVM
        #: level 0, which changes code speed, not buffer assignment; on GPU no autotuning; a
        #: GPU target's own on top)
        self.compiler_options = device_options(devices, Purpose.GUIDE)
        #: options of the compile of the planner's answer (on CPU the run's own)
        self.answer_options = device_options(devices, Purpose.ANSWER)
        #: options of the run's own compile of the step
        self.run_options = device_options(devices, Purpose.RUN)
        #: options of rough (guidance-only) compiles; None where there is no cheaper setting
        self.rough_options = cpu_rough_options() if platform == "cpu" else None

    def traced_bytes_per_sample(self) -> float:
        """Per-device bytes per global sample that the loss's backward pass keeps, from shapes.

        The residuals of ``jax.vjp`` of the loss (what autodiff saves for the backward pass)
        and the batch itself, over one more sample per data-parallel group: traced once with
        ``jax.eval_shape`` at a symbolic batch (`_growth_per_group`), or at one and two samples
        per group and differenced where the model's code needs a concrete batch; nothing is
        compiled. An estimate of the compiled slope, not a bound: XLA fuses some of these
        intermediates away (a transformer's compiled slope is 0.76x this figure) and adds
        backward-pass temporaries of its own (the small SwinIR's compiled slope is 0.96-1.25x
        it). Traced once per compiler.
        """
        if self._traced_per_sample is not None:
            return self._traced_per_sample
        dp = self.data_parallel
        graphdef, loss_fn = self.graphdef, self.loss_fn

        def residuals(params: PyTree, rest: PyTree, batch: PyTree) -> Any:
            def loss(p: PyTree) -> jax.Array:
                return loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch)

            return jax.vjp(loss, params)[1]

        def total(batch_size: Any) -> Any:
            """Bytes of the residuals and the batch at ``batch_size`` samples (an int, or a
            polynomial in a symbolic batch)."""
            batch = with_batch_size(self.sample_batch, batch_size)
            out = jax.eval_shape(residuals, self.params, self.rest, batch)
            leaves = jax.tree.leaves(out) + jax.tree.leaves(batch)
            return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)

        growth = _growth_per_group(total, dp)
        if growth is None:
            with tracing_note(with_batch_size(self.sample_batch, 2 * dp)):
                larger = total(2 * dp)
            with tracing_note(with_batch_size(self.sample_batch, dp)):
                growth = larger - total(dp)
        self._traced_per_sample = max(0.0, growth / dp / dp)
        return self._traced_per_sample

    @property
    def state_bytes(self) -> int:
        """Persistent per-device bytes (parameters, optimizer state, other state): no compile."""
        return self.params_bytes + self.opt_state_bytes + self.rest_bytes

    def estimate(self, batch_size: int) -> MemoryEstimate:
        """Compile the step for global ``batch_size`` and return its per-device memory."""
        return self.compile(batch_size)[0]

    def compile(
        self,
        batch_size: int,
        options: dict[str, Any] | None | Literal[_Default.OPTIONS] = _DEFAULT_OPTIONS,
        step: Any = None,
    ) -> tuple[MemoryEstimate, Any, Any]:
        """Compile the training step at global ``batch_size``; nothing runs.

        Returns the per-device memory (`MemoryEstimate`, bytes), the executable and its
        lowering. ``options`` are XLA compile options (default: this compiler's, fast
        code generation on CPU; None: XLA's defaults, what a training run compiles); ``step``
        a jitted step with this compiler's signature (default: its own).
        """
        dp = self.data_parallel
        if batch_size < 1 or batch_size % dp:
            suggestion = max(1, -(-batch_size // dp)) * dp
            raise ValueError(
                f"{batch_size=} must be a positive multiple of the data-parallel degree {dp}; "
                f"use {suggestion}"
            )
        if options is _DEFAULT_OPTIONS:
            options = self.compiler_options
        batch = with_batch_size(self.sample_batch, batch_size)
        shardings = self.shardings
        start = time.perf_counter()
        # Arguments placed as a run's arrays are: a run's lowering of the same jitted step is
        # then JAX's cache hit (`scamp_jax.planning.train_step.StepSource`).
        with tracing_note(batch):
            lowered = (step or self._step).lower(
                placed(self.params, shardings.params),
                placed(self.opt_state, shardings.opt_state),
                placed(self.rest, shardings.rest), placed(batch, shardings.batch))
        compiled = compile_lowered(lowered, options)
        seconds = time.perf_counter() - start
        stats = compiled.memory_analysis()
        if stats is None:
            platform = self.mesh.devices.flat[0].platform
            raise RuntimeError(
                f"XLA on {platform} gives no memory analysis for compiled programs, so memory "
                "cannot be estimated there; plan on a backend that does (CPU, GPU, TPU)"
            )
        temp = int(stats.temp_size_in_bytes)
        argument = int(stats.argument_size_in_bytes)
        output = int(stats.output_size_in_bytes)
        alias = int(stats.alias_size_in_bytes)
        peak = temp + argument + output - alias
        inputs = sh.bytes_per_device(batch, self.shardings.batch)
        estimate = MemoryEstimate(
            batch_size=batch_size,
            params=self.params_bytes,
            grads=self.params_bytes,
            opt_state=self.opt_state_bytes,
            rest=self.rest_bytes,
            inputs=inputs,
            activations_and_temps=peak - self.state_bytes - inputs,
            peak=peak,
            temp=temp,
            argument=argument,
            output=output,
            alias=alias,
            compile_seconds=seconds,
        )
        return estimate, compiled, lowered

    def fit(
        self,
        probe_batches: tuple[int, int] | None = None,
        verify_batch: int | None = None,
        tolerance: float = 0.01,
    ) -> tuple[MemoryModel, list[MemoryEstimate]]:
        """Fit the memory model from two compiles, then check it with a third.

        Default probes are ``8 * dp`` and ``32 * dp`` (past the smallest batches, where memory is
        often flat) and the check is at ``verify_batch`` (default four times the larger probe).
        If the prediction there is off by more than ``tolerance`` (relative), the probes were in
        the flat part, and the affine part is refitted through the larger probe and the check,
        with the smaller probe's peak as the floor. Returns the model and the three estimates.
        """
        dp = self.data_parallel
        b1, b2 = sorted(probe_batches) if probe_batches is not None else (8 * dp, 32 * dp)
        if b1 == b2:
            raise ValueError(f"probe batch sizes must differ, got {b1} twice")
        b3 = verify_batch if verify_batch is not None else 4 * b2
        if b3 in (b1, b2):
            raise ValueError(f"{verify_batch=} must differ from the probe batch sizes {b1}, {b2}")
        first, second = self.estimate(b1), self.estimate(b2)
        model = affine_fit(first, second, dp)
        third = self.estimate(b3)
        if abs(model.predict(b3) - third.peak) > tolerance * third.peak and b3 > b2:
            refit = affine_fit(second, third, dp)
            model = replace(refit, floor_bytes=float(first.peak))
        model = replace(
            model,
            probe_batches=(b1, b2, b3),
            probe_peaks=(first.peak, second.peak, third.peak),
        )
        return model, [first, second, third]


def affine_fit(first: MemoryEstimate, second: MemoryEstimate, batch_multiple: int) -> MemoryModel:
    """``MemoryModel`` through two compiled estimates (the smaller batch sets the floor)."""
    if first.batch_size > second.batch_size:
        first, second = second, first
    if first.batch_size == second.batch_size:
        raise ValueError(f"need two different batch sizes, got {first.batch_size} twice")
    slope = (second.peak - first.peak) / (second.batch_size - first.batch_size)
    return MemoryModel(
        fixed_bytes=first.peak - slope * first.batch_size,
        bytes_per_sample=slope,
        probe_batches=(first.batch_size, second.batch_size),
        probe_peaks=(first.peak, second.peak),
        batch_multiple=batch_multiple,
        floor_bytes=float(first.peak),
    )


def default_step_shardings(
    mesh: Mesh,
    params: PyTree,
    opt_state: PyTree,
    rest: PyTree,
    optimizer: optax.GradientTransformation,
    *,
    min_shard_elements: int = sh.MIN_SHARD_ELEMENTS,
) -> StepShardings:
    """The project's tensor-parallel rules on ``mesh``: params by ``param_partition_specs``,
    optimizer moments like their parameters, other state replicated, batch split over 'data'."""
    model_parallel = int(mesh.shape.get(sh.MODEL_AXIS, 1))
    specs = sh.param_partition_specs(params, model_parallel, min_shard_elements=min_shard_elements)
    param_shardings = sh.named_shardings(mesh, specs)
    return StepShardings(
        params=param_shardings,
        opt_state=sh.opt_state_shardings(optimizer, opt_state, params, param_shardings, mesh),
        rest=sh.replicated_shardings(mesh, rest),
        batch=sh.batch_sharding(mesh),
    )


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    """A 1 x 1 ``('data', 'model')`` mesh on ``device`` (default: the first JAX device)."""
    device = device if device is not None else jax.devices()[0]
    return sh.make_mesh([device], 1, 1)


def estimate_memory(
    model: nnx.Module,
    batch: PyTree,
    *,
    mesh: Mesh | None = None,
    shardings: StepShardings | None = None,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: LossFn | None = None,
) -> MemoryEstimate:
    """Per-device training memory of ``model`` on ``batch`` (one compile, nothing allocated).

    Args:
      model: a Flax NNX module, real or abstract (``nnx.eval_shape(lambda: Model(...))``).
      batch: arrays or ``ShapeDtypeStruct``s shaped ``(B, ...)`` (an array or a tuple whose first
        element is the model input); ``B`` is the global batch size.
      mesh: a ``('data', 'model')`` mesh (``make_mesh``); default a single device.
      shardings: shardings of the step's arguments; default the project's rules on ``mesh``.
      optimizer: an optax transformation; default Adam via ``optax.inject_hyperparams``.
      loss_fn: ``loss_fn(model, batch) -> scalar``; default the mean squared output.

    Returns:
      A ``MemoryEstimate`` in bytes per device.
    """
    mesh = mesh if mesh is not None else single_device_mesh()
    leaves = jax.tree.leaves(batch)
    if not leaves or not hasattr(leaves[0], "shape") or len(leaves[0].shape) == 0:
        raise ValueError("batch must be arrays shaped (batch, ...); got no leading sample axis")
    compiler = StepCompiler(model, batch, mesh, shardings, optimizer, loss_fn)
    return compiler.estimate(int(leaves[0].shape[0]))


def fit_memory_model(
    model: nnx.Module,
    sample_batch: PyTree,
    *,
    mesh: Mesh | None = None,
    shardings: StepShardings | None = None,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: LossFn | None = None,
    probe_batches: tuple[int, int] | None = None,
    verify_batch: int | None = None,
) -> MemoryModel:
    """Per-device peak bytes as a function of the global batch size (three compiles).

    ``sample_batch`` gives the per-sample shapes (its leading axis is replaced by each probe
    size). Two probes fit the affine model and a third compile checks it (see
    ``StepCompiler.fit``); defaults are ``8 * dp``, ``32 * dp`` and ``128 * dp`` for the mesh's
    data-parallel degree ``dp``.
    """
    mesh = mesh if mesh is not None else single_device_mesh()
    compiler = StepCompiler(model, sample_batch, mesh, shardings, optimizer, loss_fn)
    return compiler.fit(probe_batches, verify_batch)[0]
