"""The training step: one pure function shared by the memory estimator and the trial runner.

The planner predicts memory by compiling exactly this step with abstract arguments, and the
runner trains with exactly this step, so a prediction is about what actually runs.

The model is split into three state trees (``nnx.split(model, nnx.Param, ...)``):

- ``params``: the trainable ``nnx.Param`` variables, updated by the optimizer;
- ``opt_state``: the optax state, built from ``params``;
- ``rest``: everything else (RNG keys and counters, batch statistics, ...). It is threaded
  through the step because it changes on every call (e.g. dropout and drop-path RNG counters).

Hyperparameters are data: build optimizers with ``optax.inject_hyperparams`` so the learning rate
lives in ``opt_state`` and one compiled step serves every trial of an architecture.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any
LossFn = Callable[[nnx.Module, Any], jax.Array]
#: ``step(params, opt_state, rest, batch) -> (params, opt_state, rest, loss)``.
TrainStep = Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree, PyTree, jax.Array]]


def batch_inputs(batch: Any) -> Any:
    """The model input of ``batch``: the batch itself, or its first element for a tuple/list."""
    if isinstance(batch, tuple | list):
        if not batch:
            raise ValueError("batch is an empty tuple; pass an array or a tuple (inputs, ...)")
        return batch[0]
    return batch


def default_loss(model: nnx.Module, batch: Any) -> jax.Array:
    """Mean squared model output, a scalar (float32).

    A stand-in objective that exercises the full forward and backward pass when only memory or
    throughput matters. ``batch`` is an array of inputs ``(B, ...)`` or a tuple whose first element
    is the inputs; other elements (targets) are ignored.
    """
    inputs = batch_inputs(batch)
    if isinstance(batch, tuple | list) and len(batch) > 1:
        try:  # the rest of the batch is dropped: a model that wants more is told so
            inspect.signature(model).bind(inputs)
        except TypeError as err:
            raise TypeError(
                f"default_loss passes the model the first of its batch's {len(batch)} elements "
                f"and ignores the rest (targets), but {type(model).__name__} does not take one "
                f"input ({err}); pass a loss of your own, loss_fn=lambda model, batch: "
                "... -> scalar") from None
        except ValueError:  # no signature to read: the call says
            pass
    try:
        out = model(inputs)
    except Exception as err:
        if not isinstance(batch, Mapping):
            raise
        # a model that takes the dict itself trains as it is; one that does not is told why
        raise TypeError(
            f"default_loss passes the model its batch, here a {type(batch).__name__} of "
            f"{sorted(map(str, batch))}, which it could not take ({type(err).__name__}: {err}); "
            "pass a loss of your own, loss_fn=lambda model, batch: ... -> scalar") from err
    leaves = jax.tree.leaves(out)
    if not leaves:
        raise ValueError("the model returned no arrays; default_loss needs an array output")
    total = jnp.zeros((), jnp.float32)
    for leaf in leaves:
        total = total + jnp.mean(jnp.square(leaf.astype(jnp.float32)))
    return total


def default_optimizer() -> optax.GradientTransformation:
    """Adam with an injectable learning rate (``opt_state.hyperparams['learning_rate']``)."""
    return optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Split ``model`` into ``(graphdef, params, rest)``.

    ``params`` holds every ``nnx.Param``; ``rest`` every other variable (RNG state, batch
    statistics). Works on real models and on abstract ones from ``nnx.eval_shape``. A variable
    that holds a Python number (``nnx.Variable(0)``, a step counter, as Flax allows) is the
    array ``jnp.asarray`` makes of it, its type fixed (not weak), as a compiled step takes it;
    where none does, the states are ``nnx.split``'s own.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    return graphdef, _numbers_as_arrays(params), _numbers_as_arrays(rest)


def _numbers_as_arrays(state: nnx.State) -> nnx.State:
    """``state``, or a copy whose Python numbers are arrays (`_number_as_array`)."""
    if not any(isinstance(x, bool | int | float | complex) for x in jax.tree.leaves(state)):
        return state
    return jax.tree.map(_number_as_array, state)


def _number_as_array(x: Any) -> Any:
    """``x``, or the array of a Python number (its canonical dtype: int32 for an int)."""
    if isinstance(x, bool | int | float | complex):
        return jnp.asarray(x, dtype=jnp.asarray(x).dtype)
    return x


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn = default_loss,
    grad_reduce: Callable[[PyTree], PyTree] | None = None,
) -> TrainStep:
    """Return the pure training step ``step(params, opt_state, rest, batch)``.

    The step merges the model, computes ``loss_fn(model, batch)`` and its gradient with respect
    to ``params``, applies ``optimizer`` and returns ``(params, opt_state, rest, loss)`` where
    ``loss`` is the scalar loss before the update and ``rest`` carries the model's changed
    non-parameter state (RNG counters, batch statistics).

    ``grad_reduce``, when given, maps the pytree ``(grads, loss)`` to a pytree of the same
    structure before the optimizer update, e.g. the mean over MPI ranks of a data-parallel trial
    (`scamp_jax.distributed.data_parallel.mpi_mean`); the returned loss is the reduced one.
    """

    def step(params: PyTree, opt_state: PyTree, rest: PyTree, batch: PyTree):
        # ``rest`` is an argument (not a closure) and merge copies the variables, so they are
        # created at the gradient's trace level, where NNX allows RNG counters to change.
        def loss_and_rest(p: PyTree, r: PyTree) -> tuple[jax.Array, PyTree]:
            model = nnx.merge(graphdef, p, r, copy=True)
            loss = _scalar_loss(loss_fn(model, batch))
            new_rest = split_model(model)[2]
            return loss, new_rest

        (loss, new_rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(
            params, rest
        )
        if grad_reduce is not None:
            grads, loss = grad_reduce((grads, loss))
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state, new_rest, loss

    return step


class LossNotScalarError(TypeError):
    """A training loss that is not one number (a ``(loss, aux)`` pair, a per-sample array)."""


def _scalar_loss(loss: Any) -> Any:
    """``loss``, checked to be one number (JAX's error for anything else, of a gradient's
    output, is its own 50 lines deep)."""
    if isinstance(loss, tuple | list | dict):
        what = (f"a {type(loss).__name__} of {len(loss)}"
                + (" (loss, aux?)" if isinstance(loss, tuple) and len(loss) == 2 else ""))
    elif getattr(loss, "shape", ()) != ():
        what = f"an array of shape {tuple(loss.shape)}"
    else:
        return loss
    raise LossNotScalarError(
        f"loss_fn returned {what}, where the training step takes loss_fn(model, batch) -> "
        "the scalar loss: return the loss alone (a mean over the batch); the step keeps no "
        "auxiliary outputs (a task scores its models in its evaluation)")


@dataclass(frozen=True)
class StepShardings:
    """Shardings of the training step's arguments (``jax.sharding.Sharding`` pytrees).

    ``params``, ``opt_state`` and ``rest`` match the structure of the state trees; ``batch`` is one
    sharding applied to every batch leaf (leading axis = samples) or a tree matching the batch.
    """

    params: PyTree
    opt_state: PyTree
    rest: PyTree
    batch: PyTree

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The mesh all shardings live on (taken from the batch sharding)."""
        first = jax.tree.leaves(self.batch, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
        mesh = first.mesh if isinstance(first, NamedSharding) else None
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(
                f"StepShardings.batch must hold NamedShardings on a concrete Mesh, got {first!r}"
            )
        return mesh

    def replicated(self) -> NamedSharding:
        """A sharding that replicates a value on every device of the mesh (e.g. the loss)."""
        return NamedSharding(self.mesh, PartitionSpec())


def same_shardings(a: StepShardings, b: StepShardings) -> bool:
    """True when ``a`` and ``b`` place every argument of the step the same way."""
    if a is b:
        return True
    is_leaf = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    trees = [(s.params, s.opt_state, s.rest, s.batch) for s in (a, b)]
    flat = [jax.tree.flatten(t, is_leaf=is_leaf) for t in trees]
    # jaxlib ships no stub for PyTreeDef (the tree structures), so mypy cannot compare them
    return flat[0][1] == flat[1][1] and all(  # type: ignore[operator]
        x == y for x, y in zip(flat[0][0], flat[1][0], strict=True))


def placed(tree: PyTree, shardings: PyTree) -> PyTree:
    """``tree``'s ``ShapeDtypeStruct``s with ``shardings`` (a tree, or one for every leaf).

    Abstract arguments placed as a run's arrays are: a jitted step lowered at them is lowered
    at the run's arguments too, so the run's lowering of the same step is JAX's cache hit
    (`StepSource`).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: x.update(sharding=shardings), tree)
    return jax.tree.map(lambda x, s: x.update(sharding=s), tree, shardings)


@dataclass(frozen=True, eq=False)
class StepSource:
    """A jitted training step the planner lowered and compiled, with what it was made of.

    ``step`` is ``make(graphdef, optimizer, loss_fn, shardings)``, ``make`` being
    `jit_train_step` (a trial's step, `scamp_jax.planning.planner.Plan.step_source`) or
    `scamp_jax.planning.fusion.jit_fused_step` (a fused group's,
    `scamp_jax.planning.fusion.FusionPlan.step_source`). A run that would make the same step
    takes this one instead: the planner lowered it at abstract arguments placed as the run's
    arrays are (`placed`), so the run's lowering is JAX's own cache hit (no second trace), and
    the run still compares the lowered program's fingerprint with the planner's executable
    before running it.
    """

    step: jax.stages.Wrapped
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    loss_fn: LossFn
    shardings: StepShardings

    def serves(self, graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
               loss_fn: LossFn, shardings: StepShardings) -> bool:
        """True when the run's own step of ``graphdef``, ``optimizer``, ``loss_fn`` and
        ``shardings`` (made the same way) would be this step: the same optimizer object, an
        equal graph definition, loss function and shardings (a false answer only costs the run
        its own trace)."""
        return (optimizer is self.optimizer and loss_fn == self.loss_fn
                and graphdef == self.graphdef and same_shardings(shardings, self.shardings))


def _stack_sharding(s: Any) -> Any:
    if not isinstance(s, NamedSharding):
        raise TypeError(f"fused shardings need NamedShardings, got {s!r}")
    return NamedSharding(s.mesh, PartitionSpec(None, *s.spec), memory_kind=s.memory_kind)


def stack_shardings(shardings: StepShardings) -> StepShardings:
    """Shardings of a fused group's arguments from a member's (`StepShardings`).

    Every spec gains a leading unsharded member axis: each device holds all ``K`` members'
    shards of a parameter, and the per-member batch ``B`` stays split over ``'data'``.
    """
    def stack(tree: PyTree) -> PyTree:
        return jax.tree.map(_stack_sharding, tree, is_leaf=lambda x: isinstance(x, NamedSharding))

    return StepShardings(params=stack(shardings.params), opt_state=stack(shardings.opt_state),
                         rest=stack(shardings.rest), batch=stack(shardings.batch))


def jit_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    shardings: StepShardings,
    grad_reduce: Callable[[PyTree], PyTree] | None = None,
) -> jax.stages.Wrapped:
    """The training step jitted with ``shardings`` for inputs and outputs.

    ``params`` and ``opt_state`` are donated: their buffers are reused for the updated values, so
    callers must not touch the arrays they passed in after the call. The loss is replicated.
    ``grad_reduce`` is passed to `make_train_step`.
    """
    step = make_train_step(graphdef, optimizer, loss_fn, grad_reduce)
    return jax.jit(
        step,
        in_shardings=(shardings.params, shardings.opt_state, shardings.rest, shardings.batch),
        out_shardings=(
            shardings.params,
            shardings.opt_state,
            shardings.rest,
            shardings.replicated(),
        ),
        donate_argnums=(0, 1),
    )


def _copy_leaf(x: Any) -> Any:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jnp.copy(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jnp.copy(x)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def abstract_state(
    model: nnx.Module, optimizer: optax.GradientTransformation
) -> tuple[PyTree, PyTree, PyTree]:
    """``(params, opt_state, rest)`` as ``jax.ShapeDtypeStruct`` trees; nothing is allocated.

    ``model`` may be a real module or an abstract one made with
    ``nnx.eval_shape(lambda: Model(...))``. Shardings are dropped: the caller attaches the ones it
    plans to use.
    """
    _, params, rest = split_model(model)
    params = jax.tree.map(_abstract, params)
    rest = jax.tree.map(_abstract, rest)
    opt_state = jax.tree.map(_abstract, jax.eval_shape(optimizer.init, params))
    return params, opt_state, rest


def place_train_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    shardings: StepShardings,
) -> tuple[nnx.GraphDef, PyTree, PyTree, PyTree]:
    """``(graphdef, params, opt_state, rest)`` of a real ``model`` as arrays with ``shardings``.

    The arrays are copies: the step donates ``params``, which must not delete ``model``'s own
    buffers. The optimizer state is created directly with its shardings (inside ``jax.jit``), so
    it never exists whole on one device.
    """
    from scamp_jax.planning.targets import target_of

    devices = list(shardings.mesh.devices.flat)
    target = target_of(devices)
    if target is not None:  # JAX's own error: "not available with compile-only client"
        raise ValueError(
            f"these shardings are a plan for {len(devices)} {target.device_kind or 'GPU'} "
            f"device(s) (target {target.name!r}), which this process can only compile for, "
            "not place arrays on: train on such GPUs, with a plan made there (the same "
            "plan_mesh call without target=), or plan for this machine's devices")
    graphdef, params, rest = split_model(model)
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params)):
        raise TypeError(
            "place_train_state needs a real model with arrays, and this one is abstract (from "
            "nnx.eval_shape, as plan_mesh takes it); build the model itself, e.g. "
            "MyModel(..., rngs=nnx.Rngs(0)), and place that")
    if not _same_structure(params, shardings.params):
        raise ValueError(
            "place_train_state got a model whose tree of parameters is not the one its "
            "shardings were planned for (another architecture); place the model plan_mesh "
            "planned, or plan this one")
    if not _same_structure(jax.eval_shape(optimizer.init, params), shardings.opt_state):
        raise ValueError(
            "place_train_state got an optimizer whose state is not the one its shardings were "
            "planned for; pass the optimizer given to plan_mesh (when none was given, "
            "scamp_jax.planning.default_optimizer(), Adam with an injectable learning rate, "
            "not optax.adam)")
    # device_put may reuse the source buffer as one shard of a replicated array (even with
    # may_alias=False on jax 0.10), and donating that array would delete the model's own
    # buffer, so copy first.
    params = jax.device_put(jax.tree.map(jnp.copy, params), shardings.params)
    rest = jax.device_put(jax.tree.map(_copy_leaf, rest), shardings.rest)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    return graphdef, params, opt_state, rest


def _same_structure(tree: PyTree, shardings: PyTree) -> bool:
    """Whether ``shardings`` (a tree of shardings, or a prefix of it such as one sharding for
    all) fits the structure of ``tree``, as ``jax.device_put`` and ``jax.jit`` take them."""
    try:
        jax.tree.map(lambda sharding, _: sharding, shardings, tree,
                     is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    except (ValueError, TypeError):
        return False
    return True


def step_flops(
    model: nnx.Module, optimizer: optax.GradientTransformation, loss_fn: LossFn, batch: PyTree,
) -> float | None:
    """FLOPs of one training step of ``model`` on ``batch`` (arrays or ``ShapeDtypeStruct``s),
    from XLA's ``cost_analysis()`` of the lowered step (traced, not compiled); None if XLA gives
    no figure. The lowered program is not partitioned yet, so this is the step's total whatever
    mesh it later runs on (a plan's share per device divides it by the plan's devices)."""
    graphdef = split_model(model)[0]
    state = abstract_state(model, optimizer)
    batch = jax.tree.map(_abstract, batch)
    return lowered_flops(jax.jit(make_train_step(graphdef, optimizer, loss_fn)).lower(*state,
                                                                                     batch))


def compiled_flops(compiled: jax.stages.Compiled, devices: int) -> float | None:
    """FLOPs of one call of a compiled program over its ``devices``: XLA's ``cost_analysis()``
    of the optimised per-device program (what each device runs) times the devices; None if
    XLA gives no figure. Read from the executable, so it costs no conversion of the program
    (the lowering's figure, `lowered_flops`, converts the whole program to HLO first: 1.7 CPU
    s for the paper's SwinIR). It counts the program after XLA's optimisations and
    partitioning (collectives, fused ops, replicated work on every device): 0.3-3.0% above the
    lowering's for the steps measured (the paper's SwinIR on one device 0.3%, the small one on
    8 devices 1.3%, the tests' ConvNet 1.6% on one device and 3.0% on a 2x2 mesh)."""
    try:
        cost = compiled.cost_analysis()
    except (jax.errors.JaxRuntimeError, NotImplementedError):
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    return flops * devices if flops > 0 else None


def lowered_flops(lowered: jax.stages.Lowered) -> float | None:
    """FLOPs of a lowered program from XLA's ``cost_analysis()`` (before it is partitioned: the
    total over the devices it runs on; sharding annotations do not change it); None if XLA
    gives no figure (a GPU target's compile-only client has no cost analysis of lowerings)."""
    try:
        cost = lowered.cost_analysis()
    except jax.errors.JaxRuntimeError:
        return None
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    return flops if flops > 0 else None
