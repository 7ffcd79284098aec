"""Memory-aware planning: the mesh, shardings and batch size for training a model on devices.

``plan_mesh`` tries model-parallel degrees in increasing order (the divisors of the device
count); the first degree whose training step fits at one sample per data-parallel group wins, and
then the largest global batch that fits is found. "Fits" means the compiled per-device peak
(``scamp_jax.planning.memory``) plus the prefetched next batch is at most the budget's
`scamp_jax.planning.budget.Budget.plan_bytes` (the pool less the safety margin and the
allowance for memory XLA does not see); with an ``eval_task``, evaluation (forward pass at its
planned chunk, optimizer state, prefetched batch) fits too (`Plan.predicted_peak_bytes`).

The batch search (`scamp_jax.planning.batch_search`) lets the memory model choose each compile
and the compiles decide; for a new architecture it first compiles the largest batch an estimate
from shapes predicts to fit, as the answer: one compile when that guess fits and the line puts the
next batch over the budget, one more when the guess was wrong. Fewer when earlier compiles of the
same program on the same mesh shape are known (``cache=``), none for a cached plan. Degrees whose
parameters and optimizer state alone exceed the budget are rejected from shapes, without
compiling.

Which compile is the run's (`scamp_jax.planning.compile_options`): on CPU the answer is compiled
with the run's own XLA options, so it *is* the trial's executable (`Plan.compiled_step`), and
the other points of the search at LLVM level 0; on GPUs every planning compile runs with XLA's
autotuner off and the run compiles its own step, autotuned once per architecture (the
persistent autotune cache keeps it, `scamp_jax.planning.compile_cache`).

The evaluation (``eval_task``) is planned from shapes where they allow it: its chunk is chosen
from the forward's jaxpr and compiled once, the chunk the trial runs
(`scamp_jax.planning.evaluation.plan_eval`); only when the estimate of evaluating one sample per
data-parallel group comes near the budget is that compiled before the batch search, to bound the
batch.

Planning only compiles: it allocates nothing and runs nothing on any device.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scamp_jax._units import counted, format_bytes
from scamp_jax.planning import sharding as sh
from scamp_jax.planning.batch_search import (
    BatchSearch,
    exact_largest,
    local_fit,
    shape_figures,
)
from scamp_jax.planning.budget import DEFAULT_SAFETY_MARGIN, Budget
from scamp_jax.planning.compile_options import answer_is_runnable
from scamp_jax.planning.evaluation import (
    EVAL_SHAPE_MARGIN,
    EvalCompiler,
    abstract_eval_inputs,
    plan_eval,
)
from scamp_jax.planning.memory import (
    ROUGH_TOLERANCE,
    MemoryEstimate,
    MemoryModel,
    StepCompiler,
    default_step_shardings,
    with_batch_size,
)
from scamp_jax.planning.plan_cache import (
    PlanCache,
    cache_key,
    device_identity,
    function_identity,
    program_signature,
    resolve_allowance,
)
from scamp_jax.planning.reuse import lowered_fingerprint
from scamp_jax.planning.targets import Target, resolve_target
from scamp_jax.planning.train_step import (
    LossFn,
    StepShardings,
    StepSource,
    abstract_state,
    compiled_flops,
    default_optimizer,
    jit_train_step,
)
from scamp_jax.scheduling.booking import solo_bytes

PyTree = Any

log = logging.getLogger(__name__)

#: Largest global batch considered when ``max_batch_size`` is not given.
DEFAULT_BATCH_CAP = 1 << 16


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
      bytes_available: the bytes per device it had to fit in. Their difference is the
        shortfall; what each holds depends on the raiser: `plan_mesh` counts neither with the
        allowance (``bytes_available`` is `scamp_jax.planning.budget.Budget.plan_bytes`, the
        pool less the margin and the allowance), `scamp_jax.planning.fusion.plan_fusion`
        both with it (``bytes_available`` is the pool less the margin).
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
      device_budget: the `Budget` the plan was made with, for its devices' platform, kind and
        memory (`budget` gives it with this plan's own pool, margin and allowance); None for
        a plan made by hand.
      step_flops: FLOPs of one training step at ``batch_size`` over all its devices, from XLA's
        cost analysis of the planner's own executable at that batch (per device, times the
        devices: `train_step.compiled_flops`; replicated work counts on every device), kept
        with a cached plan; None when this plan compiled no step at that batch (a provisional
        plan; the batch's figures from the plan cache's peaks and no run-grade step), was
        cached without it, or was compiled for a GPU target (XLA gives compile-only
        executables no cost analysis).

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
    step_flops: float | None = field(default=None, compare=False)
    device_budget: Budget | None = field(default=None, compare=False, repr=False)

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
        """The budget the plan was made for: this plan's pool, margin and allowance per
        device, with its devices' platform, kind and memory (``device_budget``)."""
        if self.device_budget is None:
            return Budget(self.memory_per_device, self.safety_margin, self.allowance_bytes)
        return replace(self.device_budget, memory_per_device=self.memory_per_device,
                       safety_margin=self.safety_margin, allowance_bytes=self.allowance_bytes)

    @property
    def usable_bytes(self) -> int:
        """Bytes per device that a plan may use: the budget less the safety margin."""
        return self.budget.usable_bytes

    def __repr__(self) -> str:
        """One line: the decision and its figures (`describe` tabulates them; the shardings
        are the attributes ``param_shardings``, ``batch_sharding`` and ``step_shardings``)."""
        platforms = ",".join(sorted({d.platform for d in self.devices}))
        extra = "".join((", provisional" if self.provisional else "",
                         ", cached" if self.cached else ""))
        return (f"Plan(mesh={self.data_parallel}x{self.model_parallel} (data x model) on "
                f"{len(self.devices)} {platforms} device(s), batch_size={self.batch_size}, "
                f"predicted_peak_bytes={format_bytes(self.predicted_peak_bytes)} of "
                f"{format_bytes(self.usable_bytes)} usable (memory_per_device="
                f"{format_bytes(self.memory_per_device)}, safety_margin={self.safety_margin}), "
                f"compiles={self.compiles}{extra})")

    def describe(self) -> str:
        """A short human-readable table of the plan."""
        e = self.estimate
        # the platform, and the kind where it says more (a GPU's model, e.g. a target's)
        kinds = sorted({d.platform if getattr(d, "device_kind", d.platform) == d.platform
                        else f"{d.platform}: {d.device_kind}" for d in self.devices})
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
            ("each sample more", f"+{format_bytes(self.memory_model.bytes_per_sample)} per "
             "device (the global batch one larger)"
             if self.memory_model.fixed_bytes >= 0 and self.memory_model.bytes_per_sample > 0
             else f"no steady figure: the compiled peaks near batch {self.batch_size} "
             + ("rise and fall with it" if self.memory_model.fixed_bytes < 0
                else "do not grow with it")),
            ("planning", f"{self.planning_seconds:.2f} s, {counted(self.compiles, 'compile')}"),
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
            more = (" (to split the CPU into more devices, call "
                    "scamp_jax.configure_cpu_devices(n) before JAX starts)"
                    if available[0].platform == "cpu" and devices > len(available) else "")
            raise ValueError(
                f"devices={devices} must be between 1 and the {len(available)} available "
                f"{available[0].platform} devices; pass a count in that range or a device "
                f"list{more}"
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


def _target_devices(target: str | os.PathLike[str] | Target, devices: Any
                    ) -> tuple[jax.Device, ...]:
    """``devices`` compile-only GPUs of ``target`` (`scamp_jax.planning.targets`). On a
    machine whose CUDA plugin has no driver to start with, JAX's backends are kept to the CPU
    first (`scamp_jax.devices.cpu_without_gpu_driver`), where they have not started yet: the
    plugin's failed start-up would print a traceback the plan does not need."""
    from scamp_jax.devices import cpu_without_gpu_driver

    cpu_without_gpu_driver()
    devices = _plain_int(devices)  # a NumPy integer is the int it holds, as without a target
    if isinstance(devices, bool) or not isinstance(devices, int):
        raise ValueError(
            f"with target={target!r}, devices must be a count, the number of GPUs to plan "
            f"for, not {devices!r}; e.g. plan_mesh(model, batch, devices=8, "
            f"target={target!r})")
    return resolve_target(target).devices(devices)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _check_model(model: nnx.Module) -> None:
    if not isinstance(model, nnx.Module):
        what = (f"the class {model.__name__}" if isinstance(model, type)
                else f"a {type(model).__name__}")
        raise TypeError(
            f"model must be an nnx.Module instance, got {what}; build it, e.g. "
            "nnx.eval_shape(lambda: MyModel(..., rngs=nnx.Rngs(0))) (shapes only, nothing "
            "allocated)"
        )
    params = nnx.state(model, nnx.Param)
    if not jax.tree.leaves(params):
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param variables, so there is nothing to plan; "
            "check that its layers are attributes of the module (not in a plain list or dict "
            "of non-NNX containers)"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None) or jnp.asarray(leaf).dtype
        if not jnp.issubdtype(dtype, jnp.inexact):  # JAX: "use vjp or set allow_int"
            keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
            name = ".".join(keys[:-1] if keys[-1:] == ["value"] else keys)
            raise TypeError(
                f"{type(model).__name__}.{name} is an nnx.Param of {dtype}, and the training "
                "step differentiates every nnx.Param, which needs floating point: hold "
                "integer or boolean state in an nnx.Variable (it trains along, undifferentiated)")


def _warn_evaluation_mode(model: nnx.Module) -> None:
    """Warn where every layer of ``model`` with a mode is in evaluation mode (``model.eval()``:
    dropout off, batch norm on its running averages, e.g. a model `scamp_jax.load_model`
    returned): the plan is of a training step in that mode, which can hold far less than
    training mode does. A model that mixes modes is taken as meant."""
    modes = [value for _, module in nnx.iter_modules(model)
             for name in ("deterministic", "use_running_average")
             if isinstance(value := getattr(module, name, None), bool)]
    if modes and all(modes):
        warnings.warn(
            f"{type(model).__name__} is in evaluation mode (model.eval(): dropout off, batch "
            "norm on its running averages), so the plan is of training in that mode, which can "
            "hold much less memory than training mode; call model.train() before planning a "
            "model that trains in training mode", UserWarning,
            stacklevel=5)  # plan_mesh's caller


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
    sizes = {str(leaf.shape[0]) for leaf in leaves}  # a symbolic size too
    if len(sizes) > 1:  # the leaves share the batch axis: one without it is read as one
        shapes = ", ".join(str(tuple(leaf.shape)) for leaf in leaves)
        raise ValueError(
            f"sample_batch's arrays disagree on their leading (sample) axis: {shapes}; every "
            "array needs a leading batch axis of one size, e.g. x[None] for one sample"
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
    _warn_evaluation_mode(model)
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
    target: str | os.PathLike[str] | Target | None = None,
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
      max_batch_size: cap on the global batch (default ``DEFAULT_BATCH_CAP``). A cap below
        the device count leaves room for fewer data-parallel groups than devices: meshes with
        more groups than the cap are skipped (logged at INFO level), so the plan may be
        model-parallel where the model would fit one sample per device.
      model_parallel: force this model-parallel degree (must divide the device count).
      min_shard_elements: parameters with fewer elements are replicated.
      cache: a `PlanCache`: a plan stored under the same key is returned without compiling, a
        new plan is stored, and compiled points of the same program and mesh shape seed the
        batch search (see `scamp_jax.planning.plan_cache`).
      compile_for_run: keep the step compiled at the plan's batch with the run's XLA options as
        ``plan.compiled_step`` for the runner (default True), where the planner's compile of
        its answer can be the run's (`scamp_jax.planning.compile_options.answer_is_runnable`:
        CPU and backends without planning options). On CPU the search compiles its other
        points with fast code-generation settings (LLVM level 0: half the compile time,
        half-speed code) and the batch the memory model predicts to be the answer with the
        run's options, so a plan takes as many compiles as without it (the answer's a slower,
        run-grade one) and a trial on the planned devices none
        (`scamp_jax.planning.reuse.ExecutableCache`); one more (run-grade) compile only when
        the prediction missed. On GPUs the planner compiles without autotuning and keeps no
        step: the run compiles its own, autotuned. False: planning only, at the planning
        settings. A plan answered by ``cache`` compiles nothing and has no compiled step.
      eval_task: a task with the `scamp_jax.planning.evaluation.ChunkedEvalTask` methods: its
        evaluation forward's chunk is chosen (`Plan.eval_chunk`) so that evaluating never
        needs more per device than training, unless one sample per data-parallel group already
        does, and compiled on the same mesh (`scamp_jax.planning.evaluation.plan_eval`: the
        chunk from shapes, one compile unless they guessed too high); None (or a task without
        them): not planned.
      batch_multiple: the batch is also a multiple of this (with the data-parallel degree:
        their least common multiple) when one such batch fits, so that a trial can later run on
        more devices with the same batch (a batch of 41 cannot be split over 2 or 4 devices;
        one of 40 can). Default 1: any multiple of the data-parallel degree.
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
      target: plan for GPUs this machine does not have: a name (``"h100"``, ``"a100-80gb"``,
        ``"a100-40gb"``, ``"v100"``, ``"h200"``), a description file or a
        `scamp_jax.planning.targets.Target`; ``devices`` is then how many. The step is
        compiled for the target with its planning options (autotuning off: XLA's default
        kernels) and the plan is a GPU plan of that kind, on compile-only devices
        (``memory_per_device`` default: the described GPU's pool,
        `scamp_jax.planning.budget.Budget.for_device`; no step kept, as on GPUs). Needs the
        ``gpu-plan`` extra. Devices from ``Target.devices(n)`` plan the same without it. A
        script whose JAX starts before the first plan (a real model built first) on a machine
        with no GPU driver sets ``JAX_PLATFORMS=cpu`` (or calls
        `scamp_jax.configure_cpu_devices` first), else JAX's CUDA plugin prints its failed
        start-up (``Unable to load cuDNN``) once (BUILD.md).

    Every plan counts the prefetched next batch: the step's compiled peak plus one batch
    (and, with ``eval_task``, the evaluation's bytes) fit within the usable bytes.

    Returns:
      A ``Plan`` with the smallest model-parallel degree that fits and the largest global batch
      (a multiple of the data-parallel degree) whose compiled peak fits, such that the next
      multiple does not fit (unless the cap is reached): compiled, or put over the budget by a
      line through compiled points where the search stops without compiling it
      (`scamp_jax.planning.batch_search`), which leaves a smaller batch than the largest where
      memory bends between those points; never a batch that does not fit.

    Raises:
      DoesNotFitError: no degree fits even at one sample per data-parallel group.
      ValueError, TypeError: bad arguments (raised before any compile).
    """
    if target is not None:
        devices = _target_devices(target, devices)
    request = _request(
        model, sample_batch, devices, memory_per_device, optimizer, loss_fn, safety_margin,
        max_batch_size, model_parallel, min_shard_elements, cache, compile_for_run, eval_task,
        batch_multiple, allowance_bytes, provisional)
    stored = _StoredPlans.of(request, cache)
    if stored is not None and (record := stored.plan_record()) is not None:
        try:
            fields = _record_fields(record)
        except (KeyError, TypeError, ValueError) as err:  # a damaged row: planned again
            stored.forget(f"a plan record it cannot read ({type(err).__name__}: {err})")
        else:
            return _plan_from_record(fields, request)
    best_need: tuple[int, str, str] | None = None
    for mp in request.candidates:
        if request.cap < request.n // mp:
            log.info("max_batch_size=%d is below the %d data-parallel groups of a %d x %d mesh "
                     "(data x model): that mesh is skipped", request.cap, request.n // mp,
                     request.n // mp, mp)
            continue
        outcome = _plan_on_mesh(request, mp, stored)
        if isinstance(outcome, Plan):
            return outcome
        best_need = outcome if best_need is None or outcome[0] < best_need[0] else best_need
    assert best_need is not None
    raise _does_not_fit(request, *best_need)


@dataclass(frozen=True)
class _Request:
    """``plan_mesh``'s arguments, checked and resolved (nothing compiled yet)."""

    model: nnx.Module
    sample_batch: PyTree
    devices: tuple[jax.Device, ...]
    budget: Budget
    optimizer: optax.GradientTransformation
    loss_fn: LossFn | None
    cap: int
    candidates: tuple[int, ...]
    model_parallel: int | None
    min_shard_elements: int
    batch_multiple: int
    compile_for_run: bool
    eval_task: Any
    eval_groups: tuple[jax.ShapeDtypeStruct, ...] | None
    provisional: bool
    state: tuple[PyTree, PyTree, PyTree]
    start: float

    @property
    def n(self) -> int:
        """Devices planned on."""
        return len(self.devices)

    @property
    def usable(self) -> int:
        """Bytes per device the plan's compiled figures may fill (`Budget.plan_bytes`)."""
        return self.budget.plan_bytes


def _plain_int(value: Any) -> Any:
    """``value`` as a Python int where it is another integer type (NumPy's), else itself."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _request(
    model: nnx.Module, sample_batch: PyTree, devices: Sequence[jax.Device] | int | None,
    memory_per_device: int | float | str | Budget | None,
    optimizer: optax.GradientTransformation | None, loss_fn: LossFn | None,
    safety_margin: float | None, max_batch_size: int | None, model_parallel: int | None,
    min_shard_elements: int, cache: PlanCache | None, compile_for_run: bool | None,
    eval_task: Any, batch_multiple: int, allowance_bytes: int | None, provisional: bool,
) -> _Request:
    """Check ``plan_mesh``'s arguments (raising before any compile) and resolve the devices,
    the budget, the optimizer, the batch cap and the model-parallel degrees to try."""
    start = time.perf_counter()
    # NumPy's integers (a count or size from an array) are the ints they hold
    devices, memory_per_device, max_batch_size, model_parallel, batch_multiple, \
        min_shard_elements = (_plain_int(x) for x in (
            devices, memory_per_device, max_batch_size, model_parallel, batch_multiple,
            min_shard_elements))
    devs = resolve_devices(devices)
    n = len(devs)
    _validate_common(model, sample_batch, max_batch_size)
    if isinstance(batch_multiple, bool) or not isinstance(batch_multiple, int) or (
            batch_multiple < 1):
        raise ValueError(f"{batch_multiple=} must be a positive int")
    if optimizer is not None and not (callable(getattr(optimizer, "init", None))
                                      and callable(getattr(optimizer, "update", None))):
        if isinstance(optimizer, nnx.Pytree):  # its repr would print all its arrays
            raise TypeError(f"optimizer is {type(optimizer).__module__.split('.')[0]}'s "
                            f"{type(optimizer).__name__}, not an optax GradientTransformation; "
                            "pass the transformation it was made with (an nnx.Optimizer's "
                            ".tx), e.g. optimizer=optax.adamw(1e-3), or none for Adam")
        raise TypeError(f"optimizer={optimizer!r} is not an optax GradientTransformation; "
                        "pass one, e.g. optimizer=optax.adamw(1e-3), or none for Adam")
    if cache is not None and not isinstance(cache, PlanCache):
        hint = (f"scamp_jax.PlanCache({str(cache)!r})" if isinstance(cache, (str, os.PathLike))
                else "scamp_jax.PlanCache(path)")
        raise TypeError(f"cache={cache!r} is not a PlanCache; pass cache={hint}")
    if safety_margin is not None:
        if isinstance(safety_margin, bool) or not isinstance(safety_margin, numbers.Real):
            raise TypeError(f"safety_margin={safety_margin!r} must be a number, e.g. 0.1 (10%)")
        safety_margin = float(safety_margin)
    if isinstance(min_shard_elements, bool) or not isinstance(min_shard_elements, int) or (
            min_shard_elements < 0):
        raise ValueError(f"{min_shard_elements=} must be an int >= 0 (elements)")
    for name, flag in (("provisional", provisional), ("compile_for_run", compile_for_run)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be True or False")
    if model_parallel is not None:
        if isinstance(model_parallel, bool) or not isinstance(model_parallel, int):
            raise TypeError(f"model_parallel must be an int, got {model_parallel!r}")
        if model_parallel < 1 or n % model_parallel:
            raise ValueError(
                f"{model_parallel=} must divide the device count {n}; choose one of "
                f"{_divisors(n)}"
            )
        candidates: tuple[int, ...] = (model_parallel,)
    else:
        candidates = tuple(_divisors(n))
    budget = plan_budget(memory_per_device, devs, safety_margin, allowance_bytes, cache)
    optimizer = optimizer if optimizer is not None else default_optimizer()
    cap = max_batch_size if max_batch_size is not None else DEFAULT_BATCH_CAP
    if all(cap < n // mp for mp in candidates):
        raise ValueError(
            f"max_batch_size={cap} is smaller than every data-parallel degree "
            f"{[n // mp for mp in candidates]} on {n} devices; raise it to at least "
            f"{min(n // mp for mp in candidates)} or use fewer devices"
        )
    eval_groups = abstract_eval_inputs(eval_task) if eval_task is not None else None
    return _Request(
        model=model, sample_batch=sample_batch, devices=devs, budget=budget,
        optimizer=optimizer, loss_fn=loss_fn, cap=cap, candidates=candidates,
        model_parallel=model_parallel, min_shard_elements=min_shard_elements,
        batch_multiple=batch_multiple,
        compile_for_run=True if compile_for_run is None else bool(compile_for_run),
        eval_task=eval_task, eval_groups=eval_groups, provisional=provisional,
        state=abstract_state(model, optimizer), start=start)


@dataclass(frozen=True)
class _StoredPlans:
    """What a `PlanCache` holds for one request: its plan, and compiled points per mesh."""

    cache: PlanCache
    signature: str
    identity: dict[str, Any]
    plan_key: str

    @classmethod
    def of(cls, request: _Request, cache: PlanCache | None) -> _StoredPlans | None:
        if cache is None:
            return None
        budget, task, groups = request.budget, request.eval_task, request.eval_groups
        signature = program_signature(request.model, request.sample_batch, request.optimizer,
                                      request.loss_fn)
        identity = device_identity(request.devices)
        key = cache_key({
            "kind": "plan", "signature": signature, "devices": identity,
            "memory_per_device": budget.memory_per_device,
            "safety_margin": budget.safety_margin, "cap": request.cap,
            "model_parallel": request.model_parallel,
            "min_shard_elements": request.min_shard_elements,
            "batch_multiple": request.batch_multiple, "allowance": budget.allowance_bytes,
            "eval": None if not groups else {
                "forward": function_identity(task.eval_forward),
                "inputs": [[list(x.shape), str(x.dtype)] for x in groups],
            },
        })
        return cls(cache, signature, identity, key)

    def plan_record(self) -> dict[str, Any] | None:
        return self.cache.get_plan(self.plan_key)

    def forget(self, what: str) -> None:
        """The plan record found is unreadable (``what``): dropped, and counted a miss."""
        self.cache.drop("plans", {"key": self.plan_key}, what)
        self.cache.hits -= 1
        self.cache.misses += 1

    def peaks_key(self, request: _Request, dp: int, mp: int) -> str:
        return cache_key({
            "kind": "peaks", "signature": self.signature,
            "devices": {**self.identity, "count": request.n}, "mesh": [dp, mp],
            "min_shard_elements": request.min_shard_elements,
        })

    def seed(self, search: BatchSearch, key: str) -> None:
        """Put the compiled points stored under ``key`` into ``search``."""
        for b, (estimate, rough) in sorted(self.cache.get_estimates(key).items()):
            if rough:
                search.rough.add(b)
            search.seen[b] = estimate

    def keep(self, search: BatchSearch, key: str, known: set[int], known_rough: set[int]
             ) -> None:
        """Store the points ``search`` compiled (new ones, and rough ones made exact)."""
        self.cache.put_peaks(key, {
            b: {**_estimate_record(e), "rough": b in search.rough}
            for b, e in search.seen.items()
            if b not in known or (b in known_rough and b not in search.rough)
        })


def _plan_on_mesh(request: _Request, mp: int, stored: _StoredPlans | None,
                  compiled_eval_floor: bool = False, spent: int = 0
                  ) -> Plan | tuple[int, str, str]:
    """The plan at model-parallel degree ``mp``, or ``(bytes needed, what, advice)`` when
    nothing fits it (``advice``: a key of `_ADVICE`). ``compiled_eval_floor``: bound the batch
    by the compiled evaluation of one sample per data-parallel group even where the shapes put
    it far inside the budget; ``spent``: compiles made for this degree before."""
    dp, usable = request.n // mp, request.usable
    params, opt_state, rest = request.state
    mesh = sh.make_mesh(request.devices, dp, mp)
    shardings = default_step_shardings(mesh, params, opt_state, rest, request.optimizer,
                                       min_shard_elements=request.min_shard_elements)
    compiler = StepCompiler(request.model, request.sample_batch, mesh, shardings,
                            request.optimizer, request.loss_fn)
    if compiler.state_bytes > usable:
        return (compiler.state_bytes, f"parameters + optimizer state at model_parallel={mp}",
                "state")
    step = jit_train_step(compiler.graphdef, compiler.optimizer, compiler.loss_fn, shardings)
    one_sample = sh.bytes_per_device(with_batch_size(request.sample_batch, dp), shardings.batch)
    platform = request.devices[0].platform
    want_step = request.compile_for_run and answer_is_runnable(platform)
    search = BatchSearch(compiler, usable, step, prefetch_per_sample=one_sample / dp,
                         run_grade_answers=want_step, rough_options=compiler.rough_options,
                         tolerance=int(ROUGH_TOLERANCE * usable))
    mp_cap = (request.cap // dp) * dp
    groups, evaluator = request.eval_groups, None
    if groups:
        evaluator = EvalCompiler(compiler.graphdef, request.eval_task.eval_forward, params,
                                 rest, shardings.params, shardings.rest, mesh)
        floor = _eval_floor(evaluator, groups, compiler, search, mp_cap, compiled_eval_floor)
        # while evaluating, the prefetched batch stays too: it bounds the batch
        room = usable - floor
        if search.prefetch_per_sample > 0:
            mp_cap = min(mp_cap, int(room // search.prefetch_per_sample) // dp * dp)
        if mp_cap < dp:
            return (floor + search.prefetch(dp),
                    f"evaluation at {dp} sample(s) with model_parallel={mp}", "evaluation")
    peaks_key = None
    if stored is not None:
        peaks_key = stored.peaks_key(request, dp, mp)
        stored.seed(search, peaks_key)
    known, known_rough = set(search.seen), set(search.rough)
    search.unit = math.lcm(dp, request.batch_multiple)
    if (mp_cap // search.unit) * search.unit < search.unit:
        search.unit = dp  # the cap leaves no multiple: plain data-parallel steps
    top = (mp_cap // search.unit) * search.unit
    shaped = request.provisional and top >= search.unit and search.shape_guess(top) >= top
    compiled_step = None
    if shaped:
        # The shapes put the cap in reach: no step compiled here (a fused group's compiled
        # step checks the fit; a trial alone is planned again).
        batch: int | None = top
        estimate, memory_model = shape_figures(search, top)
    else:
        batch = exact_largest(search, top)
        if batch is None and search.unit > dp:
            # not even one multiple fits: the largest plain data-parallel batch instead
            search.unit = dp
            batch = exact_largest(search, mp_cap)
        if stored is not None and peaks_key is not None:
            stored.keep(search, peaks_key, known, known_rough)
        if batch is None:
            return (search.need(dp), f"peak at batch {dp} with model_parallel={mp}, "
                    "prefetched batch included", "sample")
        _, hi = search.bracket((mp_cap // search.unit) * search.unit)
        memory_model = local_fit(search, batch, hi)
        estimate = search.seen[batch]
        if want_step:
            estimate, compiled_step = _run_step(search, batch, estimate)
    assert batch is not None
    prefetch = search.prefetch(batch)
    eval_plan = None
    compiles = spent + search.compiles
    if evaluator is not None and groups:
        eval_plan = plan_eval(evaluator, groups, compiler.opt_state_bytes + prefetch,
                              estimate.peak + prefetch)
        compiles += evaluator.compiled_chunks()
        if eval_plan.total_bytes > usable and not compiled_eval_floor:
            # the shapes put evaluating far inside the budget and the compile did not:
            # plan again with the batch bounded by the compiled figure
            return _plan_on_mesh(request, mp, stored, compiled_eval_floor=True, spent=compiles)
    plan = Plan(
        mesh=mesh, data_parallel=dp, model_parallel=mp, param_shardings=shardings.params,
        batch_sharding=shardings.batch, step_shardings=shardings, batch_size=batch,
        peak_bytes_per_device=estimate.peak,
        memory_per_device=request.budget.memory_per_device,
        safety_margin=request.budget.safety_margin, estimate=estimate,
        memory_model=memory_model, devices=request.devices,
        planning_seconds=time.perf_counter() - request.start, compiles=compiles,
        compiled_peaks=tuple((b, e.peak) for b, e in search.seen.items()),
        compiled_step=compiled_step,
        step_source=None if shaped else StepSource(
            step, compiler.graphdef, compiler.optimizer, compiler.loss_fn, shardings),
        prefetch_bytes=prefetch,
        eval_chunk=eval_plan.chunk if eval_plan else 0,
        eval_peak_bytes=eval_plan.peak_bytes if eval_plan else 0,
        evaluator=evaluator if eval_plan else None,
        allowance_bytes=request.budget.allowance_bytes,
        device_budget=request.budget,
        provisional=shaped,
        step_flops=_answer_flops(search, batch, compiled_step),
    )
    if not shaped and stored is not None and (
            plan.predicted_peak_bytes - plan.allowance_bytes <= usable):
        stored.cache.put_plan(stored.plan_key, _plan_record(plan))
    return plan


def _eval_floor(evaluator: EvalCompiler, groups: Sequence[jax.ShapeDtypeStruct],
                compiler: StepCompiler, search: BatchSearch, cap: int, compiled: bool) -> int:
    """Per-device bytes of evaluating one sample per data-parallel group beside the optimizer
    state: the shape estimate (`EvalCompiler.estimate` x `EVAL_SHAPE_MARGIN`) where it leaves
    room for the prefetched batch at ``cap`` (then it does not bound the batch and nothing is
    compiled), else (or when ``compiled``) the compiled forward's figure."""
    dp = compiler.data_parallel
    resident = compiler.opt_state_bytes
    if not compiled:
        shapes = int(evaluator.estimate(dp, groups) * EVAL_SHAPE_MARGIN) + resident
        if shapes + search.prefetch(cap) <= search.usable:
            return shapes
    return evaluator.peak(dp, groups) + resident


def _answer_flops(search: BatchSearch, batch: int, compiled_step: CompiledStep | None
                  ) -> float | None:
    """FLOPs over the mesh of the step at ``batch`` from an executable of it this plan holds:
    the run's (``compiled_step``) or the search's; None where neither exists (a provisional
    plan; figures from the plan cache's peaks and no run-grade step)."""
    if compiled_step is not None:
        executable = compiled_step.executable
    elif batch in search.executables:
        executable = search.executables[batch][0]
    else:
        return None
    return compiled_flops(executable, search.compiler.mesh.size)


def _run_step(search: BatchSearch, batch: int, estimate: MemoryEstimate
              ) -> tuple[MemoryEstimate, CompiledStep]:
    """The run's executable at ``batch`` (`BatchSearch.run_grade`) and the figures the plan
    keeps: the search's, unless the run's compile assigned buffers differently."""
    run_estimate, executable, lowered, _ = search.run_grade(batch)
    if run_estimate.peak != estimate.peak:
        # Code-generation settings are not meant to change buffer assignment; if they do,
        # the run's own figure is the one that must fit.
        estimate = run_estimate
    devices = tuple(d.id for d in search.compiler.mesh.devices.flat)
    return estimate, CompiledStep(executable, lowered_fingerprint(lowered), devices)


#: What a `DoesNotFitError` suggests, by what did not fit at the degree that needed least.
_ADVICE = {
    "state": "use more devices (model parallelism splits the weights), more "
             "memory_per_device, or a smaller model",
    "sample": "one sample per data-parallel group is the least a device trains on: use more "
              "memory_per_device, smaller inputs, blocks rematerialised in the backward pass "
              "(nnx.remat), or a smaller model; more devices help only as far as model "
              "parallelism splits the activations",
    "evaluation": "the evaluation of one sample per data-parallel group does not fit beside "
                  "the optimizer state: use more memory_per_device, smaller held-out inputs, "
                  "or a smaller model",
}


def _does_not_fit(request: _Request, needed: int, what: str, advice: str) -> DoesNotFitError:
    budget, usable = request.budget, request.usable
    allowance = budget.allowance_bytes
    return DoesNotFitError(
        f"{type(request.model).__name__} does not fit on {request.n} device(s): it needs at "
        f"least {needed} bytes ({format_bytes(needed)}) per device ({what}) but {usable} bytes "
        f"({format_bytes(usable)}) are available ({format_bytes(budget.memory_per_device)} "
        f"less a {budget.safety_margin:.0%} margin"
        + (f" and a {format_bytes(allowance)} allowance" if allowance else "")
        + f"); {_advice(request, advice)}",
        bytes_needed=needed,
        bytes_available=usable,
    )


def _advice(request: _Request, advice: str) -> str:
    """What a `DoesNotFitError` advises: a pool under 1 KiB is a size given without its unit
    (``memory_per_device=16`` is 16 bytes), which no advice about the model helps."""
    pool = request.budget.memory_per_device
    if pool < 2**10:
        return (f"memory_per_device={pool} is a count of bytes: for {pool} GiB pass "
                f"memory_per_device='{pool}GiB'")
    return _ADVICE[advice] + (_whole_weights(request) if advice == "state" else "")


def _whole_weights(request: _Request) -> str:
    """What a `DoesNotFitError` of the weights adds where a large share of them is in
    matrices under ``min_shard_elements`` that the largest model-parallel degree tried would
    split without that floor (every device holds them whole now, so more devices barely help):
    "" where that share is under a quarter, or no degree above 1 was tried."""
    mp = max(request.candidates, default=1)
    if mp == 1 or request.min_shard_elements <= 1:
        return ""
    leaves = jax.tree_util.tree_flatten_with_path(request.state[0])[0]
    total = whole = 0
    for path, x in leaves:
        size = math.prod(x.shape) * x.dtype.itemsize
        total += size
        shape = tuple(x.shape)
        floor = request.min_shard_elements
        if (sh.partition_spec_for(path, shape, mp, floor) == PartitionSpec()
                and sh.partition_spec_for(path, shape, mp, 0) != PartitionSpec()):
            whole += size
    if not total or whole < total / 4:
        return ""
    return (f"; {format_bytes(whole)} of its {format_bytes(total)} of weights are matrices "
            f"under min_shard_elements={request.min_shard_elements} elements, which every "
            "device holds whole: plan_mesh(..., min_shard_elements=0) splits them too")


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
        "step_flops": plan.step_flops,
    }


def _record_fields(record: Mapping[str, Any]) -> dict[str, Any]:
    """A stored plan record read into a `Plan`'s figures; raises `KeyError`, `TypeError` or
    `ValueError` where the record is not one (a row damaged in a sound file)."""
    model = record["memory_model"]
    return {
        "data_parallel": int(record["data_parallel"]),
        "model_parallel": int(record["model_parallel"]),
        "batch_size": int(record["batch_size"]),
        "estimate": MemoryEstimate(**record["estimate"]),
        "memory_model": MemoryModel(
            fixed_bytes=float(model["fixed_bytes"]),
            bytes_per_sample=float(model["bytes_per_sample"]),
            probe_batches=tuple(int(b) for b in model["probe_batches"]),
            probe_peaks=tuple(int(p) for p in model["probe_peaks"]),
            batch_multiple=int(model["batch_multiple"]),
            floor_bytes=float(model["floor_bytes"]),
        ),
        "compiled_peaks": tuple((int(b), int(p)) for b, p in record["compiled_peaks"]),
        "prefetch_bytes": int(record.get("prefetch_bytes", 0)),
        "eval_chunk": int(record.get("eval_chunk", 0)),
        "eval_peak_bytes": int(record.get("eval_peak_bytes", 0)),
        "step_flops": record.get("step_flops"),
    }


def _plan_from_record(fields: Mapping[str, Any], request: _Request) -> Plan:
    """A cached plan (`_record_fields`) on the request's devices: mesh and shardings rebuilt
    from the sharding rules."""
    dp, mp = fields["data_parallel"], fields["model_parallel"]
    devs, budget = request.devices, request.budget
    mesh = sh.make_mesh(devs, dp, mp)
    shardings = default_step_shardings(mesh, *request.state, request.optimizer,
                                       min_shard_elements=request.min_shard_elements)
    estimate = fields["estimate"]
    return Plan(
        mesh=mesh,
        data_parallel=dp,
        model_parallel=mp,
        param_shardings=shardings.params,
        batch_sharding=shardings.batch,
        step_shardings=shardings,
        batch_size=fields["batch_size"],
        peak_bytes_per_device=estimate.peak,
        memory_per_device=budget.memory_per_device,
        safety_margin=budget.safety_margin,
        estimate=estimate,
        memory_model=fields["memory_model"],
        devices=devs,
        planning_seconds=time.perf_counter() - request.start,
        compiles=0,
        compiled_peaks=fields["compiled_peaks"],
        cached=True,
        prefetch_bytes=fields["prefetch_bytes"],
        eval_chunk=fields["eval_chunk"],
        eval_peak_bytes=fields["eval_peak_bytes"],
        allowance_bytes=budget.allowance_bytes,
        device_budget=budget,
        step_flops=fields["step_flops"],
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
    e.g. powers of two. Other keyword arguments go to ``plan_mesh``; with its ``target``,
    ``devices`` is how many of the described GPUs there are, as for ``plan_mesh``. Raises
    ``DoesNotFitError`` (with the figures for the largest count) when no count works.
    """
    target = plan_kwargs.pop("target", None)
    devs = resolve_devices(devices) if target is None else _target_devices(target, devices)
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
