"""Planning cost: compiles per plan, the persistent plan cache, and the runner reusing the
planner's compiled step. Compiles are counted from JAX's own compile events (real XLA compiles,
not lookups), and every plan's batch is checked by independent compiles."""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scamp_jax.hpo.runner import RunSpec, StepCache, make_optimizer, run_trial
from scamp_jax.planning.compile_events import CompileCounter
from scamp_jax.planning.plan_cache import PlanCache, function_identity, program_signature
from scamp_jax.planning.planner import plan_mesh
from scamp_jax.planning.train_step import (
    abstract_state,
    default_loss,
    default_optimizer,
    jit_train_step,
)
from scamp_jax.space import SearchSpace
from tests._models import CHANNELS, ConvNet

SIDE = 16
SAMPLE = jax.ShapeDtypeStruct((1, SIDE, SIDE, CHANNELS), jnp.float32)
BUDGET = "24MiB"


def _abstract(width: int = 32) -> ConvNet:
    return nnx.eval_shape(lambda: ConvNet(width, nnx.Rngs(0)))


def _peak(plan: Any, batch_size: int, options: dict[str, Any] | None = None) -> int:
    """An independent compile of the plan's step at ``batch_size``: its per-device peak."""
    model, tx = _abstract(), default_optimizer()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _, opt_state, _ = abstract_state(model, tx)
    step = jit_train_step(graphdef, tx, default_loss, plan.step_shardings)
    batch = jax.ShapeDtypeStruct((batch_size, *SAMPLE.shape[1:]), SAMPLE.dtype)
    stats = step.lower(params, opt_state, rest, batch).compile(options).memory_analysis()
    return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
            + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def _prefetch(plan: Any, batch_size: int) -> int:
    """Per-device bytes of the prefetched batch at ``batch_size`` (exactly linear)."""
    return round(plan.prefetch_bytes / plan.batch_size * batch_size)


def _assert_verified(plan: Any) -> None:
    assert _peak(plan, plan.batch_size) == plan.peak_bytes_per_device
    assert plan.peak_bytes_per_device + plan.prefetch_bytes <= plan.usable_bytes
    following = plan.batch_size + plan.data_parallel
    assert _peak(plan, following) + _prefetch(plan, following) > plan.usable_bytes


def test_a_new_plan_compiles_three_times_and_a_known_mesh_twice(tmp_path):
    with CompileCounter() as cold_count:
        cold = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device=BUDGET,
                         cache=PlanCache(tmp_path / "plans.sqlite"))
    # the counter sees exactly the training-step compiles the plan reports
    assert cold_count.compiles["jit(step)"] == cold.compiles
    assert cold.compiles <= 3 and cold.model_parallel == 1
    assert cold.batch_size > 8 * cold.data_parallel  # the search moved past its first probe
    _assert_verified(cold)
    # Another budget on the same mesh shape: the compiled points known from the first plan
    # put the model's first guess at the boundary: verify it and the next step up.
    with CompileCounter() as warm_count:
        warm = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device="16MiB",
                         cache=PlanCache(tmp_path / "plans.sqlite"))
    assert warm_count.compiles["jit(step)"] == warm.compiles <= 2
    assert warm.batch_size < cold.batch_size
    peaks = dict(warm.compiled_peaks)
    assert peaks[warm.batch_size] + warm.prefetch_bytes <= warm.usable_bytes
    following = warm.batch_size + warm.data_parallel
    assert _peak(warm, following) + _prefetch(warm, following) > warm.usable_bytes


class MLP(nnx.Module):
    """A small classifier: its training state, not its activations, sets the memory."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, width, rngs=rngs)
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def test_a_capped_plan_whose_first_guess_fits_compiles_once_and_once_cached_never(tmp_path):
    # The batch cap clearly fits by the bound from shapes, so the search compiles it first,
    # exactly, as its answer: one compile of the training step, none for the same plan again.
    model = nnx.eval_shape(lambda: MLP(256, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    kwargs: dict[str, Any] = dict(devices=1, memory_per_device="32MiB", max_batch_size=128)
    with CompileCounter() as count:
        plan = plan_mesh(model, sample, cache=PlanCache(tmp_path / "plans.sqlite"), **kwargs)
    assert count.compiles["jit(step)"] == plan.compiles == 1
    assert plan.batch_size == 128 and plan.predicted_peak_bytes <= plan.usable_bytes
    with CompileCounter() as again:
        cached = plan_mesh(model, sample, cache=PlanCache(tmp_path / "plans.sqlite"), **kwargs)
    assert again.compiles["jit(step)"] == 0 and cached.cached and cached == plan


def test_a_provisional_plan_takes_the_cap_from_shapes_compiles_nothing_and_is_not_cached(
        tmp_path):
    # A fused group's member: the shapes put the cap in reach, so no step is compiled, the
    # plan says it is provisional, and the plan cache keeps nothing of it (a solo plan of the
    # same model still compiles, and is the same decision, now checked).
    model = nnx.eval_shape(lambda: MLP(256, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    cache = PlanCache(tmp_path / "plans.sqlite")
    kwargs: dict[str, Any] = dict(devices=1, memory_per_device="32MiB", max_batch_size=128,
                                  cache=cache)
    with CompileCounter() as count:
        shaped = plan_mesh(model, sample, provisional=True, **kwargs)
    assert count.compiles["jit(step)"] == 0 and shaped.compiles == 0
    assert shaped.provisional and shaped.compiled_step is None and not shaped.cached
    assert shaped.batch_size == 128 and shaped.predicted_peak_bytes <= shaped.usable_bytes
    with CompileCounter() as solo_count:
        solo = plan_mesh(model, sample, **kwargs)
    assert solo_count.compiles["jit(step)"] == solo.compiles == 1 and not solo.cached
    assert not solo.provisional and solo.batch_size == shaped.batch_size
    # Activations that the shapes put over the budget below the cap: searched and compiled as
    # without ``provisional``.
    with CompileCounter() as tight_count:
        tight = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device=BUDGET,
                          provisional=True)
    assert not tight.provisional and tight_count.compiles["jit(step)"] == tight.compiles >= 1
    _assert_verified(tight)


def test_a_new_plan_takes_two_compiles_when_the_line_between_them_settles_it():
    # The probe above the boundary and the exact answer below it bracket the boundary; the line
    # between them puts the next batch over the budget, so no third compile proves it, and an
    # independent compile agrees.
    with CompileCounter() as count:
        plan = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device="1MiB")
    assert count.compiles["jit(step)"] == plan.compiles == 2
    assert plan.batch_size + plan.data_parallel not in dict(plan.compiled_peaks)
    _assert_verified(plan)


def test_stored_rough_points_guide_a_search_and_its_answer_is_compiled_and_stored_exactly(
        tmp_path):
    # A search with a rough setting (a GPU's) stores its rough points marked so; on jax 0.12's
    # CPU none is rough, so a first plan's points are marked rough here as such a search would
    # have left them. The next plan on the mesh (another cap: its plan is not stored) takes
    # them as guides: its answer among them is compiled again, exactly, and stored exact.
    import sqlite3

    path = tmp_path / "plans.sqlite"
    kwargs: dict[str, Any] = dict(devices=2, memory_per_device=BUDGET, compile_for_run=False)
    first = plan_mesh(_abstract(), SAMPLE, cache=PlanCache(path), **kwargs)
    with sqlite3.connect(path) as db:
        (key,) = {k for (k,) in db.execute("SELECT key FROM peaks")}
    cache = PlanCache(path)
    stored = cache.get_peaks(key)
    assert first.batch_size in stored and not any(r["rough"] for r in stored.values())
    cache.put_peaks(key, {b: {**r, "rough": True} for b, r in stored.items()})
    with CompileCounter() as count:
        again = plan_mesh(_abstract(), SAMPLE, cache=cache, max_batch_size=4096, **kwargs)
    assert not again.cached and again.batch_size == first.batch_size
    assert count.compiles["jit(step)"] == again.compiles >= 1
    assert dict(again.compiled_peaks)[first.batch_size] == first.peak_bytes_per_device
    after = PlanCache(path).get_peaks(key)
    assert after[first.batch_size] == {**stored[first.batch_size], "rough": False}


def test_cached_plan_is_rebuilt_without_compiling_and_equals_the_first(tmp_path):
    path = tmp_path / "study" / "plans.sqlite"
    first = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET,
                      cache=PlanCache(path))
    assert not first.cached and first.compiles > 0
    fresh = PlanCache(path)  # as a resumed study or another process opens it
    with CompileCounter() as count:
        again = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET, cache=fresh)
    assert count.compiles["jit(step)"] == 0 and again.compiles == 0 and again.cached
    assert (fresh.hits, fresh.misses) == (1, 0)
    assert again == first  # mesh, shardings, batch, peaks, memory model
    assert again.compiled_peaks == first.compiled_peaks
    _assert_verified(again)


@pytest.mark.parametrize(
    "change",
    [
        {"memory_per_device": "20MiB"},
        {"safety_margin": 0.2},
        {"max_batch_size": 4},
        {"devices": 2},
        {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)},
        {"loss_fn": lambda m, x: jnp.mean(jnp.abs(m(x)))},
        {"model": 16},
        {"release": "99.0.0"},
        {"model_parallel": 2},
        {"batch_multiple": 2},
        {"allowance_bytes": 1 << 20},
        {"min_shard_elements": 1},
    ],
    ids=["budget", "margin", "max-batch", "device-count", "optimizer", "loss", "architecture",
         "scamp-jax-release", "forced-model-parallel", "batch-multiple", "allowance",
         "shard-threshold"],
)
def test_any_key_part_changing_is_a_miss(tmp_path, monkeypatch, change):
    path = tmp_path / "plans.sqlite"
    # a cap of two samples per data-parallel group keeps each plan to one compile
    base: dict[str, Any] = {"devices": 4, "memory_per_device": BUDGET, "max_batch_size": 8}
    plan_mesh(_abstract(), SAMPLE, cache=PlanCache(path), **base)
    cache = PlanCache(path)
    width = change.pop("model", 32)
    if "release" in change:  # another release of scamp-jax plans anew
        import scamp_jax

        monkeypatch.setattr(scamp_jax, "__version__", change.pop("release"))
    plan = plan_mesh(_abstract(width), SAMPLE, cache=cache, **(base | change))
    assert (cache.hits, cache.misses) == (0, 1) and not plan.cached and len(cache) == 2


def test_signature_ignores_injected_hyperparameters_but_not_the_program():
    model = _abstract()
    adam = program_signature(model, SAMPLE, default_optimizer())
    assert adam == program_signature(model, SAMPLE, optax.inject_hyperparams(optax.adam)(
        learning_rate=0.5))
    assert adam != program_signature(model, SAMPLE, default_optimizer(),
                                     lambda m, x: jnp.mean(m(x)))
    wider = jax.ShapeDtypeStruct((1, SIDE, 2 * SIDE, CHANNELS), jnp.float32)
    assert adam != program_signature(model, wider, default_optimizer())


class _WithForward:
    """A task whose evaluation forward is ``forward`` (a lambda, as a user may set one)."""

    def __init__(self, task: Any, forward: Any) -> None:
        self._task, self.eval_forward = task, forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def eval_inputs(self) -> Any:  # what the planner looks for on the class
        return self._task.eval_inputs()

    def score(self, outputs: Any) -> Any:
        return self._task.score(outputs)


def _forward(m, x, scale=1.0):
    return m(x) * scale


class _Scaled:
    def __init__(self, scale: float) -> None:
        self.scale, self.calls = scale, 0

    def __call__(self, m, x):
        return m(x) * self.scale


def test_partials_callable_objects_and_closures_over_settings_are_told_apart():
    """A forward made with ``functools.partial``, as an object with ``__call__`` or as a
    closure over a dict of settings is keyed by the values it computes with: each was one key
    whatever it bound (``'functools.partial'``, the class's name), so two tasks sized their
    evaluation by each other's plan. Equal values are one key; a counter it does not read
    leaves the key alone."""
    assert (function_identity(functools.partial(_forward, scale=2.0))
            != function_identity(functools.partial(_forward, scale=3.0)))
    assert (function_identity(functools.partial(_forward, scale=2.0))
            == function_identity(functools.partial(_forward, scale=2.0)))
    assert (function_identity(functools.partial(_forward, scale=2.0))
            != function_identity(functools.partial(lambda m, x, scale: m(x), scale=2.0)))
    two = _Scaled(2.0)
    key = function_identity(two)
    assert key != function_identity(_Scaled(3.0)) and key == function_identity(_Scaled(2.0))
    two.calls += 1
    assert function_identity(two) == key

    def make(settings):
        return lambda m, x: m(x) * settings["scale"]

    assert function_identity(make({"scale": 2})) != function_identity(make({"scale": 3}))
    assert (function_identity(make({"scale": 2, "bias": 0}))
            == function_identity(make({"bias": 0, "scale": 2})))


class _Base:
    def __call__(self, m, x):
        return self.finish(m(x))


class _Tanh(_Base):
    def finish(self, y):
        return jnp.tanh(y)


class _Square(_Base):
    def finish(self, y):
        return y * y


class _Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, m, x):
        return m(x) * self.scale


class _ThroughAHelper:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def factor(self):
        return self.scale

    def __call__(self, m, x):
        return m(x) * self.factor()


@dataclasses.dataclass
class _Settings:
    scale: float


class _WithSettings:
    def __init__(self, settings: _Settings) -> None:
        self.settings = settings

    def __call__(self, m, x):
        return m(x) * self.settings.scale


@pytest.mark.parametrize(("one", "other"), [
    (lambda: _Tanh(), lambda: _Square()),  # one __call__, inherited: the class tells them apart
    (lambda: functools.partial(_forward, scale=np.int64(1)),
     lambda: functools.partial(_forward, scale=np.int64(64))),
    (lambda: functools.partial(_forward, scale=jax.nn.relu),
     lambda: functools.partial(_forward, scale=jax.nn.gelu)),
    (lambda: jax.jit(functools.partial(_forward, scale=1.0)),
     lambda: jax.jit(functools.partial(_forward, scale=2.0))),
    (lambda: functools.partial(_forward, ("scale", 2.0)),
     lambda: functools.partial(_forward, scale=2.0)),
    (lambda: _Slotted(2.0), lambda: _Slotted(3.0)),
    (lambda: _ThroughAHelper(2.0), lambda: _ThroughAHelper(3.0)),
    (lambda: _WithSettings(_Settings(2.0)), lambda: _WithSettings(_Settings(3.0))),
], ids=["subclasses", "numpy-scalars", "functions", "jitted", "positional-or-keyword",
        "slots", "read-by-a-helper", "a-dataclass-of-settings"])
def test_forwards_that_bind_other_values_have_other_keys_and_equal_ones_one_key(one, other):
    assert function_identity(one()) != function_identity(other())
    assert function_identity(one()) == function_identity(one())


def test_evaluation_forwards_are_told_apart_by_what_they_compute(tmp_path):
    def plain(m, x):
        return m(x)

    def scaled(m, x):
        return m(x) * 2.0

    assert function_identity(plain) != function_identity(scaled)
    assert function_identity(lambda m, x: m(x)) != function_identity(lambda m, x: m(x) * 2.0)
    assert function_identity(lambda m, x: m(x)) == function_identity(lambda m, x: m(x))
    # Two tasks differing only in their forward, as two lambdas of one name: two plans.
    from search_spaces import vit

    task = vit.SyntheticClassification(image_size=8, num_classes=4, eval_size=16, seed=3)
    model = nnx.eval_shape(lambda: vit.ViT(image_size=8, patch_size=4, num_classes=4,
                                           embed_dim=16, depth=1, num_heads=2,
                                           rngs=nnx.Rngs(0)))
    path = tmp_path / "plans.sqlite"
    for forward in (lambda m, x: m(x), lambda m, x: jnp.tile(m(x), 64)):
        cache = PlanCache(path)
        plan_mesh(model, task.sample_batch(1), devices=2, memory_per_device=BUDGET,
                  loss_fn=task.loss_fn, max_batch_size=8, cache=cache,
                  eval_task=_WithForward(task, forward))
        assert (cache.hits, cache.misses) == (0, 1)


class _TiledTask:
    """A task whose evaluation tiles the model's output ``reps`` times: tasks of this one class
    evaluate programs of other sizes."""

    def __init__(self, task: Any, reps: int) -> None:
        self._task, self.reps = task, reps

    def eval_inputs(self) -> Any:
        return self._task.eval_inputs()

    def eval_forward(self, model: Any, x: Any) -> Any:
        return jnp.tile(model(x), (1, self.reps))

    def score(self, outputs: Any) -> Any:
        return self._task.score(outputs)


def test_tasks_of_one_class_whose_evaluations_differ_get_their_own_plans(tmp_path):
    # The key held a bound method's function alone: the second task took the first's
    # evaluation chunk, for outputs 64 times larger.
    from search_spaces import vit

    task = vit.SyntheticClassification(image_size=8, num_classes=4, eval_size=16, seed=3)
    model = nnx.eval_shape(lambda: vit.ViT(image_size=8, patch_size=4, num_classes=4,
                                           embed_dim=16, depth=1, num_heads=2,
                                           rngs=nnx.Rngs(0)))
    kw = {"devices": 2, "memory_per_device": BUDGET, "loss_fn": task.loss_fn,
          "max_batch_size": 8}
    cache = PlanCache(tmp_path / "plans.sqlite")
    plans = [plan_mesh(model, task.sample_batch(1), cache=cache, eval_task=_TiledTask(task, r),
                       **kw) for r in (1, 64, 1)]
    assert (cache.hits, cache.misses) == (1, 2) and plans[2].cached
    alone = plan_mesh(model, task.sample_batch(1), eval_task=_TiledTask(task, 64), **kw)
    assert plans[1].eval_peak_bytes == alone.eval_peak_bytes > plans[0].eval_peak_bytes


def test_a_methods_identity_holds_the_instance_values_it_reads_only():
    # a counter the evaluation does not read would give every trial another plan key
    class Counting:
        def __init__(self, reps: int) -> None:
            self.reps, self.calls = reps, 0

        def eval_forward(self, model: Any, x: Any) -> Any:
            return jnp.tile(model(x), (1, self.reps))

    one, again, other = Counting(1), Counting(1), Counting(64)
    again.calls = 7
    assert function_identity(one.eval_forward) == function_identity(again.eval_forward)
    assert function_identity(one.eval_forward) != function_identity(other.eval_forward)


def test_a_functions_identity_is_the_same_in_another_process():
    code = ("from scamp_jax.planning.plan_cache import function_identity\n"
            "def pick(m, x):\n"
            "    return m(x) if x in {'a', 'b', 'c', 'd'} else 0.5\n"
            "print(function_identity(pick))")
    seen = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(seen) == 1 and seen.pop().startswith("__main__.pick:")


def test_signature_tells_rematerialisation_policies_apart_by_what_they_save():
    """JAX prints a checkpoint policy as ``<function ... at 0xXXXXXXXXXXXX>``: policies that
    save other names must still have other signatures (they hold other residuals), and the
    same policy made twice the same one (what describes it holds no address)."""
    from jax.ad_checkpoint import checkpoint_name

    class Remat(nnx.Module):
        def __init__(self, names: tuple[str, ...], rngs: nnx.Rngs) -> None:
            self.a, self.b = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
            self.names = names

        def __call__(self, x: jax.Array) -> jax.Array:
            def block(a: nnx.Linear, b: nnx.Linear, y: jax.Array) -> jax.Array:
                h = checkpoint_name(jnp.tanh(a(y)), "h")
                return b(checkpoint_name(jnp.sin(h), "s"))

            policy = jax.checkpoint_policies.save_only_these_names(*self.names)
            return nnx.remat(block, policy=policy)(self.a, self.b, x)

    sample = jax.ShapeDtypeStruct((1, 8), jnp.float32)

    def signature(*names: str) -> str:
        model = nnx.eval_shape(lambda: Remat(names, nnx.Rngs(0)))
        return program_signature(model, sample, default_optimizer())

    assert signature("h") != signature("s")
    assert signature("h") == signature("h")


_WRITER = """
import sys
from scamp_jax.planning.plan_cache import PlanCache
cache = PlanCache(sys.argv[1])
for i in range(100):
    cache.put_plan(f"{sys.argv[2]}-{i}", {"batch_size": i})
    cache.put_peaks("shared", {i: {"peak": i}})
"""


def test_two_processes_write_one_cache_file(tmp_path):
    path = tmp_path / "plans.sqlite"
    PlanCache(path)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name],
                              cwd=Path(__file__).parents[1]) for name in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    cache = PlanCache(path)
    assert len(cache) == 200
    assert cache.get_plan("b-99") == {"batch_size": 99}
    assert sorted(cache.get_peaks("shared")) == list(range(100))
    import sqlite3  # written ahead (commits do not wait for the disk), which stays with the file
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


class Denoise:
    """Recover the input from a noisy copy (real data, generated): metric held-out MSE."""

    metric = "mse"
    direction = "minimize"

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        shape = (batch_size, *SAMPLE.shape[1:])
        return (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        while True:
            y = rng.normal(size=(batch_size, *SAMPLE.shape[1:])).astype(np.float32)
            yield (y + 0.1 * rng.normal(size=y.shape).astype(np.float32), y)

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        x, y = batch
        return jnp.mean(jnp.square(model(x) - y))

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        x, y = next(self.batches(4, 123))
        return {"mse": float(jnp.mean(jnp.square(model(jnp.asarray(x)) - y)))}


SPACE = SearchSpace("conv", lambda trial: {"width": 8},
                    lambda config, rngs: ConvNet(int(config["width"]), rngs))


def _plan_and_run(devices: list[jax.Device], placed: list[jax.Device],
                  **plan_kwargs: Any) -> tuple[CompileCounter, CompileCounter, Any]:
    task, config = Denoise(), {"width": 8, "learning_rate": 1e-2}
    model = nnx.eval_shape(lambda: SPACE.build(config, nnx.Rngs(0)))
    with CompileCounter() as planning:
        plan = plan_mesh(model, task.sample_batch(1), devices=devices,
                         memory_per_device="8MiB", optimizer=make_optimizer({}),
                         loss_fn=task.loss_fn, max_batch_size=16, **plan_kwargs)
    spec = RunSpec(number=0, params=config, plan=plan.with_devices(placed), steps=3,
                   memory_per_device=8 * 2**20)
    with CompileCounter() as running:
        result = run_trial(spec, SPACE, task, cache=StepCache())
    assert result.state == "complete", result.reason
    return planning, running, plan


def test_the_runner_runs_the_step_the_planner_compiled():
    devices = jax.devices()[:2]
    planning, running, plan = _plan_and_run(devices, devices, compile_for_run=True)
    assert plan.compiled_step is not None
    assert planning.compiles["jit(step)"] == plan.compiles
    assert running.compiles["jit(step)"] == 0  # planning + running compiled it once
    # Placed on other CPU devices the executable is loaded there: still no compile.
    _, moved, _ = _plan_and_run(devices, jax.devices()[2:4], compile_for_run=True)
    assert moved.compiles["jit(step)"] == 0
    # Without the planner's executable the runner compiles its own (the counter sees it).
    _, own, _ = _plan_and_run(devices, devices, compile_for_run=False)
    assert own.compiles["jit(step)"] == 1


def test_a_plan_for_the_runner_compiles_its_answer_run_grade_instead_of_once_more():
    # On CPU the search compiles with fast code-generation settings; asked for the runner's
    # step, it compiles the batch the memory model predicts to be the answer with default
    # options instead, so the plan takes no extra compile and its figures are the same.
    fast = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device=BUDGET,
                     compile_for_run=False)
    assert fast.compiled_step is None
    with CompileCounter() as count:
        ready = plan_mesh(_abstract(), SAMPLE, devices=2, memory_per_device=BUDGET,
                          compile_for_run=True)
    assert ready.compiled_step is not None
    assert count.compiles["jit(step)"] == ready.compiles == fast.compiles
    assert ready.compiled_peaks == fast.compiled_peaks
    assert (ready.batch_size, ready.peak_bytes_per_device) == (
        fast.batch_size, fast.peak_bytes_per_device)
    _assert_verified(ready)


def _settings(trials: int, study_dir: str) -> Any:
    from scamp_jax.hpo.settings import SearchSettings

    return SearchSettings(trials=trials, study_dir=study_dir, steps=2, reference_batch=4,
                          max_batch_size=8, devices_per_trial=1, sampler="random",
                          pruner="none", checkpoint_every=0)


def test_a_resumed_study_plans_without_compiling(tmp_path, monkeypatch):
    from rich.console import Console

    from scamp_jax.hpo.session import run_search
    from scamp_jax.planning import batch_search

    calls: list[int] = []
    real = batch_search.compile_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_search, "compile_step", counted)
    space = SearchSpace("conv", lambda t: {"width": 8, "learning_rate": t.suggest_float(
        "learning_rate", 1e-3, 1e-2, log=True)}, lambda c, rngs: ConvNet(c["width"], rngs))
    for trials in (1, 2):
        calls.clear()
        info = run_search(space, Denoise(), _settings(trials, str(tmp_path)),
                          devices=jax.devices()[:2], memory_per_device=8 * 2**20, live=False,
                          console=Console(file=io.StringIO()))
        assert info["trials_this_run"] == 1
        if trials == 1:
            assert calls and (tmp_path / "plans.sqlite").is_file()
    assert calls == []  # the second run's trial (same architecture) was planned from the cache


class _GpuKind:
    """Stands in for a GPU device (none here): only ``platform`` and ``device_kind`` are read."""

    platform = "gpu"
    device_kind = "NVIDIA H100 80GB HBM3"


def test_allowances_are_stored_per_device_kind_and_zero_until_measured(tmp_path):
    from scamp_jax.planning.plan_cache import resolve_allowance

    cache = PlanCache(tmp_path / "plans.sqlite")
    assert cache.get_allowance("gpu", _GpuKind.device_kind) is None
    cache.put_allowance("gpu", _GpuKind.device_kind, {"bytes": 600 << 20, "unseen_bytes": 1})
    cache.put_allowance("gpu", "NVIDIA A100", {"bytes": 900 << 20})
    reopened = PlanCache(tmp_path / "plans.sqlite")  # another process, the same file
    assert reopened.get_allowance("gpu", _GpuKind.device_kind) == {"bytes": 600 << 20,
                                                                    "unseen_bytes": 1}
    assert resolve_allowance(None, [_GpuKind()], reopened) == 600 << 20
    assert resolve_allowance(None, [_GpuKind()], None) == 0  # nothing measured: margin only
    assert resolve_allowance(None, jax.devices()[:1], reopened) == 0  # CPU: none measured
    assert resolve_allowance(123, jax.devices()[:1], reopened) == 123
    # A CPU allowance exists only where a reader reported more than was booked (a test's).
    cache.put_allowance("cpu", "cpu", {"bytes": 1})
    assert resolve_allowance(None, jax.devices()[:1], cache) == 1
    with pytest.raises(ValueError, match="non-negative int"):
        cache.put_allowance("gpu", "x", {"bytes": -1})


def test_a_plan_includes_its_allowance_and_fits_with_it(tmp_path):
    """The allowance is part of the predicted peak, the batch search fits it, and it is part of
    the cache key (a plan made without it is not answered for a plan with it)."""
    cache = PlanCache(tmp_path / "plans.sqlite")
    base = plan_mesh(_abstract(), SAMPLE, devices=1, memory_per_device=BUDGET, cache=cache)
    assert base.allowance_bytes == 0  # CPU
    allowance = base.usable_bytes // 4
    plan = plan_mesh(_abstract(), SAMPLE, devices=1, memory_per_device=BUDGET, cache=cache,
                     allowance_bytes=allowance)
    assert not plan.cached and plan.allowance_bytes == allowance
    assert plan.predicted_peak_bytes == max(plan.train_bytes, plan.eval_bytes) + allowance
    assert plan.predicted_peak_bytes <= plan.usable_bytes
    assert plan.batch_size < base.batch_size
    assert _peak(plan, plan.batch_size) + plan.prefetch_bytes + allowance <= plan.usable_bytes
    again = plan_mesh(_abstract(), SAMPLE, devices=1, memory_per_device=BUDGET, cache=cache,
                      allowance_bytes=allowance)
    assert again.cached and again.allowance_bytes == allowance and again == plan


def test_a_fused_group_books_its_member_plans_allowance_once():
    from types import SimpleNamespace

    from scamp_jax.planning.fusion import group_held_bytes
    from scamp_jax.planning.memory import MemoryEstimate

    estimate = MemoryEstimate(batch_size=8, params=100, grads=100, opt_state=200, rest=0,
                              inputs=50, activations_and_temps=1000, peak=1500, temp=1000,
                              argument=400, output=300, alias=200)
    plan = SimpleNamespace(batch_size=8, prefetch_bytes=0, eval_peak_bytes=0)
    without = group_held_bytes(estimate, plan, 4, 8)
    plan.allowance_bytes = 700
    assert group_held_bytes(estimate, plan, 4, 8) == without + 700


def test_a_plan_on_devices_of_two_kinds_books_the_larger_allowance(tmp_path) -> None:
    """Each kind's stored allowance is what one of its devices holds beyond XLA's figures; a
    mesh over both kinds must book the larger on every device (a stand-in pool of two kinds,
    as in tests/test_calibration.py)."""
    from types import SimpleNamespace

    from scamp_jax.planning.plan_cache import resolve_allowance

    cache = PlanCache(tmp_path / "plans.sqlite")
    kinds = ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB")
    cache.put_allowance("gpu", kinds[0], {"bytes": 1 << 30})
    cache.put_allowance("gpu", kinds[1], {"bytes": 3 << 30})
    pool = [SimpleNamespace(platform="gpu", device_kind=kind) for kind in kinds]
    assert resolve_allowance(None, pool, cache) == 3 << 30
    assert resolve_allowance(None, pool[:1], cache) == 1 << 30
    assert resolve_allowance(None, pool, None) == 0  # no cache: nothing measured
    assert resolve_allowance(5, pool, cache) == 5  # given: taken as it is


def test_xla_flags_are_part_of_every_key(monkeypatch) -> None:
    """XLA_FLAGS change what XLA compiles (a GPU's memory limit, a CPU's device count, a pass
    turned off): a plan or a peak compiled under other flags is another record."""
    from scamp_jax.planning.plan_cache import cache_key, versions

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    key = cache_key({"kind": "plan"})
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                    "--xla_gpu_enable_triton_gemm=false")
    assert cache_key({"kind": "plan"}) != key
    assert versions()["xla_flags"].endswith("--xla_gpu_enable_triton_gemm=false")


def test_a_signature_does_not_depend_on_the_sample_batchs_size_but_on_parameter_names():
    """The signature traces a batch of one whatever the sample's batch is (a plan asked with a
    sample of 8 is the plan asked with a sample of 1); the parameter paths count (the sharding
    rules read them) even where the computation is the same, and the optimizer's update counts
    even where its state's paths are the same."""

    class Renamed(nnx.Module):  # ``MLP`` with its layers under other names
        def __init__(self, width: int, rngs: nnx.Rngs) -> None:
            self.first = nnx.Linear(64, width, rngs=rngs)
            self.second = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.second(nnx.relu(self.first(x)))

    mlp = nnx.eval_shape(lambda: MLP(32, nnx.Rngs(0)))
    one = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    eight = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    signature = program_signature(mlp, one, default_optimizer())
    assert program_signature(mlp, eight, default_optimizer()) == signature
    renamed = nnx.eval_shape(lambda: Renamed(32, nnx.Rngs(0)))
    assert program_signature(renamed, one, default_optimizer()) != signature
    # Optimizers whose states hold no arrays (no paths): their updates alone tell them apart.
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    assert (program_signature(mlp, one, optax.sgd(0.1))
            != program_signature(mlp, one, clipped))


def _scaled_by(scale: Any) -> Any:
    return lambda m, x: m(x) * scale


def _with_inner(m: Any, x: Any) -> Any:
    return (lambda y: y * 2.0)(m(x))


def _with_inner_again(m: Any, x: Any) -> Any:  # the same code as ``_with_inner``, elsewhere
    return (lambda y: y * 2.0)(m(x))


def test_a_functions_identity_reads_its_code_names_and_plain_closed_values_only():
    """Two functions that differ only in an operator, in the function they call, or in a
    number they close over compute other things: other identities. A value that is not plain
    (an object, an array) is left out: its address differs in every process, and a key that
    held it would never be found again. An inner function counts by its code, not where it
    was made."""
    ident = function_identity
    assert ident(lambda m, x: m(x) + x) != ident(lambda m, x: m(x) * x)  # the bytecode alone
    assert ident(lambda m, x: jnp.sum(m(x))) != ident(lambda m, x: jnp.mean(m(x)))  # names
    assert ident(_scaled_by(2.0)) != ident(_scaled_by(3.0))
    assert ident(_scaled_by(object())) == ident(_scaled_by(object()))
    assert (ident(_with_inner).split(":")[1] == ident(_with_inner_again).split(":")[1])


def test_a_methods_identity_holds_the_values_its_inner_functions_read_and_no_addresses():
    class Tiled:
        def __init__(self, reps: int) -> None:
            self.reps, self.table = reps, object()

        def eval_forward(self, model: Any, x: Any) -> Any:  # reads ``reps`` in a lambda only
            return jax.tree.map(lambda y: jnp.tile(y, (1, self.reps)), model(x))

        def lookup(self, model: Any, x: Any) -> Any:  # reads an attribute that is not plain
            return model(x) if self.table is not None else x

    assert function_identity(Tiled(1).eval_forward) != function_identity(Tiled(64).eval_forward)
    assert function_identity(Tiled(1).lookup) == function_identity(Tiled(1).lookup)


def test_jax_jaxlib_and_the_schema_are_part_of_every_key(monkeypatch) -> None:
    """A compiled figure depends on JAX and jaxlib; a record layout on the schema: another
    version of any of them is another key (as the scamp-jax release and XLA_FLAGS are)."""
    from scamp_jax.planning import plan_cache
    from scamp_jax.planning.plan_cache import cache_key

    key = cache_key({"kind": "plan"})
    for module, name, value in ((jax, "__version__", "0.0.1"),
                                (plan_cache.jaxlib, "__version__", "0.0.1"),
                                (plan_cache, "SCHEMA_VERSION", 999)):
        with monkeypatch.context() as patched:
            patched.setattr(module, name, value)
            assert cache_key({"kind": "plan"}) != key, (module, name)
    assert cache_key({"kind": "plan"}) == key


def test_the_device_kind_and_platform_are_part_of_a_plans_key() -> None:
    """Plans of one count of devices of another kind (another GPU) or platform (a kind of one
    name on another backend) are other records: their memory differs. Stand-in devices: only
    ``platform`` and ``device_kind`` are read."""
    from types import SimpleNamespace

    from scamp_jax.planning.plan_cache import cache_key, device_identity

    def key(platform: str, kind: str) -> str:
        devices = [SimpleNamespace(platform=platform, device_kind=kind)] * 2
        return cache_key({"kind": "plan", "devices": device_identity(devices)})

    assert key("gpu", "NVIDIA H100 80GB HBM3") != key("gpu", "NVIDIA A100-SXM4-80GB")
    assert key("gpu", "shared name") != key("tpu", "shared name")


def test_a_record_stored_again_replaces_the_older_and_keys_keep_apart(tmp_path) -> None:
    cache = PlanCache(tmp_path / "plans.sqlite")
    cache.put_plan("k", {"batch_size": 8})
    cache.put_plan("k", {"batch_size": 16})
    assert cache.get_plan("k") == {"batch_size": 16} and len(cache) == 1
    cache.put_peaks("k", {8: {"peak": 1, "rough": True}})
    cache.put_peaks("k", {8: {"peak": 2, "rough": False}, 16: {"peak": 3}})  # made exact
    cache.put_peaks("other", {4: {"peak": 9}})
    assert cache.get_peaks("k") == {8: {"peak": 2, "rough": False}, 16: {"peak": 3}}
    assert cache.get_peaks("other") == {4: {"peak": 9}} and cache.get_peaks("none") == {}
    cache.put_allowance("gpu", "NVIDIA H100", {"bytes": 1})
    cache.put_allowance("gpu", "NVIDIA H100", {"bytes": 2})
    assert cache.get_allowance("gpu", "NVIDIA H100") == {"bytes": 2}


def test_an_allowance_is_a_non_negative_int_zero_included(tmp_path) -> None:
    from scamp_jax.planning.plan_cache import resolve_allowance

    cache = PlanCache(tmp_path / "plans.sqlite")
    cache.put_allowance("gpu", "NVIDIA H100", {"bytes": 0})  # measured: nothing beyond XLA's
    assert cache.get_allowance("gpu", "NVIDIA H100") == {"bytes": 0}
    for wrong in (True, 1.5, "1", None):
        with pytest.raises(ValueError, match="non-negative int"):
            cache.put_allowance("gpu", "NVIDIA H100", {"bytes": wrong})
    for wrong in (-1, True, 2.0):
        with pytest.raises(ValueError, match="must be a non-negative int"):
            resolve_allowance(wrong, jax.devices()[:1], cache)


def test_a_plan_cache_that_cannot_serve_says_why_at_its_first_use(tmp_path):
    """Each way a path cannot be a plan cache: one `ValueError` at the first lookup (before a
    plan compiles, whose figures it could not keep), naming the path and what to do; advice
    to delete it only for a file that is no database (a damaged cache)."""
    import sqlite3

    foreign = tmp_path / "other.sqlite"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE plans (name TEXT, value REAL)")
    with pytest.raises(ValueError, match=r"the plan cache '.*other.sqlite' is another program's "
                       r"SQLite file \(its table 'plans' has the columns name, value, not a "
                       r"plan cache's key, record\); pass another path$"):
        PlanCache(foreign).get_plan("k")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"the plan cache '.*a-file/c/plans.sqlite' cannot be "
                       r"made: '.*a-file' is a file; pass another path$"):
        PlanCache(tmp_path / "a-file" / "c" / "plans.sqlite").get_plan("k")
    with pytest.raises(TypeError, match=r"PlanCache takes the path of its SQLite file \(a str "
                       r"or pathlib.Path\), not int 5"):
        PlanCache(5)  # type: ignore[arg-type]
    made = PlanCache(tmp_path / "new" / "plans.sqlite")  # made where missing, no advice
    assert made.get_plan("k") is None and len(made) == 0


READ_ONLY = """
import sys
from scamp_jax.planning.plan_cache import PlanCache
try:
    PlanCache(sys.argv[1]).get_plan("k")
except ValueError as err:
    print(err)
"""


def test_a_plan_cache_on_a_read_only_file_is_refused_before_anything_compiles(tmp_path):
    """A cache file mounted read-only (root's permission bits alone do not stop its writes):
    refused at its first lookup, not when the first plan compiled is stored."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare or mount (util-linux)")
    path = tmp_path / "plans.sqlite"
    PlanCache(path).put_plan("k", {"x": 1})
    # a mount namespace of its own: the read-only mount ends with the process
    script = (f"mount --bind {path} {path} && mount -o remount,bind,ro {path} && "
              f"exec {sys.executable} -c '{READ_ONLY}' {path}")
    result = subprocess.run(["unshare", "--mount", "--kill-child", "sh", "-c", script],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0 and ("mount" in result.stderr or "unshare" in result.stderr):
        pytest.skip(f"a read-only mount is not allowed here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        f"the plan cache {str(path)!r} cannot be written here (attempt to write a readonly "
        "database): the plans compiled would be lost; make it writable, or pass another path")
    assert PlanCache(path).get_plan("k") == {"x": 1}  # and kept as it was


def test_a_plan_cache_another_connection_writes_serves_its_first_lookup_at_once(tmp_path):
    """The first use's check that the file can be written (`_create_tables`) does not wait
    for another connection's write lock (a study's other process, a database browser with
    unsaved edits): the lookup reads what is committed at once, not after the 30 s SQLite
    would wait for the lock, nor fails when that wait ends."""
    import sqlite3
    import time

    path = tmp_path / "plans.sqlite"
    PlanCache(path).put_plan("k", {"x": 1})
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # holds the write lock
        other.execute("INSERT INTO plans VALUES ('j', '{}')")
        started = time.monotonic()
        assert PlanCache(path).get_plan("k") == {"x": 1}
        assert time.monotonic() - started < 5
    finally:
        other.execute("ROLLBACK")
        other.close()


_FILE_SIZE_LIMIT = """
import os, resource, signal, sys, warnings
from scamp_jax.planning.plan_cache import PlanCache
path = sys.argv[1]
cache = PlanCache(path)
cache.put_plan("kept", {"batch": 8})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
held = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
resource.setrlimit(resource.RLIMIT_FSIZE, (held + 4096, resource.RLIM_INFINITY))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache.put_plan("large", {"batch": "x" * 200_000})
    cache.put_peaks("large", {4: {"peak": "x" * 200_000}})
    cache.put_allowance("gpu", "H200", {"bytes": 1, "notes": "x" * 200_000})
print(len(caught), caught[0].message if caught else "")
print(cache.get_plan("kept"), cache.get_plan("large"))
"""


def test_a_store_the_disk_refuses_is_skipped_with_one_warning(tmp_path):
    """The disk refuses the cache's writes (here a file size limit, as a full disk would):
    planning goes on without storing, warned once; what was stored before stays readable."""
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path / "p.sqlite")],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned, stored = proc.stdout.splitlines()[-2:]
    assert warned.startswith(f"1 the plan cache {str(tmp_path / 'p.sqlite')!r} could not store "
                             "a plan (disk I/O error); planning goes on"), proc.stdout
    assert stored == "{'batch': 8} None"


def test_a_plan_cache_deleted_while_in_use_is_made_again(tmp_path):
    """Another process (or a user told a damaged cache may be deleted) removes the file while
    a study uses it: the next lookup makes it again, an empty cache whose plans are compiled
    again; not an empty file without tables that fails every plan after."""
    path = tmp_path / "study" / "plans.sqlite"
    cache = PlanCache(path)
    first = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET, cache=cache)
    assert len(cache) == 1
    for leftover in path.parent.glob("plans.sqlite*"):
        leftover.unlink()
    again = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET, cache=cache)
    assert not again.cached and again.batch_size == first.batch_size
    assert len(cache) == 1 and path.is_file()
    assert cache.get_allowance("cpu", "cpu") is None
    path.unlink()  # the folder too: made again
    path.parent.rmdir()
    cache.put_peaks("k", {})
    assert cache.get_plan("k") is None and path.is_file()


def test_a_plan_cache_damaged_past_its_first_page_is_said_in_one_error(tmp_path):
    """A file whose schema reads but whose tables are damaged: the lookup that meets the
    damage raises the cache's one `ValueError` (delete it: it holds what is compiled and
    measured again), as a file
    damaged at its start does, not SQLite's bare error; the advice names what the caller
    passes (a study's own folder)."""
    import sqlite3

    path = tmp_path / "plans.sqlite"
    cache = PlanCache(path)
    for i in range(200):  # several pages of plans
        cache.put_plan(f"key{i}", {"record": "x" * 200})
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = db.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[page:3 * page] = b"\xff" * (2 * page)  # the pages after the schema's
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"the plan cache '.*plans.sqlite' cannot be used "
                       r"\(database disk image is malformed\); a plan cache holds plans and "
                       r"measured allowances only: if this file is one, delete it \(they are "
                       r"compiled and measured again\), else pass another study_dir$"):
        PlanCache(path, elsewhere="pass another study_dir").get_plan("key7")


def test_an_unreadable_record_is_a_miss_said_once_and_planned_again(tmp_path):
    """A row damaged in a sound file (no JSON, or JSON without a plan's fields) is removed as
    it is read, said once as the cache's, and a miss: the plan compiled again replaces it (an
    allowance is measured again); not a trial failed with a `JSONDecodeError` or a `KeyError`
    that reads as a bug in the task, nor a warning in every later process."""
    import sqlite3

    path = tmp_path / "plans.sqlite"
    first = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET,
                      cache=PlanCache(path))
    for text in ("{garbage", "{}"):
        with sqlite3.connect(path) as db:
            db.execute("UPDATE plans SET record = ?", (text,))
            db.execute("UPDATE peaks SET record = ?", (text,))
            db.execute("INSERT INTO allowances VALUES ('cpu', 'cpu', ?)", (text,))
        cache = PlanCache(path)
        with pytest.warns(RuntimeWarning, match=r"the plan cache '.*plans.sqlite' held an? "
                          r".*, which is removed: what it held is compiled \(or measured\) "
                          r"again and kept anew") as said:
            again = plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET,
                              cache=cache)
        assert len(said) == 1, [str(w.message) for w in said]
        assert not again.cached and again.batch_size == first.batch_size
        assert (cache.hits, cache.misses) == (0, 1)
        with sqlite3.connect(path) as db:  # every unreadable row removed, none left to warn of
            assert db.execute("SELECT COUNT(*) FROM allowances").fetchone()[0] == 0
            records = [r for (r,) in db.execute("SELECT record FROM plans UNION ALL "
                                                "SELECT record FROM peaks")]
        assert records and text not in records
        assert plan_mesh(_abstract(), SAMPLE, devices=4, memory_per_device=BUDGET,
                         cache=PlanCache(path)).cached  # replaced by a sound record
