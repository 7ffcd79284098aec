"""The initial state of a training run: one builder for trials, fused groups and restores.

A run starts from ``(params, opt_state, rest)``: the model ``build(nnx.Rngs(seed))`` split into
its trainable parameters and other state (`scamp_jax.planning.train_step.split_model`), and the
optimizer state of those parameters with the run's hyperparameters written into it (an
``optax.inject_hyperparams`` optimizer keeps them as data). Everything that starts a run makes
its state here:

- `InitialStates`: one initialisation program per architecture, with the seed and the
  hyperparameters as arguments. The program is traced once and computed with NumPy on the host
  (`scamp_jax.planning.host_init`: JAX's random bits bit for bit, no compile at all), then each
  shard is copied onto the run's devices, so a new architecture's initial state costs a trace,
  not a compile, on every backend, and a seed gives the same state on every machine and
  backend, whatever XLA's version or options. ``make`` gives one run's state, ``make_group``
  the stacked state of a fused group of ``K`` runs (a leading member axis; member ``i`` equals
  ``make`` with the ``i``-th seed and hyperparameters, bit for bit: with NumPy the members are
  made one by one, compiled the group is the vmapped program). An initialisation with an
  operation NumPy has no rule for (e.g. an orthogonal initialiser's QR decomposition) is
  compiled instead, once per architecture, group width and mesh shape, for the host's CPU
  (`scamp_jax.planning.reuse.home_mesh`) on every backend, and its result copied onto the
  run's devices (on CPU devices the host's mesh mirrors the run's).
- `abstract_initial_state`: the same state as ``jax.ShapeDtypeStruct``s carrying the shardings,
  the restore target of a resumed run (nothing is allocated).
- `init_train_state`: a model's state compiled and made where it lives, without a cache.
- `initial_model`: the model a run of a seed starts from, to train in a loop of one's own.

No path ever puts a whole unsharded copy of a sharded parameter on a device: NumPy's result
is copied shard by shard, and a compiled program has the state's shardings as its output
shardings.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from scamp_jax._once import OncePerKey
from scamp_jax.planning import host_init
from scamp_jax.planning.compile_options import Purpose, compile_options
from scamp_jax.planning.reuse import compile_lowered, home_mesh, host_cpu_devices
from scamp_jax.planning.train_step import StepShardings, split_model, stack_shardings

PyTree = Any
Build = Callable[[nnx.Rngs], nnx.Module]
#: a hyperparameter's value: a scalar for one seed, ``(width,)`` values for a group's members
Hyper = np.float32 | np.ndarray
#: `jax.monitoring` duration event of each initial state made with NumPy (its trace, if new,
#: and its evaluation; no compile event is recorded for it: `scamp_jax.hpo.overhead` reports it).
HOST_INIT_EVENT = "/scamp_jax/initial_state/host"


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
    """Initialisation programs by architecture (thread-safe; see the module doc).

    ``misses`` counts the programs made (traced, or compiled where NumPy lacks a rule),
    ``hits`` the states made from one made before, ``compiles`` the compiled ones.
    ``home_on_cpu``: make the state on the host (with NumPy, or compiled for the host's CPU
    where NumPy lacks a rule) and copy it onto the run's devices; False: compile for the run's
    own devices, where the state is made directly: nothing is transferred and no device holds
    more than its shards (`init_train_state`).
    """

    def __init__(self, home_on_cpu: bool = True) -> None:
        self.home_on_cpu = home_on_cpu
        self._lock = threading.Lock()
        self._programs: OncePerKey[Any] = OncePerKey()
        self.hits = 0
        self.misses = 0
        self.compiles = 0

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

        ``architecture`` is a hashable key of what ``build`` and ``optimizer`` make (equal
        keys: the same program, whatever the seed and the named hyperparameters; the engine's
        program keys are such keys); the values are `initial_model`'s, within a few units in
        the last place of a jitted ``build(nnx.Rngs(seed))`` (`scamp_jax.planning.host_init`).
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
              shardings: StepShardings, seeds: np.ndarray, hyper: Mapping[str, Hyper],
              width: int | None) -> tuple[PyTree, PyTree, PyTree]:
        mesh = shardings.mesh
        devices = list(mesh.devices.flat)
        home = home_mesh(mesh) if self.home_on_cpu else mesh
        target = _state_shardings(shardings, width)
        names = tuple(sorted(hyper))
        start = time.perf_counter()
        host = _UNSUPPORTED
        if self.home_on_cpu:
            # the state's tree apart from its shardings: an optimizer of another state tree
            # under the same architecture key gets its own program
            tree = jax.tree.structure(target, is_leaf=lambda x: isinstance(x, NamedSharding))
            host_key = ("host", architecture, names, tree)
            host, made = self._programs.get(
                host_key, lambda: _HostProgram.trace(build, optimizer, names, home))
        if isinstance(host, _HostProgram):  # not `_UNSUPPORTED`
            state = host.make(seeds, hyper, width)
            self._count(made)
            jax.monitoring.record_event_duration_secs(HOST_INIT_EVENT,
                                                      time.perf_counter() - start)
            # A copy of each shard onto the run's devices (nothing unsharded on a device).
            return jax.device_put(state, target)
        platform = home.devices.flat[0].platform

        def rehome(tree: PyTree) -> PyTree:
            return jax.tree.map(
                lambda s: NamedSharding(home, s.spec, memory_kind=s.memory_kind), tree,
                is_leaf=lambda x: isinstance(x, NamedSharding))

        out = rehome(target)
        specs = tuple(s.spec for s in jax.tree.leaves(
            out, is_leaf=lambda x: isinstance(x, NamedSharding)))
        home_ids = tuple(d.id for d in home.devices.flat)

        def compile_init() -> Any:
            seed_shape = () if width is None else (width,)
            with jax.set_mesh(home):
                lowered = jax.jit(_init_fn(build, optimizer, width), out_shardings=out).lower(
                    jax.ShapeDtypeStruct(seed_shape, jnp.int32),
                    {k: jax.ShapeDtypeStruct(seed_shape, jnp.float32) for k in names},
                )
            compiled = compile_lowered(lowered, compile_options(platform, Purpose.INIT))
            with self._lock:
                self.compiles += 1
            return compiled

        compiled, made = self._programs.get(
            ("compiled", architecture, width, home_ids, home.devices.shape, names, specs),
            compile_init)
        self._count(made)
        # explicit transfers of the arguments (replicated on the home mesh)
        replicated = NamedSharding(home, PartitionSpec())
        args = jax.device_put((seeds, {k: hyper[k] for k in names}), replicated)
        state = compiled(*args)
        if list(home.devices.flat) == devices:
            return state
        # A copy onto the run's devices (the step donates params: never alias the home copy).
        return jax.device_put(state, target)

    def _count(self, made: bool) -> None:
        with self._lock:
            if made:
                self.misses += 1
            else:
                self.hits += 1


#: `InitialStates`' cache entry for an initialisation NumPy cannot evaluate (compiled instead).
_UNSUPPORTED = object()


class _HostProgram:
    """A model's initialisation traced once (``seed, hyper -> state``) and evaluated with NumPy
    (`scamp_jax.planning.host_init`): no compile, the same values for every run of a seed."""

    def __init__(self, closed: Any, out_tree: Any, keys: Sequence[bool]) -> None:
        self.closed, self.out_tree, self.keys = closed, out_tree, tuple(keys)

    @staticmethod
    def trace(build: Build, optimizer: optax.GradientTransformation, names: Sequence[str],
              home: jax.sharding.Mesh | None) -> Any:
        """The program of ``build``'s initialisation (traced under ``home``, the mesh the
        compiled one would run on, if any), or `_UNSUPPORTED` where an operation of it has no
        NumPy rule (`host_init.unsupported`)."""
        with jax.set_mesh(home) if home is not None else contextlib.nullcontext():
            closed, shapes = jax.make_jaxpr(_init_fn(build, optimizer, None), return_shape=True)(
                jax.ShapeDtypeStruct((), jnp.int32),
                {k: jax.ShapeDtypeStruct((), jnp.float32) for k in names})
        if host_init.unsupported(closed) is not None:
            return _UNSUPPORTED
        leaves, out_tree = jax.tree.flatten(shapes)
        keys = [jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key) for s in leaves]
        return _HostProgram(closed, out_tree, keys)

    def make(self, seeds: np.ndarray, hyper: Mapping[str, Hyper],
             width: int | None) -> PyTree:
        """The state of one seed (``width`` None) or the stacked states of ``width`` seeds,
        each member made alone (so member ``i`` is the solo state of ``seeds[i]``)."""
        names = sorted(hyper)

        def one(i: int | None) -> list[np.ndarray]:
            seed = seeds if i is None else seeds[i]
            # a group's (``i`` not None) values are arrays of one value per member
            values = [np.float32(hyper[k] if i is None else cast(np.ndarray, hyper[k])[i])
                      for k in names]
            return host_init.evaluate(self.closed, np.int32(seed), *values, checked=True)

        leaves: list[Any]  # NumPy arrays, then the state's leaves (key arrays among them)
        if width is None:
            leaves = one(None)
        else:
            members = [one(i) for i in range(width)]
            leaves = [np.stack(column) for column in zip(*members, strict=True)]
        leaves = [jax.random.wrap_key_data(leaf, impl="threefry2x32") if key
                  else np.asarray(leaf, order="C") for leaf, key in zip(leaves, self.keys,
                                                                        strict=True)]
        return jax.tree.unflatten(self.out_tree, leaves)


def init_train_state(
    build: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    shardings: StepShardings,
) -> tuple[nnx.GraphDef, PyTree, PyTree, PyTree]:
    """``(graphdef, params, opt_state, rest)`` of a new ``build()`` created on its shardings.

    ``build`` (e.g. ``lambda: Model(..., rngs=nnx.Rngs(0))``) runs inside ``jax.jit`` with the
    state's shardings as output shardings, so every parameter is initialised where it lives: no
    device ever holds a whole unsharded copy (unlike building eagerly, which puts the model on
    the default device, and `place_train_state`). Nothing moves between devices or from the
    host (a run's `InitialStates` computes its state on the host instead, without a compile).
    """
    graphdef = split_model(nnx.eval_shape(build))[0]
    params, opt_state, rest = InitialStates(home_on_cpu=False).make(
        None, lambda rngs: build(), optimizer, shardings, 0, {})
    return graphdef, params, opt_state, rest


def initial_model(build: Build, seed: int) -> nnx.Module:
    """The model a run of ``build`` with ``seed`` starts from, bit for bit (the parameters and
    other state `InitialStates` makes for it), on the host's first CPU device (the first
    device where JAX has no CPU backend): e.g. to train a trial's configuration in a loop of
    one's own. ``build(nnx.Rngs(seed))`` itself gives values within a few units in the last
    place of these (see `scamp_jax.planning.host_init`)."""
    from scamp_jax.planning.memory import default_step_shardings
    from scamp_jax.planning.sharding import make_mesh
    from scamp_jax.planning.train_step import abstract_state

    model = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    optimizer = optax.identity()
    mesh = make_mesh((host_cpu_devices() or jax.local_devices())[:1], 1, 1)
    shardings = default_step_shardings(mesh, *abstract_state(model, optimizer), optimizer)
    params, _, rest = InitialStates().make(None, build, optimizer, shardings, seed, {})
    return nnx.merge(split_model(model)[0], params, rest)
