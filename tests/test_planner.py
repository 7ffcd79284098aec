"""The planner: model-parallel degree, exact largest batch, errors, remapping, sharding rules."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from scamp_jax.planning import memory
from scamp_jax.planning.budget import Budget
from scamp_jax.planning.planner import (
    DoesNotFitError,
    min_devices,
    min_devices_plan,
    plan_budget,
    plan_mesh,
)
from scamp_jax.planning.sharding import (
    bytes_per_device,
    make_mesh,
    param_partition_specs,
    partition_spec_for,
)
from scamp_jax.planning.train_step import (
    abstract_state,
    default_loss,
    default_optimizer,
    jit_train_step,
    place_train_state,
)

BUDGET = "2MiB"


class MLP(nnx.Module):
    def __init__(self, d: int, h: int, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.drop(nnx.relu(self.up(x))))


class NoParams(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + 1


class Block(nnx.Module):
    """A pre-norm transformer block (attention + MLP)."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.fc2 = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


def _model() -> MLP:
    return nnx.eval_shape(lambda: MLP(128, 1024, nnx.Rngs(0)))


SAMPLE = jax.ShapeDtypeStruct((1, 128), jnp.float32)


def _compiled_peak(plan, model, batch_size: int) -> int:
    """Compile the plan's step at ``batch_size`` here (default XLA options) and read the peak."""
    tx = default_optimizer()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _, opt_state, _ = abstract_state(model, tx)
    step = jit_train_step(graphdef, tx, default_loss, plan.step_shardings)
    batch = jax.ShapeDtypeStruct((batch_size, 128), jnp.float32)
    stats = step.lower(params, opt_state, rest, batch).compile().memory_analysis()
    return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
            + stats.output_size_in_bytes - stats.alias_size_in_bytes)


@pytest.fixture(scope="module")
def plan():
    return plan_mesh(_model(), SAMPLE, devices=8, memory_per_device=BUDGET)


def test_model_that_cannot_fit_one_device_is_split(plan):
    usable = int(2 * 2**20 * 0.9)
    # parameters + Adam moments alone exceed one device, so plain data parallelism is out
    assert 3 * bytes_per_device(nnx.state(_model(), nnx.Param), jax.NamedSharding(
        make_mesh(jax.devices()[:1], 1, 1), P())) > usable
    assert plan.model_parallel >= 2
    assert plan.data_parallel * plan.model_parallel == 8
    assert plan.mesh.axis_names == ("data", "model")
    assert plan.mesh.devices.shape == (plan.data_parallel, plan.model_parallel)
    assert plan.usable_bytes == usable
    assert plan.batch_size % plan.data_parallel == 0
    assert jax.tree.structure(plan.param_shardings) == jax.tree.structure(
        nnx.state(_model(), nnx.Param))
    assert plan.batch_sharding.spec == P("data")


def test_plan_batch_is_the_largest_that_fits_by_an_independent_compile(plan):
    model = _model()
    at_plan = _compiled_peak(plan, model, plan.batch_size)
    assert at_plan == plan.peak_bytes_per_device == plan.estimate.peak
    assert (plan.batch_size, at_plan) in plan.compiled_peaks
    # the next batch is prefetched while a step runs: the plan counts it (exactly linear),
    # each device's share of it (the batch is split over the data-parallel groups)
    assert plan.data_parallel > 1 and plan.prefetch_bytes == bytes_per_device(
        jax.ShapeDtypeStruct((plan.batch_size, 128), jnp.float32), plan.batch_sharding)
    per_sample = plan.prefetch_bytes / plan.batch_size
    assert at_plan + plan.prefetch_bytes == plan.predicted_peak_bytes <= plan.usable_bytes
    following = plan.batch_size + plan.data_parallel
    assert (_compiled_peak(plan, model, following) + round(per_sample * following)
            > plan.usable_bytes)
    assert plan.batch_size > plan.data_parallel  # the budget leaves room for real batches


def test_two_real_steps_with_the_remapped_plan_keep_shardings(plan):
    devices = jax.devices()[::-1]
    moved = plan.with_devices(devices)
    assert [d.id for d in moved.mesh.devices.flat] == [d.id for d in devices]
    assert moved.batch_size == plan.batch_size and moved.estimate == plan.estimate
    model = MLP(128, 1024, nnx.Rngs(0))
    tx = default_optimizer()
    with pytest.raises(TypeError, match=r"place_train_state needs a real model with arrays, and "
                       r"this one is abstract \(from nnx.eval_shape"):
        place_train_state(nnx.eval_shape(lambda: MLP(128, 1024, nnx.Rngs(0))), tx,
                          moved.step_shardings)
    # another optimizer than the planned one (optax.adam is not the default, which injects
    # its learning rate), or another model: said, not a pytree mismatch inside jax.jit
    import optax

    with pytest.raises(ValueError, match=r"an optimizer whose state is not the one its "
                       r"shardings were planned for; .*default_optimizer\(\)"):
        place_train_state(model, optax.adam(1e-3), moved.step_shardings)

    class Deeper(nnx.Module):
        def __init__(self, rngs):
            self.mlp, self.head = MLP(128, 1024, rngs), nnx.Linear(128, 2, rngs=rngs)

    with pytest.raises(ValueError, match="tree of parameters is not the one its shardings"):
        place_train_state(Deeper(nnx.Rngs(0)), tx, moved.step_shardings)
    # one sharding for a whole tree (a prefix, as jax.device_put takes it) is no mismatch
    whole = jax.NamedSharding(moved.mesh, P())
    place_train_state(model, tx, dataclasses.replace(moved.step_shardings, params=whole,
                                                     opt_state=whole))
    graphdef, params, opt_state, rest = place_train_state(model, tx, moved.step_shardings)
    step = jit_train_step(
        graphdef, tx, lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), moved.step_shardings)
    x = np.random.default_rng(0).normal(size=(moved.batch_size, 128)).astype(np.float32)
    batch = jax.device_put((x, x[:, ::-1].copy()), moved.batch_sharding)
    losses = []
    for _ in range(2):
        params, opt_state, rest, loss = step(params, opt_state, rest, batch)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    expected = jax.tree.leaves(
        moved.param_shardings, is_leaf=lambda s: isinstance(s, jax.NamedSharding))
    for array, sharding in zip(jax.tree.leaves(params), expected, strict=True):
        assert array.sharding == sharding
    with pytest.raises(ValueError, match="plan is for 8 devices but 4"):
        plan.with_devices(jax.devices()[:4])


def test_a_plans_repr_is_one_line_of_its_decision(plan):
    """``print(plan)`` in a notebook: one line of the decision and its figures, not every
    sharding of every parameter (27 KB for 20 layers before)."""
    from scamp_jax._units import format_bytes

    text = repr(plan)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith(f"Plan(mesh={plan.data_parallel}x{plan.model_parallel} (data x "
                           f"model) on {len(plan.devices)} cpu device(s), "
                           f"batch_size={plan.batch_size}, "), text
    assert format_bytes(plan.predicted_peak_bytes) in text and "NamedSharding" not in text


def test_describe_is_a_short_table(plan):
    import dataclasses

    from scamp_jax._units import format_bytes

    text = plan.describe()
    assert f"{plan.data_parallel} x {plan.model_parallel}" in text
    assert str(plan.batch_size) in text and "usable" in text
    assert len(text.splitlines()) <= 15
    [per_sample] = [r for r in text.splitlines() if r.startswith("each sample more")]
    assert per_sample.endswith(f"  +{format_bytes(plan.memory_model.bytes_per_sample)} per "
                               "device (the global batch one larger)"), per_sample
    # Peaks that dip at the answer (a GPU target's kernels, seen for a small MLP for an H100:
    # 817 KB at 2,928 samples, 537 KB at 2,944, 833 KB at 2,946): the line through them
    # crosses zero samples below zero bytes, and its slope is no bytes per sample.
    dipped = dataclasses.replace(plan, memory_model=dataclasses.replace(
        plan.memory_model, fixed_bytes=-434_044_024.0, bytes_per_sample=147_616.0))
    line = next(r for r in dipped.describe().splitlines() if r.startswith("each sample more"))
    assert "144.16 KiB" not in line and "no steady figure" in line, line
    flat = dataclasses.replace(plan, memory_model=dataclasses.replace(
        plan.memory_model, fixed_bytes=1_000_000.0, bytes_per_sample=0.0))
    line = next(r for r in flat.describe().splitlines() if r.startswith("each sample more"))
    assert line.endswith(f"no steady figure: the compiled peaks near batch {plan.batch_size} "
                         "do not grow with it"), line


def test_max_batch_size_and_forced_model_parallel():
    small = nnx.eval_shape(lambda: MLP(16, 64, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 16), jnp.float32)
    capped = plan_mesh(small, sample, devices=8, memory_per_device="1GiB", max_batch_size=20)
    assert (capped.model_parallel, capped.data_parallel, capped.batch_size) == (1, 8, 16)
    devices = np.array(jax.devices()[4:])  # any iterable of devices, e.g. a mesh's array
    forced = plan_mesh(small, sample, devices=devices, memory_per_device="1GiB", max_batch_size=8,
                       model_parallel=2)
    assert [d.id for d in forced.devices] == [4, 5, 6, 7]
    assert (forced.model_parallel, forced.data_parallel, forced.batch_size) == (2, 2, 8)


def test_a_cap_below_the_device_count_says_which_meshes_it_skips(caplog):
    small = nnx.eval_shape(lambda: MLP(16, 64, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 16), jnp.float32)
    with caplog.at_level("INFO", logger="scamp_jax.planning.planner"):
        plan = plan_mesh(small, sample, devices=4, memory_per_device="1GiB", max_batch_size=3,
                         compile_for_run=False)
    assert (plan.data_parallel, plan.model_parallel, plan.batch_size) == (2, 2, 2)
    assert ("max_batch_size=3 is below the 4 data-parallel groups of a 4 x 1 mesh "
            "(data x model): that mesh is skipped") in caplog.text
    # a cap of one sample per device leaves the data-parallel mesh in
    caplog.clear()
    with caplog.at_level("INFO", logger="scamp_jax.planning.planner"):
        plan = plan_mesh(small, sample, devices=4, memory_per_device="1GiB", max_batch_size=4,
                         compile_for_run=False)
    assert (plan.data_parallel, plan.model_parallel, plan.batch_size) == (4, 1, 4)
    assert "skipped" not in caplog.text


def test_does_not_fit_error_states_needed_and_available_bytes():
    with pytest.raises(DoesNotFitError) as info:
        plan_mesh(_model(), SAMPLE, devices=8, memory_per_device="64KiB", safety_margin=0.0)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.bytes_available == 64 * 1024
    assert err.bytes_needed > err.bytes_available
    assert str(err.bytes_needed) in str(err) and str(err.bytes_available) in str(err)
    # the need is the least over the degrees tried: here the most split weights'
    with pytest.raises(DoesNotFitError) as split:
        plan_mesh(_model(), SAMPLE, devices=8, memory_per_device="64KiB", safety_margin=0.0,
                  model_parallel=8)
    assert err.bytes_needed == split.value.bytes_needed
    assert "model_parallel=8" in str(err)
    # what is available is the budget less the margin (and the allowance)
    with pytest.raises(DoesNotFitError) as margin:
        plan_mesh(_model(), SAMPLE, devices=8, memory_per_device="64KiB", allowance_bytes=1000)
    assert margin.value.bytes_available == int(64 * 1024 * 0.9) - 1000
    assert "less a 10% margin and a 1000 B allowance" in str(margin.value)


def test_min_devices_finds_the_smallest_count_that_fits():
    count, plan = min_devices_plan(_model(), SAMPLE, devices=8, memory_per_device=BUDGET,
                                   counts=(1, 2, 4, 8), max_batch_size=4)
    # two devices split the model in half (data_parallel 1: no gradient all-reduce buffers)
    assert count == 2 and len(plan.devices) == 2 and plan.model_parallel == 2
    assert plan.peak_bytes_per_device <= plan.usable_bytes
    with pytest.raises(DoesNotFitError):
        plan_mesh(_model(), SAMPLE, devices=1, memory_per_device=BUDGET)
    with pytest.raises(ValueError, match="between 1 and 8"):
        min_devices(_model(), SAMPLE, devices=8, memory_per_device=BUDGET, counts=(16,))


@pytest.fixture
def no_compiles(monkeypatch):
    def refuse(self, batch_size):
        raise AssertionError("argument errors must come before any compile")

    monkeypatch.setattr(memory.StepCompiler, "estimate", refuse)


def test_numpy_integers_are_the_ints_they_hold():
    as_ints = plan_mesh(_model(), SAMPLE, devices=np.int64(2), memory_per_device=np.int64(2**21),
                        max_batch_size=np.int32(16), model_parallel=np.int64(2),
                        min_shard_elements=np.int64(0), safety_margin=np.float32(0.1))
    plain = plan_mesh(_model(), SAMPLE, devices=2, memory_per_device=2**21, max_batch_size=16,
                      model_parallel=2, min_shard_elements=0, safety_margin=float(np.float32(0.1)))
    assert (as_ints.batch_size, as_ints.data_parallel) == (plain.batch_size, plain.data_parallel)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"memory_per_device": 0}, ValueError, "positive"),
        ({"memory_per_device": "0GiB"}, ValueError, "positive"),
        ({"devices": 0}, ValueError, "devices=0 must be between 1 and the 8"),
        ({"devices": 9}, ValueError, r"devices=9 must be between 1 and the 8 available cpu "
         r"devices; .*scamp_jax.configure_cpu_devices\(n\) before JAX starts"),
        ({"devices": True}, TypeError, "device count"),
        ({"devices": []}, ValueError, "empty"),
        ({"model_parallel": 3}, ValueError, r"model_parallel=3 must divide the device count 8"),
        ({"memory_per_device": None}, ValueError, "memory_per_device is required on cpu"),
        ({"safety_margin": 1.0}, ValueError, "safety_margin"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"model_parallel": 1, "max_batch_size": 4}, ValueError, "smaller than every"),
        ({"optimizer": "adam"}, TypeError, r"optimizer='adam' is not an optax "
         r"GradientTransformation; pass one, e.g. optimizer=optax.adamw\(1e-3\)"),
        ({"cache": "runs/plans.sqlite"}, TypeError, r"cache='runs/plans.sqlite' is not a "
         r"PlanCache; pass cache=scamp_jax.PlanCache\('runs/plans.sqlite'\)"),
        ({"safety_margin": "0.1"}, TypeError, r"safety_margin='0.1' must be a number"),
        ({"min_shard_elements": -1}, ValueError, "min_shard_elements=-1 must be an int >= 0"),
        ({"provisional": "yes"}, TypeError, "provisional='yes' must be True or False"),
        ({"compile_for_run": "no"}, TypeError, "compile_for_run='no' must be True or False"),
    ],
)
def test_bad_arguments_fail_before_any_compile(no_compiles, kwargs, error, match):
    args = {"devices": 8, "memory_per_device": BUDGET} | kwargs
    with pytest.raises(error, match=match):
        plan_mesh(_model(), SAMPLE, **args)


def test_an_nnx_optimizer_is_refused_by_its_type_not_its_arrays(no_compiles):
    """An ``nnx.Optimizer`` for ``optimizer``: the refusal names its type and says to pass its
    optax transformation, in a line (its repr printed every array of the model before)."""
    import optax

    model = _model()
    made = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"^optimizer is flax's Optimizer, not an optax "
                       r"GradientTransformation; pass the transformation it was made with") \
            as err:
        plan_mesh(model, SAMPLE, devices=8, memory_per_device=BUDGET, optimizer=made)
    assert len(str(err.value)) < 300


def test_model_without_parameters_and_repeated_devices_fail_before_any_compile(no_compiles):
    with pytest.raises(ValueError, match="no nnx.Param"):
        plan_mesh(NoParams(), SAMPLE, devices=2, memory_per_device=BUDGET)
    with pytest.raises(TypeError, match="model must be an nnx.Module instance, got a function"):
        plan_mesh(lambda x: x, SAMPLE, devices=2, memory_per_device=BUDGET)
    with pytest.raises(TypeError, match="got the class NoParams; build it"):
        plan_mesh(NoParams, SAMPLE, devices=2, memory_per_device=BUDGET)
    d = jax.devices()[0]
    with pytest.raises(ValueError, match="distinct"):
        plan_mesh(_model(), SAMPLE, devices=[d, d], memory_per_device=BUDGET)
    with pytest.raises(ValueError, match="leading sample axis"):
        plan_mesh(_model(), jnp.zeros(()), devices=2, memory_per_device=BUDGET)
    # one sample's arrays without the batch axis: their first sizes differ
    with pytest.raises(ValueError, match=r"disagree on their leading \(sample\) axis: "
                       r"\(32, 32, 3\), \(64, 64, 3\); .* x\[None\] for one sample"):
        plan_mesh(_model(), (jnp.zeros((32, 32, 3)), jnp.zeros((64, 64, 3))), devices=2,
                  memory_per_device=BUDGET)


def test_the_default_loss_names_a_dict_batch_its_model_cannot_take():
    sample = {"x": SAMPLE}
    with pytest.raises(TypeError, match=r"default_loss passes the model its batch, here a dict "
                       r"of \['x'\], which it could not take \(.*\); pass a loss of your own"):
        plan_mesh(_model(), sample, devices=2, memory_per_device=BUDGET)

    class TakesADict(nnx.Module):  # a model that reads its inputs from the dict plans as ever
        def __init__(self) -> None:
            self.inner = _model()

        def __call__(self, batch):
            return self.inner(batch["x"])

    plan = plan_mesh(nnx.eval_shape(TakesADict), sample, devices=2, memory_per_device=BUDGET)
    assert plan.batch_size >= 1


def test_a_sample_batch_the_model_cannot_take_says_what_was_traced():
    """JAX's shape error names the product, not the input: a note names the batch's shapes
    and what to check; the error stays JAX's."""
    with pytest.raises(TypeError, match=r"^traced on a batch of \d+ samples, each "
                       r"\[\(64,\) float32\]: .*dot_general") as err:
        plan_mesh(_model(), jax.ShapeDtypeStruct((1, 64), jnp.float32), devices=2,
                  memory_per_device=BUDGET)
    assert "leading batch axis" in " ".join(getattr(err.value, "__notes__", []))


def test_a_model_in_evaluation_mode_is_planned_with_a_warning():
    """``model.eval()`` (e.g. a loaded model) turns dropout off: its training step holds less
    than training mode's, so the plan says so; a model in training mode plans silently (the
    tests turn warnings into errors)."""
    model = _model()
    model.eval()
    with pytest.warns(UserWarning,
                      match=r"MLP is in evaluation mode .* call model.train\(\)") as seen:
        plan_mesh(model, SAMPLE, devices=2, memory_per_device=BUDGET, max_batch_size=8)
    assert seen[0].filename == __file__  # pointed at the caller of plan_mesh

    class OneLayerOff(nnx.Module):
        """Dropout in training mode, and one more layer of dropout turned off by design."""

        def __init__(self) -> None:
            self.inner = _model()
            self.head = nnx.Dropout(0.5, deterministic=True)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.head(self.inner(x))

    # a model that mixes modes is taken as meant: planned without a warning
    plan_mesh(nnx.eval_shape(OneLayerOff), SAMPLE, devices=2, memory_per_device=BUDGET,
              max_batch_size=8)


def test_the_default_loss_names_a_tuple_batch_its_model_takes_more_of():
    class TwoInputs(nnx.Module):
        def __init__(self) -> None:
            self.inner = _model()

        def __call__(self, x, z):
            return self.inner(x) + z

    with pytest.raises(TypeError, match=r"default_loss passes the model the first of its "
                       r"batch's 3 elements .* TwoInputs does not take one input .*'z'.*; pass "
                       r"a loss of your own"):
        plan_mesh(nnx.eval_shape(TwoInputs), (SAMPLE, SAMPLE, SAMPLE), devices=2,
                  memory_per_device=BUDGET)


def test_a_sample_too_large_for_a_device_is_told_apart_from_weights_too_large():
    """Weights that fit with a sample that does not: the advice names the sample's size, not
    more devices alone."""
    with pytest.raises(DoesNotFitError, match=r"peak at batch 1 .* one sample per data-parallel "
                       r"group is the least .* smaller inputs") as info:
        plan_mesh(_model(), jax.ShapeDtypeStruct((1, 4096, 128), jnp.float32), devices=2,
                  memory_per_device="8MiB")
    assert "parameters + optimizer state" not in str(info.value)
    # the need is the least over the degrees of a compiled peak at one sample per group and
    # that sample, prefetched
    big = jax.ShapeDtypeStruct((1, 4096, 128), jnp.float32)
    needs = [memory.estimate_memory(_model(), jax.ShapeDtypeStruct((2 // mp, 4096, 128),
                                                                  jnp.float32),
                                    mesh=make_mesh(jax.devices()[:2], 2 // mp, mp)).peak
             + bytes_per_device(big, jax.NamedSharding(make_mesh(jax.devices()[:1], 1, 1), P()))
             for mp in (1, 2)]
    assert info.value.bytes_needed == min(needs)
    with pytest.raises(DoesNotFitError, match=r"parameters \+ optimizer state .* use more "
                       r"devices \(model parallelism splits the weights\)"):
        plan_mesh(_model(), SAMPLE, devices=1, memory_per_device="1MiB")


def test_weights_left_whole_by_min_shard_elements_are_said_where_they_do_not_fit():
    """Weights that are mostly matrices under ``min_shard_elements``: more devices barely
    help (every device holds them whole), so the refusal says so and how to split them, which
    then fits; a model of large matrices gets no such line."""
    small = nnx.eval_shape(lambda: MLP(32, 64, nnx.Rngs(0)))  # two 2,048-element matrices
    sample = jax.ShapeDtypeStruct((1, 32), jnp.float32)
    with pytest.raises(DoesNotFitError, match=r"16.00 KiB of its 16.38 KiB of weights are "
                       r"matrices under min_shard_elements=4096 elements, which every device "
                       r"holds whole: plan_mesh\(..., min_shard_elements=0\) splits them too$"):
        plan_mesh(small, sample, devices=8, memory_per_device="24KiB")
    split = plan_mesh(small, sample, devices=8, memory_per_device="24KiB", min_shard_elements=0)
    assert split.model_parallel > 1
    # nothing said where no degree would split them: one forced, or sizes none divides
    with pytest.raises(DoesNotFitError) as alone:
        plan_mesh(small, sample, devices=8, memory_per_device="24KiB", model_parallel=1)
    assert "min_shard_elements" not in str(alone.value)
    odd = nnx.eval_shape(lambda: MLP(33, 63, nnx.Rngs(0)))
    with pytest.raises(DoesNotFitError) as undivided:
        plan_mesh(odd, jax.ShapeDtypeStruct((1, 33), jnp.float32), devices=8,
                  memory_per_device="24KiB")
    assert "min_shard_elements" not in str(undivided.value)
    with pytest.raises(DoesNotFitError) as large:
        plan_mesh(_model(), SAMPLE, devices=8, memory_per_device="200KiB")
    assert "min_shard_elements" not in str(large.value)


def test_a_pool_given_without_its_unit_is_said_to_be_bytes_where_nothing_fits():
    """``memory_per_device=16`` is 16 bytes: the refusal says so and how to write 16 GiB,
    not advice about the model; a small pool with its unit keeps the model's advice."""
    with pytest.raises(DoesNotFitError, match=r"memory_per_device=16 is a count of bytes: for "
                       r"16 GiB pass memory_per_device='16GiB'$"):
        plan_mesh(_model(), SAMPLE, devices=2, memory_per_device=16)
    with pytest.raises(DoesNotFitError, match=r"use more devices") as kib:
        plan_mesh(_model(), SAMPLE, devices=2, memory_per_device="2KiB")
    assert "count of bytes" not in str(kib.value)


def test_a_float64_numpy_batch_is_counted_as_the_float32_arrays_jax_makes_of_it():
    """Without 64-bit mode JAX holds NumPy's float64 as float32: the prefetched batch and the
    plan are those of a float32 batch."""
    as_numpy = plan_mesh(_model(), np.zeros((1, 128)), devices=2, memory_per_device=BUDGET)
    as_f32 = plan_mesh(_model(), SAMPLE, devices=2, memory_per_device=BUDGET)
    assert as_numpy.prefetch_bytes == as_f32.prefetch_bytes == (
        as_f32.batch_size // as_f32.data_parallel * 128 * 4)
    assert (as_numpy.batch_size, as_numpy.peak_bytes_per_device) == (
        as_f32.batch_size, as_f32.peak_bytes_per_device)


class _DeviceWithLimit:
    platform = "gpu"
    device_kind = "NVIDIA H200"

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self._limit, "bytes_in_use": 0}


def test_default_budget_is_the_smallest_device_limit():
    devices = [_DeviceWithLimit(80 * 2**30), _DeviceWithLimit(40 * 2**30)]
    assert plan_budget(None, devices).memory_per_device == 40 * 2**30
    assert plan_budget("3GiB", devices).memory_per_device == 3 * 2**30
    given = Budget(8 * 2**20, 0.2)
    assert plan_budget(given, devices) is given  # used as it is
    assert plan_budget(given, devices, allowance_bytes=1000) == given.with_allowance(1000)


def test_sharding_rules_for_dense_conv_attention_and_small_parameters():
    key = jax.tree_util.DictKey
    names = lambda *ns: tuple(key(n) for n in ns)  # noqa: E731
    # dense: the larger feature dimension, ties to the output
    assert partition_spec_for(names("fc1", "kernel"), (64, 256), 2) == P(None, "model")
    assert partition_spec_for(names("fc2", "kernel"), (256, 64), 2) == P("model", None)
    assert partition_spec_for(names("sq", "kernel"), (128, 128), 2) == P(None, "model")
    # conv (kh, kw, in, out): never the spatial dimensions; falls back to 'in' if 'out' won't split
    assert partition_spec_for(names("conv", "kernel"), (3, 3, 64, 96), 2) == P(
        None, None, None, "model")
    assert partition_spec_for(names("conv", "kernel"), (3, 3, 64, 90), 4) == P(
        None, None, "model", None)
    # neither divides, 1-D, and small parameters: replicated
    assert partition_spec_for(names("odd", "kernel"), (129, 127), 2) == P()
    assert partition_spec_for(names("norm", "scale"), (4096,), 2) == P()
    assert partition_spec_for(names("rel_pos", "table"), (225, 4), 2) == P()
    assert partition_spec_for(names("fc1", "kernel"), (64, 256), 1) == P()

    block = nnx.eval_shape(lambda: Block(64, 4, nnx.Rngs(0)))
    specs = param_partition_specs(nnx.state(block, nnx.Param), 2, min_shard_elements=1024)
    assert specs["attn"]["query"]["kernel"].get_value() == P(None, "model", None)  # by heads
    assert specs["attn"]["out"]["kernel"].get_value() == P("model", None, None)
    assert specs["fc1"]["kernel"].get_value() == P(None, "model")
    assert specs["fc2"]["kernel"].get_value() == P("model", None)
    assert specs["norm1"]["scale"].get_value() == P()


def test_make_mesh_and_bytes_per_device():
    mesh = make_mesh(jax.devices()[:6], 3, 2)
    assert mesh.devices.shape == (3, 2) and mesh.axis_names == ("data", "model")
    with pytest.raises(ValueError, match="must equal the number of devices"):
        make_mesh(jax.devices()[:6], 2, 2)
    sharded = jax.NamedSharding(mesh, P(None, "model"))
    assert bytes_per_device(jax.ShapeDtypeStruct((10, 8), jnp.float32), sharded) == 10 * 4 * 4
    key = jax.eval_shape(lambda: jax.random.key(0))
    assert bytes_per_device(key, jax.NamedSharding(mesh, P())) == 8  # two uint32 words


def test_a_first_guess_from_shapes_that_fits_is_the_only_compile():
    """The first compile is the batch that shapes predict to be the largest; when it fits and
    the line from below puts the next batch over the budget, a new architecture costs one
    compile, and the plan is still the largest batch that fits by independent compiles."""
    from search_spaces.swinir import SwinIR

    model = nnx.eval_shape(lambda: SwinIR(
        img_size=16, embed_dim=12, depths=(1,), num_heads=(2,), window_size=4,
        upsampler="pixelshuffledirect", rngs=nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 16, 16, 3), jnp.float32)
    plan = plan_mesh(model, sample, devices=1, memory_per_device="4MiB")
    assert (plan.compiles, len(plan.compiled_peaks)) == (1, 1)
    assert plan.compiled_step is not None  # the runner's step is that one compile

    tx = default_optimizer()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    _, opt_state, _ = abstract_state(model, tx)
    step = jit_train_step(graphdef, tx, default_loss, plan.step_shardings)

    def need(batch_size: int) -> int:
        stats = step.lower(params, opt_state, rest, jax.ShapeDtypeStruct(
            (batch_size, 16, 16, 3), jnp.float32)).compile().memory_analysis()
        return (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + batch_size * 16 * 16 * 3 * 4)

    assert need(plan.batch_size) == plan.predicted_peak_bytes <= plan.usable_bytes
    assert need(plan.batch_size + 1) > plan.usable_bytes


class _Counted(nnx.Module):
    """A model whose state holds Python numbers, as Flax allows: a step counter
    (``nnx.Variable(0)``) and a temperature parameter (``nnx.Param(1.0)``)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(8, 1, rngs=rngs)
        self.temperature = nnx.Param(1.0)
        self.steps = nnx.Variable(0)

    def __call__(self, x: jax.Array) -> jax.Array:
        self.steps.set_value(self.steps.get_value() + 1)
        return self.linear(x) / self.temperature[...]


def test_a_model_holding_python_numbers_plans_and_trains_with_its_plan():
    """``nnx.Variable(0)`` and ``nnx.Param(1.0)`` hold a Python int and float, which trained
    under ``nnx.jit`` but failed in plan_mesh and place_train_state (an ``AttributeError``, no
    ``shape``): they plan and train as the arrays ``jnp.asarray`` makes of them, the counter
    counting the steps and the temperature learning."""
    import optax

    def loss_fn(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    model = _Counted(nnx.Rngs(0))
    optimizer = optax.adam(1e-2)
    sample = (jax.ShapeDtypeStruct((1, 8), np.float32), jax.ShapeDtypeStruct((1, 1), np.float32))
    plan = plan_mesh(model, sample, devices=2, memory_per_device="8MiB", optimizer=optimizer,
                     loss_fn=loss_fn, max_batch_size=16)
    graphdef, params, opt_state, rest = place_train_state(model, optimizer, plan.step_shardings)
    step = jit_train_step(graphdef, optimizer, loss_fn, plan.step_shardings)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.normal(size=(plan.batch_size, 8)).astype(np.float32)
        batch = jax.device_put((x, x[:, :1] * 3.0), plan.batch_sharding)
        params, opt_state, rest, loss = step(params, opt_state, rest, batch)
    assert np.isfinite(float(loss))
    nnx.update(model, params, rest)
    assert int(model.steps.get_value()) == 3 and float(model.temperature[...]) != 1.0


def test_a_loss_that_is_not_one_number_is_said_in_words():
    """A loss returning ``(loss, aux)`` (as ``jax.value_and_grad(has_aux=True)`` takes it) or
    a per-sample array failed 50 lines deep in JAX's gradient, under a batch size of the
    planner's: the error says what the loss returned and what the step takes."""
    def with_aux(model, batch):
        loss = (model(batch) ** 2).mean()
        return loss, {"norm": loss}

    def per_sample(model, batch):
        return (model(batch) ** 2).mean(axis=-1)

    model = nnx.eval_shape(lambda: MLP(16, 32, nnx.Rngs(0)))
    sample = jax.ShapeDtypeStruct((1, 16), jnp.float32)
    with pytest.raises(TypeError, match=r"^loss_fn returned a tuple of 2 \(loss, aux\?\), where "
                       r"the training step takes loss_fn\(model, batch\) -> the scalar loss: "
                       r"return the loss alone"):
        plan_mesh(model, sample, devices=1, memory_per_device=BUDGET, loss_fn=with_aux)
    with pytest.raises(TypeError, match=r"^loss_fn returned an array of shape \(\d+,\), where"):
        plan_mesh(model, sample, devices=1, memory_per_device=BUDGET, loss_fn=per_sample)


def test_an_integer_parameter_is_refused_naming_it():
    """Every nnx.Param is differentiated: an integer one failed deep in JAX with advice
    ("set allow_int") a user cannot follow; it is refused naming the parameter and the fix."""
    class Lookup(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.table = nnx.Param(jnp.arange(4, dtype=jnp.int32))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.linear(x) + self.table[...]

    with pytest.raises(TypeError, match=r"^Lookup\.table is an nnx\.Param of int32, and the "
                       r"training step differentiates every nnx\.Param, .* hold integer or "
                       r"boolean state in an nnx\.Variable"):
        plan_mesh(nnx.eval_shape(lambda: Lookup(nnx.Rngs(0))),
                  jax.ShapeDtypeStruct((1, 4), jnp.float32), devices=1, memory_per_device=BUDGET)
