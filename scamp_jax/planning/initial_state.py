"""The initial state of a training run: one builder for trials, fused groups and restores.

A run starts from ``(params, opt_state, rest)``: the model ``build(nnx.Rngs(seed))`` split into
its trainable parameters and other state (`scamp_jax.planning.train_step.split_model`), and the
optimizer state of those parameters with the run's hyperparameters written into it (an
``optax.inject_hyperparams`` optimizer keeps them as data). Everything that starts a run makes
its state here:

- `InitialStates`: one compiled initialisation per architecture, group width and mesh shape, with
  the seed and the hyperparameters as arguments, so a run's initial state costs no compile once
  its architecture has started. ``make`` gives one run's state, ``make_group`` the stacked state
  of a fused group of ``K`` runs (a leading member axis; member ``i`` equals ``make`` with the
  ``i``-th seed and hyperparameters, bit for bit). The program is compiled for the host's CPU
  (`scamp_jax.planning.reuse.home_mesh`) on every backend and its result copied
  onto the run's devices: trials on other devices reuse the compile, an accelerator never
  compiles an initialisation (on a GPU that compile cost about as much as the step's, with
  XLA's autotuner holding the GPU meanwhile), and a seed gives the same initial state on every
  backend. On CPU devices the host's mesh mirrors the run's (the platform's first devices);
  elsewhere it is the host's first CPU device, the state made whole in host memory and split
  onto the run's devices by the copy.
- `abstract_initial_state`: the same state as ``jax.ShapeDtypeStruct``s carrying the shardings,
  the restore target of a resumed run (nothing is allocated).
- `init_train_state`: a model's state made where it lives, without a cache.

The state is created inside ``jax.jit`` with the state's shardings as output shardings, so no
device ever holds a whole unsharded copy of a sharded parameter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from scamp_jax.planning.compile_options import Purpose, compile_options
from scamp_jax.planning.reuse import compile_lowered, home_mesh
from scamp_jax.planning.train_step import StepShardings, split_model, stack_shardings

PyTree = Any
Build = Callable[[nnx.Rngs], nnx.Module]


def set_hyperparams(opt_state: PyTree, hyperparams: Mapping[str, Any]) -> PyTree:
    """``opt_state`` of an ``optax.inject_hyperparams`` optimizer with ``hyperparams`` written
    into it (each cast to the dtype it has there; traced values too)."""
    hyper = getattr(opt_state, "hyperparams", None)
    if hyper is None:
        if not hyperparams:
            return opt_state
        raise TypeError(
            "the optimizer state has no hyperparams; build the optimizer with "
            "optax.inject_hyperparams so the hyperparameters are data")
    for name, value in hyperparams.items():
        if name not in hyper:
            raise KeyError(
                f"optimizer has no injectable hyperparameter {name!r}; it has {sorted(hyper)}")
        hyper[name] = jnp.asarray(value, dtype=hyper[name].dtype)
    return opt_state


def _check_seeds(seeds: Sequence[int]) -> np.ndarray:
    for s in seeds:
        if not 0 <= int(s) < 2**31:
            raise ValueError(f"seed {s} is outside [0, 2**31); use e.g. runner.trial_seed")
    return np.asarray([int(s) for s in seeds], np.int32)


def _init_fn(build: Build, optimizer: optax.GradientTransformation,
             width: int | None) -> Callable[[jax.Array, Mapping[str, jax.Array]], PyTree]:
    """``init(seed, hyper) -> (params, opt_state, rest)``, vmapped over members for a group."""

    def init(seed: jax.Array, hyper: Mapping[str, jax.Array]) -> PyTree:
        # nnx.Rngs(int) seeds with jax.random.key(int): the same key, traced
        _, params, rest = split_model(build(nnx.Rngs(jax.random.key(seed))))
        return params, set_hyperparams(optimizer.init(params), hyper), rest

    return init if width is None else jax.vmap(init)


def _state_shardings(shardings: StepShardings, width: int | None) -> PyTree:
    s = shardings if width is None else stack_shardings(shardings)
    return s.params, s.opt_state, s.rest


def abstract_initial_state(
    build: Build,
    optimizer: optax.GradientTransformation,
    shardings: StepShardings,
    hyper_names: Sequence[str] = (),
    width: int | None = None,
) -> PyTree:
    """``(params, opt_state, rest)`` as ``jax.ShapeDtypeStruct``s with ``shardings`` (stacked
    over ``width`` members when given); nothing is compiled or allocated."""
    out = _state_shardings(shardings, width)
    seed = jax.ShapeDtypeStruct(() if width is None else (width,), jnp.int32)
    hyper = {k: jax.ShapeDtypeStruct(seed.shape, jnp.float32) for k in hyper_names}
    with jax.set_mesh(shardings.mesh):
        shapes = jax.eval_shape(_init_fn(build, optimizer, width), seed, hyper)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, out)


class InitialStates:
    """Compiled initialisations by architecture, width and mesh shape (thread-safe).

    ``misses`` counts the compiles, ``hits`` the states made without one. ``home_on_cpu``:
    compile for the host's CPU and copy the result onto the run's devices (see the module doc;
    False: compile for the run's own devices, where the state is made directly: nothing is
    transferred and no device holds more than its shards).
    """

    def __init__(self, home_on_cpu: bool = True) -> None:
        self.home_on_cpu = home_on_cpu
        self._lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}
        self._compiled: dict[Any, Any] = {}
        self.hits = 0
        self.misses = 0

    def make(
        self,
        architecture: Any,
        build: Build,
        optimizer: optax.GradientTransformation,
        shardings: StepShardings,
        seed: int,
        hyperparams: Mapping[str, float],
    ) -> tuple[PyTree, PyTree, PyTree]:
        """``(params, opt_state, rest)`` of ``build(nnx.Rngs(seed))`` with ``hyperparams`` in
        the optimizer state, placed with ``shardings``.

        ``architecture`` is a hashable key of what ``build`` makes (equal keys: the same
        program, whatever the seed); the values equal a jitted ``build(nnx.Rngs(seed))``.
        """
        seeds = _check_seeds([seed])[0]
        hyper = {k: np.float32(v) for k, v in hyperparams.items()}
        return self._make(architecture, build, optimizer, shardings, seeds, hyper, None)

    def make_group(
        self,
        architecture: Any,
        build: Build,
        optimizer: optax.GradientTransformation,
        shardings: StepShardings,
        seeds: Sequence[int],
        hyperparams: Mapping[str, Sequence[float] | np.ndarray],
    ) -> tuple[PyTree, PyTree, PyTree]:
        """The stacked state of ``len(seeds)`` runs of one architecture (a fused group):
        member ``i`` is ``make(..., seeds[i], {k: v[i]})``, stacked on a leading axis and
        placed with ``shardings`` (a member's) stacked (`train_step.stack_shardings`)."""
        width = len(seeds)
        if width < 1:
            raise ValueError("a group needs at least one seed")
        hyper = {k: np.asarray(v, np.float32) for k, v in hyperparams.items()}
        for k, v in hyper.items():
            if v.shape != (width,):
                raise ValueError(f"hyperparameter {k!r} has shape {v.shape}; the group of "
                                 f"{width} needs one value per member, shape ({width},)")
        return self._make(architecture, build, optimizer, shardings, _check_seeds(seeds),
                          hyper, width)

    def _make(self, architecture: Any, build: Build, optimizer: optax.GradientTransformation,
              shardings: StepShardings, seeds: np.ndarray, hyper: Mapping[str, np.ndarray],
              width: int | None) -> tuple[PyTree, PyTree, PyTree]:
        mesh = shardings.mesh
        devices = list(mesh.devices.flat)
        home = home_mesh(mesh) if self.home_on_cpu else mesh
        platform = home.devices.flat[0].platform

        def rehome(tree: PyTree) -> PyTree:
            return jax.tree.map(
                lambda s: NamedSharding(home, s.spec, memory_kind=s.memory_kind), tree,
                is_leaf=lambda x: isinstance(x, NamedSharding))

        target = _state_shardings(shardings, width)
        out = rehome(target)
        names = tuple(sorted(hyper))
        specs = tuple(s.spec for s in jax.tree.leaves(
            out, is_leaf=lambda x: isinstance(x, NamedSharding)))
        home_ids = tuple(d.id for d in home.devices.flat)
        key = (architecture, width, home_ids, home.devices.shape, names, specs)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self.hits += 1
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        if compiled is None:
            with key_lock:
                with self._lock:
                    compiled = self._compiled.get(key)
                    if compiled is not None:
                        self.hits += 1
                if compiled is None:
                    seed_shape = () if width is None else (width,)
                    with jax.set_mesh(home):
                        lowered = jax.jit(_init_fn(build, optimizer, width),
                                          out_shardings=out).lower(
                            jax.ShapeDtypeStruct(seed_shape, jnp.int32),
                            {k: jax.ShapeDtypeStruct(seed_shape, jnp.float32) for k in names},
                        )
                    compiled = compile_lowered(lowered, compile_options(platform, Purpose.INIT))
                    with self._lock:
                        self._compiled[key] = compiled
                        self.misses += 1
        # explicit transfers of the arguments (replicated on the home mesh)
        replicated = NamedSharding(home, PartitionSpec())
        args = jax.device_put((seeds, {k: hyper[k] for k in names}), replicated)
        state = compiled(*args)
        if list(home.devices.flat) == devices:
            return state
        # A copy onto the run's devices (the step donates params: never alias the home copy).
        return jax.device_put(state, target)


def init_train_state(
    build: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    shardings: StepShardings,
) -> tuple[nnx.GraphDef, PyTree, PyTree, PyTree]:
    """``(graphdef, params, opt_state, rest)`` of a new ``build()`` created on its shardings.

    ``build`` (e.g. ``lambda: Model(..., rngs=nnx.Rngs(0))``) runs inside ``jax.jit`` with the
    state's shardings as output shardings, so every parameter is initialised where it lives: no
    device ever holds a whole unsharded copy (unlike building eagerly, which puts the model on
    the default device, and `place_train_state`). Nothing moves between devices.
    """
    graphdef = split_model(nnx.eval_shape(build))[0]
    params, opt_state, rest = InitialStates(home_on_cpu=False).make(
        None, lambda rngs: build(), optimizer, shardings, 0, {})
    return graphdef, params, opt_state, rest
