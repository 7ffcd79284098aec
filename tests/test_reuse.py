"""Trials of a planned architecture compile no training step and no initialisation of their own:
the planner's run-grade step runs as is (on other CPU devices, loaded there), and the
initialisation, traced once per architecture (the seed an argument), is computed with NumPy for
every trial (`scamp_jax.planning.host_init`). Compiles are counted from JAX's compile events."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scamp_jax.hpo.overhead import TRACE_EVENT
from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
from scamp_jax.planning.compile_events import CompileCounter
from scamp_jax.planning.initial_state import InitialStates
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.planning.reuse import load_on_devices
from scamp_jax.planning.train_step import split_model
from scamp_jax.space import SearchSpace


class MLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(16, width, rngs=rngs)
        self.out = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


class Classify:
    """Four classes of Gaussian blobs (generated); metric held-out accuracy."""

    metric = "accuracy"
    direction = "maximize"

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((batch_size, 16), jnp.float32),
                jax.ShapeDtypeStruct((batch_size,), jnp.int32))

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng(seed)
        centres = np.random.default_rng(0).normal(size=(4, 16)).astype(np.float32)
        while True:
            y = rng.integers(0, 4, batch_size).astype(np.int32)
            yield centres[y] + 0.3 * rng.normal(size=(batch_size, 16)).astype(np.float32), y

    def loss_fn(self, model: nnx.Module, batch: Any) -> jax.Array:
        import optax

        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        x, y = next(self.batches(64, 99))
        return {"accuracy": float((np.asarray(model(jnp.asarray(x))).argmax(-1) == y).mean())}


SPACE = SearchSpace("mlp", lambda trial: {"width": 32},
                    lambda config, rngs: MLP(int(config["width"]), rngs))


def _run(plan: Any, devices: list[jax.Device], seed: int, lr: float,
         cache: StepCache, losses: list[float] | None = None) -> CompileCounter:
    spec = RunSpec(number=seed, params={"width": 32, "learning_rate": lr},
                   plan=plan.with_devices(devices), steps=3, memory_per_device=8 * 2**20,
                   seed=seed, log_every=1)
    seen: list[float] = []
    with CompileCounter() as count:
        result = run_trial(spec, SPACE, Classify(), cache=cache,
                           on_loss=lambda number, step, loss: seen.append(loss))
    assert result.state == "complete", result.reason
    if losses is not None:
        losses.extend([*seen, result.metrics["accuracy"]])
    return count


def test_trials_of_a_planned_architecture_compile_no_step_and_no_initialisation():
    task = Classify()
    model = nnx.eval_shape(lambda: SPACE.build({"width": 32}, nnx.Rngs(0)))
    devices = jax.devices()
    with CompileCounter() as planning:
        plan = plan_mesh(model, task.sample_batch(1), devices=devices[:1],
                         memory_per_device="8MiB", optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn, max_batch_size=32)
    assert plan.compiled_step is not None  # run grade on CPU too, by default
    assert planning.compiles["jit(step)"] == plan.compiles == 1
    cache = StepCache()
    first = _run(plan, devices[:1], seed=1, lr=1e-2, cache=cache)
    assert first.compiles["jit(step)"] == 0  # the planner's executable
    assert first.compiles["jit(init)"] == 0  # computed with NumPy
    # Another seed and learning rate on another device: the planner's executable is loaded
    # there (the same machine code), nothing is compiled.
    other = _run(plan, devices[1:2], seed=2, lr=3e-3, cache=cache)
    assert other.compiles["jit(step)"] == 0 and other.compiles["jit(init)"] == 0
    again = _run(plan, devices[1:2], seed=3, lr=1e-3, cache=cache)
    assert again.compiles["jit(step)"] == 0 and again.compiles["jit(init)"] == 0
    executables = cache.executables
    assert (executables.hits, executables.moves, executables.misses) == (3, 1, 0)


def test_a_step_loaded_onto_another_device_trains_as_one_compiled_there_bit_for_bit():
    task = Classify()
    model = nnx.eval_shape(lambda: SPACE.build({"width": 32}, nnx.Rngs(0)))
    plan = plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     loss_fn=task.loss_fn, max_batch_size=32)
    runs: list[list[float]] = []
    for ready in (plan, dataclasses.replace(plan, compiled_step=None)):
        cache, losses = StepCache(), []
        count = _run(ready, jax.devices()[3:4], seed=5, lr=1e-2, cache=cache, losses=losses)
        assert count.compiles["jit(step)"] == (0 if ready is plan else 1)
        assert cache.executables.moves == (1 if ready is plan else 0)
        runs.append(losses)
    assert len(runs[0]) == 4 and runs[0] == runs[1]  # three losses and the accuracy


def test_a_trial_on_the_planned_devices_traces_no_step_of_its_own():
    """The planner's jitted step (``plan.step_source``) serves a trial that would build the same
    step: its lowering, checked against the planner's executable, is JAX's cache hit, so the run
    traces nothing. On other devices, for a plan without the step (as one from a plan cache)
    or for another loss function, the trial traces its own; all of them train alike."""
    task = Classify()  # the study's one task: the planner's loss is the run's
    model = nnx.eval_shape(lambda: SPACE.build({"width": 32}, nnx.Rngs(0)))
    devices = jax.devices()
    plan = plan_mesh(model, task.sample_batch(1), devices=devices[:1],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     loss_fn=task.loss_fn, max_batch_size=32)
    assert plan.step_source is not None
    traced: list[str] = []

    def on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == TRACE_EVENT and kwargs.get("fun_name") == "step":
            traced.append(event)

    runs = []
    for ready, run_task, traces, counts in (
            (plan, task, 0, (1, 0, 0)),
            (plan.with_devices(devices[1:2]), task, 1, (1, 1, 0)),
            (dataclasses.replace(plan, step_source=None), task, 1, (1, 0, 0)),
            (plan, Classify(), 1, (1, 0, 0))):  # another task object: another loss function
        cache, seen = StepCache(), []
        spec = RunSpec(number=0, params={"width": 32, "learning_rate": 1e-2}, plan=ready,
                       steps=3, memory_per_device=8 * 2**20, seed=4, log_every=1)
        traced.clear()
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            result = run_trial(spec, SPACE, run_task, cache=cache,
                               on_loss=lambda number, step, loss, seen=seen: seen.append(loss))
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
        assert result.state == "complete", result.reason
        assert len(traced) == traces
        executables = cache.executables
        assert (executables.hits, executables.moves, executables.misses) == counts
        runs.append([*seen, result.metrics["accuracy"]])
    assert len(runs[0]) == 4 and all(run == runs[0] for run in runs[1:])


def test_a_sharded_executable_loads_onto_other_devices_device_for_device():
    """Two devices in mesh order [0, 1] moved onto [5, 4]: the shard device 0 held is on 5,
    the values are those of the executable compiled for [5, 4], and nothing is compiled."""
    def f(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = jnp.tanh(x @ w)
        return y.sum(), y

    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(16, 16)).astype(np.float32)
    devices = jax.devices()

    def placed(ids: list[int]) -> tuple[jax.Array, jax.Array]:
        mesh = Mesh(np.asarray([devices[i] for i in ids]), ("data",))
        return (jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))),
                jax.device_put(w, NamedSharding(mesh, PartitionSpec())))

    source = jax.jit(f).lower(*placed([0, 1])).compile()
    with CompileCounter() as count:
        moved = load_on_devices(source, [0, 1], [devices[5], devices[4]])
    assert moved is not None and count.total == 0
    args = placed([5, 4])
    total, y = moved(*args)
    want_total, want = jax.jit(f).lower(*args).compile()(*args)
    assert float(total) == float(want_total)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert [(s.device.id, s.index[0].start) for s in y.addressable_shards] == [(5, 0), (4, 4)]
    assert load_on_devices(source, [0, 1], devices[4:5]) is None  # another count
    # a moved executable is marked read back (never moved again) only while something holds it
    from scamp_jax.planning import reuse

    assert reuse.read_back(moved) and not reuse.read_back(source)
    held = weakref.ref(moved)
    del moved, total, y
    gc.collect()
    assert held() is None  # the set of those read back does not keep it


def test_another_wrapper_of_an_executable_read_back_is_read_back_too():
    """JAX hands a second compile of one lowering the executable it already holds, in a new
    ``Compiled`` and with no cache event: that one is read back as well."""
    from scamp_jax.planning import reuse

    lowered = jax.jit(lambda x: x * 3 + 1).lower(jnp.ones((4,)))
    first = lowered.compile()
    reuse._mark_read_back(first)
    second = lowered.compile()
    assert second is not first
    assert second.runtime_executable() is first.runtime_executable()
    assert reuse.read_back(second)
    assert not reuse.read_back(jax.jit(lambda x: x * 5).lower(jnp.ones((4,))).compile())


def test_without_jax_s_private_unpickler_a_program_is_not_moved_and_a_trial_compiles(
        monkeypatch):
    """Moving an executable rests on a private JAX class; a JAX without it (simulated here by
    removing it: a future release cannot be installed in a test) moves nothing, and the
    cache compiles the program for the trial's devices instead."""
    from jax.experimental import serialize_executable

    from scamp_jax.planning import reuse

    monkeypatch.delattr(serialize_executable, "_JaxPjrtUnpickler")
    monkeypatch.setattr(reuse, "_MOVING_UNPICKLER", None)
    x = jnp.ones((4, 4))
    devices = jax.devices()
    lowered = jax.jit(jnp.tanh).lower(jax.device_put(x, devices[0]))
    assert load_on_devices(lowered.compile(), [0], devices[1:2]) is None
    cache = reuse.ExecutableCache()
    cache.compiled(lowered, devices[:1])
    moved_lowered = jax.jit(jnp.tanh).lower(jax.device_put(x, devices[1]))
    with CompileCounter() as count:
        executable = cache.compiled(moved_lowered, devices[1:2])
    assert count.total == 1 and (cache.moves, cache.misses) == (0, 2)
    np.testing.assert_array_equal(np.asarray(executable(jax.device_put(x, devices[1]))),
                                  np.tanh(np.ones((4, 4), np.float32)))


#: How far a float of the NumPy initialisation may be from JAX's jitted one: units in the last
#: place of the leaf's largest magnitude. The random bits are the same; XLA's ``erf_inv`` (the
#: normal initialisers) is its own float32 approximation and it contracts ``a * b + c`` into one
#: rounding, NumPy rounds each operation once (`host_init`): 4-6 units measured on the MLPs,
#: ViT and SwinIRs of `benchmarks.memory_accuracy`.
ULPS_OF_LEAF = 8


def assert_initialisations_agree(got: Any, want: Any) -> None:
    """Integers and keys equal; floats within `ULPS_OF_LEAF` of the leaf's largest magnitude."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        g, w = np.asarray(g), np.asarray(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        if np.issubdtype(w.dtype, np.floating) and w.size:
            np.testing.assert_allclose(
                g, w, rtol=0, atol=ULPS_OF_LEAF * np.spacing(np.abs(w).max()))
        else:
            np.testing.assert_array_equal(g, w)


def test_one_traced_initialisation_makes_each_seeds_model_without_a_compile():
    states = InitialStates()
    plan = plan_mesh(nnx.eval_shape(lambda: MLP(8, nnx.Rngs(0))),
                     jax.ShapeDtypeStruct((1, 16), jnp.float32), devices=jax.devices()[2:4],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     max_batch_size=8, compile_for_run=False)
    optimizer = make_optimizer({})
    for seed, lr in ((0, 1e-2), (7, 3e-4)):
        with CompileCounter() as count:
            params, opt_state, rest = states.make(
                "mlp8", lambda rngs: MLP(8, rngs), optimizer, plan.step_shardings, seed,
                {"learning_rate": lr})
        assert count.compiles["jit(init)"] == 0
        _, want, _ = split_model(MLP(8, nnx.Rngs(seed)))
        assert_initialisations_agree(params, want)
        assert {d.id for d in jax.tree.leaves(params)[0].devices()} == {2, 3}
        assert float(opt_state.hyperparams["learning_rate"]) == np.float32(lr)
        again = states.make("mlp8", lambda rngs: MLP(8, rngs), optimizer,
                            plan.step_shardings, seed, {"learning_rate": lr})
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves((params, opt_state, rest)),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (states.misses, states.hits, states.compiles) == (1, 3, 0)


class Orthogonal(nnx.Module):
    """A layer whose initialiser takes a QR decomposition (no NumPy rule: compiled)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.kernel = nnx.Param(nnx.initializers.orthogonal()(rngs.params(), (16, 4)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel


def test_an_initialisation_with_an_operation_numpy_lacks_is_compiled_once():
    states = InitialStates()
    plan = plan_mesh(nnx.eval_shape(lambda: Orthogonal(nnx.Rngs(0))),
                     jax.ShapeDtypeStruct((1, 16), jnp.float32), devices=jax.devices()[:1],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     max_batch_size=8, compile_for_run=False)
    optimizer = make_optimizer({})
    with CompileCounter() as count:
        for seed in (1, 2):
            params, _, _ = states.make("orthogonal", Orthogonal, optimizer,
                                       plan.step_shardings, seed, {"learning_rate": 1e-3})
            want = jax.jit(lambda s: split_model(Orthogonal(nnx.Rngs(jax.random.key(s))))[1])(seed)
            for got, exp in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    assert count.compiles["jit(init)"] == 1
    assert (states.misses, states.hits, states.compiles) == (1, 1, 1)


def test_without_a_cpu_backend_states_are_made_on_the_runs_own_devices(monkeypatch):
    """``JAX_PLATFORMS=cuda`` starts JAX without its CPU backend, where asking for CPU devices
    raises: a trial's state is then made on its own devices, the same values, and
    `initial_model` takes the first device. This machine has only CPUs, so JAX's answer for
    a missing backend is stood in for (its RuntimeError, as ``jax._src.xla_bridge`` says it)."""
    from scamp_jax.planning import reuse
    from scamp_jax.planning.initial_state import initial_model

    plan = plan_mesh(nnx.eval_shape(lambda: MLP(8, nnx.Rngs(0))),
                     jax.ShapeDtypeStruct((1, 16), jnp.float32), devices=jax.devices()[2:4],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     max_batch_size=8, compile_for_run=False)
    optimizer = make_optimizer({})
    with_cpu = InitialStates().make("mlp8", lambda rngs: MLP(8, rngs), optimizer,
                                    plan.step_shardings, 3, {"learning_rate": 1e-3})
    local_devices = jax.local_devices

    def no_cpu_backend(*args: Any, backend: Any = None, **kw: Any) -> list[jax.Device]:
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu requested, but no platforms that are "
                               "instances of cpu are present. Platforms present are: cuda")
        return local_devices(*args, backend=backend, **kw)

    monkeypatch.setattr(jax, "local_devices", no_cpu_backend)
    assert reuse.host_cpu_devices() == []
    assert reuse.home_mesh(plan.mesh) is plan.mesh
    without = InitialStates().make("mlp8", lambda rngs: MLP(8, rngs), optimizer,
                                   plan.step_shardings, 3, {"learning_rate": 1e-3})
    for a, b in zip(jax.tree.leaves(without), jax.tree.leaves(with_cpu), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
    model = initial_model(lambda rngs: MLP(8, rngs), 3)
    np.testing.assert_array_equal(np.asarray(model.hidden.kernel[...]),
                                  np.asarray(jax.tree.leaves(with_cpu[0])[1]))


def test_a_fused_groups_members_are_the_solo_states_and_groups_compile_nothing():
    """One builder for solo runs and fused groups: member i of a group is, bit for bit, the
    solo state of seed i and its hyperparameters, and groups of any width, seeds and devices
    share one traced initialisation and compile nothing."""
    states = InitialStates()
    plan = plan_mesh(nnx.eval_shape(lambda: MLP(8, nnx.Rngs(0))),
                     jax.ShapeDtypeStruct((1, 16), jnp.float32), devices=jax.devices()[:2],
                     memory_per_device="8MiB", optimizer=make_optimizer({}),
                     max_batch_size=8, compile_for_run=False)
    optimizer = make_optimizer({})
    build = lambda rngs: MLP(8, rngs)  # noqa: E731
    with CompileCounter() as count:
        for devices, seeds, lrs in ((jax.devices()[:2], [3, 5], [1e-2, 3e-4]),
                                    (jax.devices()[2:4], [9, 4], [2e-3, 5e-2])):
            shardings = plan.with_devices(devices).step_shardings
            group = states.make_group("mlp8", build, optimizer, shardings, seeds,
                                      {"learning_rate": lrs})
            assert {d.id for d in jax.tree.leaves(group)[0].devices()} == {d.id for d in devices}
            for i, (seed, lr) in enumerate(zip(seeds, lrs, strict=True)):
                member = states.make("mlp8", build, optimizer, shardings, seed,
                                     {"learning_rate": lr})
                for got, want in zip(jax.tree.leaves(group), jax.tree.leaves(member),
                                     strict=True):
                    if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
                        got, want = jax.random.key_data(got), jax.random.key_data(want)
                    np.testing.assert_array_equal(np.asarray(got)[i], np.asarray(want))
    assert count.compiles["jit(init)"] == 0
    assert (states.misses, states.hits, states.compiles) == (1, 5, 0)
    with np.testing.assert_raises(ValueError):
        states.make_group("mlp8", build, optimizer, shardings, [1, 2], {"learning_rate": [1.0]})


class ClassifyInChunks(Classify):
    """`Classify` evaluated in planned chunks (the `ChunkedEvalTask` methods): 40 held-out
    samples, so a chunk smaller than the set leaves a padded last one."""

    def eval_inputs(self) -> list[np.ndarray]:
        return [next(self.batches(40, 99))[0]]

    def eval_forward(self, model: nnx.Module, x: jax.Array) -> jax.Array:
        return model(x)

    def score(self, outputs: list[np.ndarray]) -> dict[str, float]:
        y = next(self.batches(40, 99))[1]
        return {"accuracy": float((outputs[0].argmax(-1) == y).mean())}


def test_evaluation_is_compiled_once_per_architecture_and_chunk_by_the_planner():
    task = ClassifyInChunks()
    model = nnx.eval_shape(lambda: SPACE.build({"width": 32}, nnx.Rngs(0)))
    devices = jax.devices()[:1]
    with CompileCounter() as planning:
        plan = plan_mesh(model, task.sample_batch(1), devices=devices,
                         memory_per_device="8MiB", optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn, max_batch_size=32, eval_task=task)
    assert plan.eval_chunk > 0 and plan.evaluator is not None
    assert planning.compiles["jit(run)"] >= 1  # the forward at the chunks the planner tried
    cache = StepCache()
    for seed in (1, 2):
        spec = RunSpec(number=seed, params={"width": 32, "learning_rate": 1e-2},
                       plan=plan.with_devices(devices), steps=3, memory_per_device=8 * 2**20,
                       seed=seed, eval_every=2)
        with CompileCounter() as running:
            result = run_trial(spec, SPACE, task, cache=cache)
        assert result.state == "complete", result.reason
        assert 0.0 <= result.metrics["accuracy"] <= 1.0
        # the planner's compiled chunks evaluate (intermediate and final): nothing compiled
        assert running.compiles["jit(run)"] == 0 and running.compiles["jit(step)"] == 0
    # On another device the planner's compiled chunks and step are loaded there: a trial
    # compiles nothing and evaluates bit for bit as one that compiles its own programs there.
    other = jax.devices()[1:2]
    results, losses = [], []
    for ready in (plan, dataclasses.replace(plan, compiled_step=None, evaluator=None)):
        spec = RunSpec(number=3, params={"width": 32, "learning_rate": 1e-2},
                       plan=ready.with_devices(other), steps=3, memory_per_device=8 * 2**20,
                       seed=3, eval_every=2, log_every=1)
        seen: list[float] = []
        with CompileCounter() as running:
            results.append(run_trial(spec, SPACE, task, cache=StepCache(),
                                     on_loss=lambda number, step, loss, s=seen: s.append(loss)))
        assert results[-1].state == "complete", results[-1].reason
        losses.append(seen)
        if ready is plan:
            assert (running.compiles["jit(run)"], running.compiles["jit(step)"]) == (0, 0)
        else:  # its own step and chunks
            assert running.compiles["jit(run)"] >= 1 and running.compiles["jit(step)"] == 1
    assert results[0].metrics == results[1].metrics
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_held_out_inputs_in_float64_are_planned_as_the_float32_the_devices_hold():
    class InFloat64(ClassifyInChunks):
        def eval_inputs(self) -> list[np.ndarray]:
            return [x.astype(np.float64) for x in super().eval_inputs()]

    model = nnx.eval_shape(lambda: SPACE.build({"width": 32}, nnx.Rngs(0)))
    chunks = []
    for task in (ClassifyInChunks(), InFloat64()):  # no JAX warning of a truncated dtype
        plan = plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                         memory_per_device="8MiB", optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn, max_batch_size=32, eval_task=task)
        chunks.append((plan.eval_chunk, plan.eval_peak_bytes))
    assert chunks[0] == chunks[1]


def test_an_optimizer_of_another_state_under_one_architecture_key_gets_its_own_program():
    import optax

    states = InitialStates()
    build = lambda rngs: MLP(8, rngs)  # noqa: E731
    adam = make_optimizer({})
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2)
    for optimizer in (adam, sgd):
        plan = plan_mesh(nnx.eval_shape(lambda: MLP(8, nnx.Rngs(0))),
                         jax.ShapeDtypeStruct((1, 16), jnp.float32), devices=jax.devices()[:1],
                         memory_per_device="8MiB", optimizer=optimizer, max_batch_size=8,
                         compile_for_run=False)
        _, opt_state, _ = states.make("mlp8", build, optimizer, plan.step_shardings, 3,
                                      {"learning_rate": 1e-3})
        want = jax.eval_shape(optimizer.init, split_model(MLP(8, nnx.Rngs(3)))[1])
        assert jax.tree.structure(opt_state) == jax.tree.structure(want)
    assert (states.misses, states.compiles) == (2, 0)


class Bare(nnx.Module):
    """A module that keeps its width in its arrays only: every width has one graph
    definition."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, width)) / 4)
        self.v = nnx.Param(jax.random.normal(rngs.params(), (width, 4)) / 4)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.w) @ self.v


def test_sizes_of_one_graph_definition_get_their_own_plans_steps_and_evaluators():
    from scamp_jax.hpo.plan_service import PlanningService
    from scamp_jax.hpo.program_key import ProgramKey, evaluation_key, state_shapes
    from scamp_jax.hpo.settings import EngineConfig
    from scamp_jax.planning.budget import Budget

    space = SearchSpace("bare", lambda trial: {"width": 16},
                        lambda config, rngs: Bare(int(config["width"]), rngs))
    small, large = ({"width": w, "learning_rate": 1e-3} for w in (16, 4096))
    models = [nnx.eval_shape(lambda c=c: space.build(c, nnx.Rngs(0))) for c in (small, large)]
    assert split_model(models[0])[0] == split_model(models[1])[0]  # the case: one graph
    cfg = EngineConfig(steps=4, budget=Budget(64 * 2**20), max_batch_size=1 << 14)
    planning = PlanningService(space, Classify(), cfg, jax.devices()[:1], plan_mesh)
    plans = [planning.plan(c, devices=1) for c in (small, large)]
    alone = PlanningService(space, Classify(), cfg, jax.devices()[:1], plan_mesh).plan(
        large, devices=1)
    assert plans[1] is not plans[0]
    assert plans[1].batch_size == alone.batch_size < plans[0].batch_size
    assert plans[1].estimate.params == alone.estimate.params > plans[0].estimate.params
    # the run's step and the evaluation are keyed by the state's shapes too
    keys = [ProgramKey.of(split_model(m)[0], c, state_shapes(m)).run_step(plans[0], Classify)
            for m, c in zip(models, (small, large), strict=True)]
    assert keys[0] != keys[1]
    evals = [evaluation_key(split_model(m)[0], plans[0], Classify, split_model(m)[1:])
             for m in models]
    assert evals[0] != evals[1]


def test_a_mesh_over_all_the_hosts_cpu_devices_is_its_own_home() -> None:
    """A CPU mesh over as many devices as the host has (the conftest's 8) is made on those
    devices in its shape, not on one device."""
    from scamp_jax.planning import reuse
    from scamp_jax.planning.sharding import make_mesh

    host = reuse.host_cpu_devices()
    mesh = make_mesh(host, len(host) // 2, 2)
    home = reuse.home_mesh(mesh)
    assert home.devices.shape == mesh.devices.shape
    assert [d.id for d in home.devices.flat] == [d.id for d in host]
    smaller = reuse.home_mesh(make_mesh(host[:4], 2, 2))
    assert [d.id for d in smaller.devices.flat] == [d.id for d in host[:4]]
