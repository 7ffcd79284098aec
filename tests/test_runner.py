"""The trial runner: trains a placed trial on its sub-mesh, checkpoints, resumes, classifies errors.

The candidates are a tiny MLP regressing a fixed random function (a real model on real generated
data), small enough that each test compiles and trains in a few seconds on CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scamp_jax.hpo.runner import (
    RunSpec,
    StepCache,
    TrialStatus,
    is_oom_error,
    load_model,
    make_optimizer,
    run_trial,
)
from scamp_jax.planning import planner
from scamp_jax.space import SearchSpace

IN, OUT = 8, 1


class MLP(nnx.Module):
    """Two-layer perceptron; ``poison`` multiplies the output by NaN (a buggy candidate)."""

    def __init__(self, width: int, rngs: nnx.Rngs, poison: bool = False) -> None:
        self.hidden = nnx.Linear(IN, width, rngs=rngs)
        self.out = nnx.Linear(width, OUT, rngs=rngs)
        self.poison = poison

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.out(jnp.tanh(self.hidden(x)))
        return y * jnp.nan if self.poison else y


class Regression:
    """``y = sin(x @ w)`` on Gaussian inputs; metric: held-out MSE (minimised)."""

    metric = "mse"
    direction = "minimize"
    parallel_streams = True  # each stream its own generator: fused groups draw at once

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.w = rng.normal(size=(IN, OUT)).astype(np.float32) / np.sqrt(IN)
        self.x_eval = rng.normal(size=(256, IN)).astype(np.float32)
        self.y_eval = np.sin(self.x_eval @ self.w)

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((batch_size, IN), jnp.float32),
                jax.ShapeDtypeStruct((batch_size, OUT), jnp.float32))

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        rng = np.random.default_rng(seed)
        while True:
            x = rng.normal(size=(batch_size, IN)).astype(np.float32)
            yield x, np.sin(x @ self.w)

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        x, y = batch
        return jnp.mean(jnp.square(model(x) - y))

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        pred = np.asarray(model(jnp.asarray(self.x_eval)))
        return {"mse": float(np.mean((pred - self.y_eval) ** 2)),
                "zero_mse": float(np.mean(self.y_eval**2))}


def build(config: Any, rngs: nnx.Rngs) -> MLP:
    if config.get("broken"):
        raise ValueError("candidate has a bug: broken=True")
    return MLP(int(config["width"]), rngs, poison=bool(config.get("poison", False)))


def suggest(trial: Any) -> dict[str, Any]:
    return {"width": trial.suggest_categorical("width", [16, 32, 64]),
            "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-2, log=True)}


SPACE = SearchSpace("mlp", suggest, build, grid={"width": [16, 32, 64],
                    "learning_rate": [1e-3, 1e-2]}, largest={"width": 64, "learning_rate": 1e-2})
BUDGET = 64 * 2**20


def make_plan(config: dict[str, Any], devices: list[jax.Device], max_batch: int = 32) -> Any:
    """The planner's plan for ``config`` (cached per width and device count: planning compiles)."""
    plan = _plan(int(config["width"]), len(devices), max_batch)
    return plan.with_devices(devices)


@functools.cache
def _plan(width: int, n_devices: int, max_batch: int) -> Any:
    model = nnx.eval_shape(lambda: build({"width": width}, nnx.Rngs(0)))
    return planner.plan_mesh(model, Regression().sample_batch(1),
                             devices=jax.devices()[:n_devices], memory_per_device=BUDGET,
                             optimizer=make_optimizer({}), loss_fn=Regression().loss_fn,
                             max_batch_size=max_batch)


def spec(config: dict[str, Any], plan: Any, **kw: Any) -> RunSpec:
    return RunSpec(number=kw.pop("number", 0), params=config, plan=plan,
                   steps=kw.pop("steps", 60), memory_per_device=kw.pop("budget", BUDGET), **kw)


def test_trains_on_its_submesh_and_beats_the_zero_predictor():
    config = {"width": 32, "learning_rate": 1e-2}
    devices = jax.devices()[2:4]
    plan = make_plan(config, jax.devices()[:2]).with_devices(devices)
    status = TrialStatus(0, config)
    result = run_trial(spec(config, plan, steps=150), SPACE, Regression(), status=status)
    assert result.state == "complete", result.reason
    assert result.steps == 150 and status.step == 150
    assert result.metrics["mse"] < 0.5 * result.metrics["zero_mse"]
    assert math.isfinite(result.loss)


def test_trials_of_one_architecture_share_a_compiled_step():
    cache = StepCache()
    devices = jax.devices()[:1]
    task = Regression()
    for lr in (1e-3, 2e-2):
        config = {"width": 16, "learning_rate": lr}
        result = run_trial(spec(config, make_plan(config, devices), steps=5), SPACE,
                           task, cache=cache)
        assert result.state == "complete", result.reason
    assert (cache.misses, cache.hits) == (1, 1)


def test_learning_rate_reaches_the_optimizer():
    """Same architecture and seed, different learning rates: different final losses."""
    cache, task = StepCache(), Regression()
    losses = []
    for lr in (1e-4, 3e-2):
        config = {"width": 16, "learning_rate": lr}
        plan = make_plan(config, jax.devices()[:1])
        losses.append(run_trial(spec(config, plan, steps=40), SPACE, task,
                                cache=cache).metrics["mse"])
    assert losses[1] < losses[0]


def test_a_trial_trains_bit_for_bit_as_a_plain_optax_adamw_loop():
    """The same trial written as a plain NNX loop with ``optax.adamw(lr)`` from the trial's
    initial model (`initial_model`): same metric to the last bit (only the learning rate is data
    in the trial; injected b1/b2 would change Adam's ``1 - b`` terms in float32)."""
    import optax

    from scamp_jax.planning.initial_state import initial_model

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1])
    task = Regression()
    losses: list[tuple[int, int, float]] = []
    result = run_trial(spec(config, plan, steps=30, seed=7, log_every=1), SPACE, task,
                       on_loss=lambda number, step, loss: losses.append((number, step, loss)))
    assert result.state == "complete", result.reason

    model = initial_model(lambda rngs: build(config, rngs), 7)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.0), wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
        loss, grads = nnx.value_and_grad(task.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    batches = task.batches(plan.batch_size, 7)
    plain = [float(step(model, optimizer, next(batches))) for _ in range(30)]
    assert result.metrics["mse"] == task.evaluate(model)["mse"]
    # every step's loss, read back through run_trial's on_loss
    assert losses == [(0, i + 1, loss) for i, loss in enumerate(plain)]


def test_an_optimizer_hyperparameter_a_configuration_sets_is_data():
    """``b1`` set by the configuration is injected (one compile for trials that vary it) and
    reaches the optimizer; one it leaves out is a constant."""
    config = {"width": 16, "learning_rate": 1e-2}
    assert "b1" not in make_optimizer(config).init({"w": jnp.zeros(2)}).hyperparams
    state = make_optimizer({**config, "b1": 0.5}).init({"w": jnp.zeros(2)})
    assert sorted(state.hyperparams) == ["b1", "learning_rate"]
    cache, task = StepCache(), Regression()
    model = nnx.eval_shape(lambda: build(config, nnx.Rngs(0)))
    plan = planner.plan_mesh(model, task.sample_batch(1), devices=jax.devices()[:1],
                             memory_per_device=BUDGET, loss_fn=task.loss_fn, max_batch_size=32,
                             optimizer=make_optimizer({**config, "b1": 0.5}))
    mse = [run_trial(spec({**config, "b1": b1}, plan, steps=20), SPACE, task,
                     cache=cache).metrics["mse"] for b1 in (0.5, 0.95)]
    assert mse[0] != mse[1] and (cache.misses, cache.hits) == (1, 1)


def test_nan_loss_fails_with_reason():
    config = {"width": 16, "learning_rate": 1e-2, "poison": True}
    plan = make_plan({"width": 16}, jax.devices()[:1])
    result = run_trial(spec(config, plan, steps=20), SPACE, Regression())
    assert result.state == "failed"
    assert "loss is nan" in result.reason


def test_the_last_steps_loss_is_read_back_where_the_steps_are_no_multiple_of_the_interval():
    """Losses are read back every ``log_every`` steps and at the last step: a run of 7 steps
    read every 5 hears steps 5 and 7, and its result carries step 7's loss."""
    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1])
    heard: list[tuple[int, float]] = []
    result = run_trial(spec(config, plan, steps=7, log_every=5), SPACE, Regression(),
                       on_loss=lambda number, step, loss: heard.append((step, loss)))
    assert result.state == "complete", result.reason
    assert [step for step, _ in heard] == [5, 7]
    assert result.loss == heard[-1][1]


def test_a_metric_that_turns_non_finite_between_loss_read_backs_fails_and_is_not_reported():
    """The loss is read back every ``log_every`` steps; an evaluation in between that scores
    NaN ends the trial failed, as a NaN score after training does, instead of handing the NaN
    to the pruner (Optuna's median pruner prunes on it: a diverged trial recorded pruned)."""
    config = {"width": 16, "learning_rate": 1e-2, "poison": True}
    plan = make_plan({"width": 16}, jax.devices()[:1])
    heard: list[tuple[int, float]] = []

    def report(number: int, step: int, value: float) -> bool:
        heard.append((step, value))
        return True  # a pruner that would stop it at once

    result = run_trial(spec(config, plan, steps=20, eval_every=5, log_every=10), SPACE,
                       Regression(), report=report)
    assert result.state == "failed" and "mse is nan at step 5" in result.reason, result.reason
    assert heard == []


def test_a_part_of_a_spanning_trial_records_the_global_batch_its_checkpoints_hold(tmp_path):
    """A process that trains part 0 of 2 of every global batch (a trial spanning MPI ranks)
    checkpoints the global batch, which its data stream and step counts follow, not its part:
    a retry at another global batch with the same part trains from the start, and one at the
    same global batch resumes."""
    from scamp_jax.hpo.checkpoint import recorded_batch

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1], max_batch=8)
    assert plan.batch_size == 8
    directory = tmp_path / "trial_0"
    first = run_trial(spec(config, plan, steps=10, checkpoint_dir=directory,
                           checkpoint_every=5, batch_share=(0, 2)), SPACE, Regression())
    assert first.state == "complete" and recorded_batch(directory) == 16
    alone = run_trial(spec(config, plan, steps=20, checkpoint_dir=directory), SPACE,
                      Regression())  # the whole global batch of 8 in this process
    assert alone.state == "complete" and alone.resumed_from == 0
    assert recorded_batch(directory) == 8


def test_a_trial_that_trains_from_the_start_at_another_batch_checkpoints_what_it_trained(
        tmp_path):
    """Checkpoints of another batch are deleted when a trial trains from the start: its
    checkpoints (and the final one its result names) then hold the model it trained at this
    batch, and a rerun resumes that one, never the other batch's state at the same step."""
    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1], max_batch=8)
    directory = tmp_path / "trial_0"
    other = run_trial(spec(config, plan, steps=10, checkpoint_dir=directory,
                           checkpoint_every=5, batch_share=(0, 2)), SPACE, Regression())
    assert other.state == "complete", other.reason  # steps 5 and 10 at a global batch of 16
    alone = run_trial(spec(config, plan, steps=10, checkpoint_dir=directory,
                           checkpoint_every=5), SPACE, Regression())
    assert alone.state == "complete" and alone.resumed_from == 0, alone.reason
    assert alone.metrics["mse"] != other.metrics["mse"]  # another batch trains another model
    model = load_model(alone.checkpoint, SPACE, config)
    assert Regression().evaluate(model)["mse"] == pytest.approx(alone.metrics["mse"], rel=1e-5)
    again = run_trial(spec(config, plan, steps=10, checkpoint_dir=directory), SPACE,
                      Regression())
    assert again.state == "complete" and again.resumed_from == 10, again.reason
    assert again.metrics["mse"] == alone.metrics["mse"]


def test_load_model_reads_every_value_and_computes_none(tmp_path):
    """`load_model` builds the model abstract and reads every value from the checkpoint: no
    initialiser runs, so nothing compiles (a small SwinIR built for real compiled 37 programs,
    11 s on a loaded 2-core CPU), and the model holds the saved values, in evaluation mode."""
    from scamp_jax.hpo.checkpoint import TrialCheckpointer
    from scamp_jax.hpo.overhead import OverheadRecorder
    from scamp_jax.planning.train_step import split_model

    config = {"width": 23, "learning_rate": 1e-2}  # a width no other test builds
    model = SPACE.model(config, nnx.Rngs(5))
    _, weights, rest = split_model(model)
    weights = jax.tree.map(lambda w: w + 0.25, weights)  # values no initialiser makes
    saved = TrialCheckpointer(tmp_path)
    saved.save(3, jax.tree.leaves((weights, make_optimizer(config).init(weights), rest)))
    saved.close()
    jax.clear_caches()
    with OverheadRecorder() as recorder:
        loaded = load_model(tmp_path / "3", SPACE, config)
    summary = recorder.summary()
    assert sum(v for k, v in summary.items() if k.endswith("_compiles")) == 0, summary
    _, read, _ = split_model(loaded)
    for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(weights), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not loaded.poison and np.isfinite(Regression().evaluate(loaded)["mse"])


def test_build_error_fails_with_reason():
    config = {"width": 16, "learning_rate": 1e-2, "broken": True}
    plan = make_plan({"width": 16}, jax.devices()[:1])
    result = run_trial(spec(config, plan, steps=5), SPACE, Regression())
    assert result.state == "failed"
    assert "ValueError: candidate has a bug" in result.reason


def test_compiled_peak_above_budget_is_out_of_memory():
    """A plan made for a larger budget than the device has is caught before the first step."""
    config = {"width": 64, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1], max_batch=4096)
    budget = plan.peak_bytes_per_device // 2
    result = run_trial(spec(config, plan, steps=5, budget=budget), SPACE, Regression())
    assert result.state == "oom"
    assert result.bytes_needed is not None and result.bytes_needed > budget
    assert result.steps == 0


def test_oom_classifier():
    assert is_oom_error(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"))
    assert not is_oom_error(ValueError("shapes do not match"))


def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path):
    """Stopping after a checkpoint and resuming on other devices gives the same model."""
    import threading

    config = {"width": 32, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:2])
    whole = run_trial(spec(config, plan, steps=40, checkpoint_dir=tmp_path / "a",
                           checkpoint_every=10), SPACE, Regression())
    assert whole.state == "complete", whole.reason

    stop = threading.Event()

    def report(number: int, step: int, value: float) -> bool:
        if step == 25:
            stop.set()  # the engine's Ctrl-C, seen by the runner before step 26
        return False

    # Step 25 is between the periodic checkpoints (20, 30): only the save at the stop holds it.
    first = run_trial(spec(config, plan, steps=40, checkpoint_dir=tmp_path / "b",
                           checkpoint_every=10, eval_every=5), SPACE, Regression(),
                      report=report, stop=stop)
    assert (first.state, first.steps) == ("interrupted", 25), first.reason
    moved = plan.with_devices(jax.devices()[4:6])
    second = run_trial(spec(config, moved, steps=40, checkpoint_dir=tmp_path / "b",
                            checkpoint_every=10), SPACE, Regression())
    assert second.state == "complete", second.reason
    # It restarted from the stop's checkpoint (20 would be a stop that saved nothing, 0 a run
    # that ignored its checkpoints), and the same steps give the same bits.
    assert second.resumed_from == 25
    assert second.metrics["mse"] == whole.metrics["mse"], (second.metrics, whole.metrics)
    # The final checkpoint holds the trained model.
    model = load_model(second.checkpoint, SPACE, config)
    assert Regression().evaluate(model)["mse"] == pytest.approx(second.metrics["mse"], rel=1e-5)


def test_a_trial_stopped_after_its_first_step_resumes_from_that_step(tmp_path):
    """A stop after step 1 checkpoints step 1, and the rerun restores it (its one step is
    not lost to a fresh start at step 1): it ends as the uninterrupted run does."""
    import threading

    config = {"width": 16, "learning_rate": 1e-2}
    plan = make_plan(config, jax.devices()[:1])
    whole = run_trial(spec(config, plan, steps=5), SPACE, Regression())
    assert whole.state == "complete", whole.reason
    stop = threading.Event()
    first = run_trial(spec(config, plan, steps=5, checkpoint_dir=tmp_path / "t", log_every=1),
                      SPACE, Regression(), stop=stop,
                      on_loss=lambda number, step, loss: step == 1 and stop.set())
    assert (first.state, first.steps) == ("interrupted", 1), first.reason
    second = run_trial(spec(config, plan, steps=5, checkpoint_dir=tmp_path / "t"), SPACE,
                       Regression())
    assert second.state == "complete" and second.resumed_from == 1, second.reason
    assert second.metrics["mse"] == whole.metrics["mse"]


class DropoutMLP(nnx.Module):
    """`MLP` with dropout on its hidden layer (random numbers drawn in training)."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(IN, width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(width, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jnp.tanh(self.hidden(x))))


class HalvesAlike(Regression):
    """Every global batch is one half drawn twice: both parts of a two-way share see the same
    samples, so what tells their losses apart is what each draws at random."""

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        for x, y in super().batches(batch_size // 2, seed):
            yield np.concatenate([x, x]), np.concatenate([y, y])


@pytest.mark.parametrize("model", [MLP, DropoutMLP])
def test_each_part_of_a_spanning_trial_draws_its_own_dropout_masks(model):
    """The ranks of a spanning trial train on parts of one global batch: with dropout each
    part draws its own masks (as one process draws them for the whole batch), not part 0's
    masks for its sample i; without random numbers the two parts train alike."""
    from scamp_jax.distributed.spanning import one_device_plan

    space = SearchSpace("mlp", lambda t: {}, lambda p, rngs: model(16, rngs))
    params = {"width": 16, "learning_rate": 1e-2}
    losses = {}
    for index in (0, 1):
        plan = one_device_plan(space, params, 8, jax.devices()[0])
        spec = RunSpec(0, params, plan, steps=4, memory_per_device=1 << 30, seed=5,
                       log_every=1, batch_share=(index, 2))
        losses[index] = []
        result = run_trial(spec, space, HalvesAlike(),
                           on_loss=lambda number, step, loss, i=index: losses[i].append(loss))
        assert result.state == "complete", result.reason
    assert len(losses[0]) == 4
    if model is MLP:
        assert losses[0] == losses[1]
    else:
        assert all(a != b for a, b in zip(losses[0], losses[1], strict=True)), losses
