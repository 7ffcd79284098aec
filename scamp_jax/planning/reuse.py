"""Compile once, run many: the executables and initialisations trials of one architecture share.

Trials of one architecture differ only in data (the seed, the optimizer's hyperparameters live in
its state), so what they compile is the same program:

- `ExecutableCache`: the training step's executable per program (the fingerprint of its
  lowering) and devices. The planner's own run-grade executable (`Plan.compiled_step`) is taken
  when it is the same program on the same devices; otherwise the first trial on those devices
  compiles it and later ones run it.
- `InitialStates`: one compiled initialisation per architecture and mesh shape, with the seed
  and the hyperparameters as arguments, so a trial's initial state costs no compile once its
  architecture has started. On CPU devices (slices of one host's memory) it is compiled once on
  the first devices of the platform and its result copied onto the trial's devices; on an
  accelerator it is compiled for the trial's own devices, where the state is made directly.

An XLA executable is bound to the devices it was compiled for, so these caches key by device ids.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from scamp_jax.planning.train_step import StepShardings, split_model

PyTree = Any

#: XLA options of the initialisation's compile on CPU: it runs once per trial, so its code speed
#: hardly matters, while LLVM's default optimisation makes its compile the slowest of a trial
#: (digits MLP: 2.7 CPU s at the default level, 0.58 at level 1, same values bit for bit; level
#: 0 rounds about 4% of the weights differently in the last place).
CPU_INIT_COMPILE: dict[str, str | bool] = {"xla_backend_optimization_level": "1"}


def lowered_fingerprint(lowered: jax.stages.Lowered) -> str:
    """SHA-256 of a lowered program's text (without source locations)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


class ExecutableCache:
    """Compiled training steps by program fingerprint and devices (thread-safe).

    ``hits`` counts the runs that compiled nothing (the planner's executable or an earlier
    trial's), ``misses`` the compiles.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, tuple[int, ...]], threading.Lock] = {}
        self._compiled: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.hits = 0
        self.misses = 0

    def compiled(self, lowered: jax.stages.Lowered, device_ids: tuple[int, ...],
                 ready: Any = None) -> Any:
        """The executable of ``lowered`` on ``device_ids``: ``ready`` (a `CompiledStep`) when it
        is the same program on the same devices, else a cached or a new compile (default XLA
        options). Trials of one program on the same devices wait for one compile."""
        fingerprint = lowered_fingerprint(lowered)
        key = (fingerprint, tuple(device_ids))
        with self._lock:
            if key in self._compiled:
                self.hits += 1
                return self._compiled[key]
            if (ready is not None and ready.fingerprint == fingerprint
                    and tuple(ready.device_ids) == key[1]):
                self.hits += 1
                self._compiled[key] = ready.executable
                return ready.executable
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._compiled:
                    self.hits += 1
                    return self._compiled[key]
            executable = lowered.compile()
            with self._lock:
                self.misses += 1
                self._compiled[key] = executable
            return executable


def set_hyperparams(opt_state: PyTree, hyperparams: Mapping[str, Any]) -> PyTree:
    """``opt_state`` of an ``optax.inject_hyperparams`` optimizer with ``hyperparams`` written
    into it (each cast to the dtype it has there)."""
    for name, value in hyperparams.items():
        old = opt_state.hyperparams[name]
        opt_state.hyperparams[name] = jnp.asarray(value, dtype=old.dtype)
    return opt_state


class InitialStates:
    """One compiled initialisation per architecture and mesh shape (thread-safe).

    ``misses`` counts the compiles, ``hits`` the initial states made without one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[Any, threading.Lock] = {}
        self._jitted: dict[Any, Callable[..., Any]] = {}
        self.hits = 0
        self.misses = 0

    def make(
        self,
        architecture: Any,
        build: Callable[[nnx.Rngs], nnx.Module],
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
        if not 0 <= int(seed) < 2**31:
            raise ValueError(f"seed {seed} is outside [0, 2**31); use e.g. runner.trial_seed")
        mesh = shardings.mesh
        devices = list(mesh.devices.flat)
        platform = devices[0].platform
        if platform == "cpu":
            # One host's memory: make it on the platform's first devices, copy it over.
            home = jax.local_devices(backend=platform)[: len(devices)]
            home_mesh = Mesh(np.asarray(home, dtype=object).reshape(mesh.devices.shape),
                             mesh.axis_names, axis_types=mesh.axis_types)
        else:
            home_mesh = mesh

        def rehome(tree: PyTree) -> PyTree:
            return jax.tree.map(
                lambda s: NamedSharding(home_mesh, s.spec, memory_kind=s.memory_kind), tree,
                is_leaf=lambda x: isinstance(x, NamedSharding))

        out = (rehome(shardings.params), rehome(shardings.opt_state), rehome(shardings.rest))
        names = tuple(sorted(hyperparams))
        specs = tuple(s.spec for s in jax.tree.leaves(
            out, is_leaf=lambda x: isinstance(x, NamedSharding)))
        key = (architecture, tuple(d.id for d in home_mesh.devices.flat),
               home_mesh.devices.shape, names, specs)
        with self._lock:
            jitted = self._jitted.get(key)
            if jitted is not None:
                self.hits += 1
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        if jitted is None:
            with key_lock:
                with self._lock:
                    jitted = self._jitted.get(key)
                if jitted is None:
                    def init(seed: jax.Array, hyper: Mapping[str, jax.Array]) -> PyTree:
                        # nnx.Rngs(int) seeds with jax.random.key(int): the same key, traced
                        _, params, rest = split_model(build(nnx.Rngs(jax.random.key(seed))))
                        return params, set_hyperparams(optimizer.init(params), hyper), rest

                    with jax.set_mesh(home_mesh):
                        jitted = jax.jit(init, out_shardings=out).lower(
                            jax.ShapeDtypeStruct((), jnp.int32),
                            {k: jax.ShapeDtypeStruct((), jnp.float32) for k in names},
                        ).compile(dict(CPU_INIT_COMPILE) if platform == "cpu" else None)
                    with self._lock:
                        self._jitted[key] = jitted
                        self.misses += 1
                else:
                    with self._lock:
                        self.hits += 1
        state = jitted(jnp.asarray(seed, jnp.int32),
                       {k: jnp.asarray(hyperparams[k], jnp.float32) for k in names})
        if tuple(d.id for d in home_mesh.devices.flat) == tuple(d.id for d in devices):
            return state
        # A copy onto the trial's devices (the step donates params: never alias the home copy).
        return jax.device_put(state, (shardings.params, shardings.opt_state, shardings.rest))
