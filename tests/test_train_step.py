"""The shared training step: splitting, abstract state, sharded execution, optimizer shardings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from scamp_jax.planning.initial_state import init_train_state
from scamp_jax.planning.memory import default_step_shardings, single_device_mesh
from scamp_jax.planning.sharding import make_mesh
from scamp_jax.planning.train_step import (
    StepShardings,
    abstract_state,
    default_loss,
    default_optimizer,
    jit_train_step,
    make_train_step,
    place_train_state,
    split_model,
)


class DropoutMLP(nnx.Module):
    def __init__(self, d: int, h: int, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.drop(nnx.relu(self.up(x))))


def regression_loss(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean(jnp.square(model(x) - y))


def _specs(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.NamedSharding))
    return [s.spec for s in leaves]


def test_split_model_separates_params_from_rng_state():
    model = DropoutMLP(8, 16, nnx.Rngs(0))
    _, params, rest = split_model(model)
    assert len(jax.tree.leaves(params)) == 4
    assert jax.tree.structure(params) == jax.tree.structure(nnx.state(model, nnx.Param))
    assert {type(v).__name__ for v in jax.tree.leaves(
        rest, is_leaf=lambda x: isinstance(x, nnx.Variable))} == {"RngCount", "RngKey"}


def test_abstract_state_is_the_same_for_real_and_eval_shape_models():
    tx = default_optimizer()
    real = abstract_state(DropoutMLP(8, 16, nnx.Rngs(0)), tx)
    abstract_model = nnx.eval_shape(lambda: DropoutMLP(8, 16, nnx.Rngs(0)))
    abstract = abstract_state(abstract_model, tx)
    for a, b in zip(real, abstract, strict=True):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert isinstance(x, jax.ShapeDtypeStruct) and isinstance(y, jax.ShapeDtypeStruct)
            assert (x.shape, x.dtype) == (y.shape, y.dtype)
    # the learning rate is data in the optimizer state, so one compiled step serves all values
    assert real[1].hyperparams["learning_rate"].shape == ()


def test_default_loss_takes_an_array_or_a_tuple():
    model = DropoutMLP(4, 8, nnx.Rngs(0))
    model.eval()
    x = jnp.ones((3, 4))
    assert default_loss(model, x) == pytest.approx(float(default_loss(model, (x, x + 1))))
    assert default_loss(model, x) == pytest.approx(float(jnp.mean(model(x) ** 2)))


def test_make_train_step_matches_a_hand_written_sgd_step_and_advances_rng():
    model = DropoutMLP(4, 8, nnx.Rngs(0))
    model.eval()  # deterministic, so the reference gradient is the same function
    tx = optax.sgd(0.1)
    graphdef, params, rest = split_model(model)
    batch = (jnp.arange(12.0).reshape(3, 4) / 12, jnp.ones((3, 4)))
    step = jax.jit(make_train_step(graphdef, tx, regression_loss))
    new_params, _, _, loss = step(params, tx.init(params), rest, batch)

    def ref_loss(p):
        return regression_loss(nnx.merge(graphdef, p, rest, copy=True), batch)

    ref_value, grads = jax.value_and_grad(ref_loss)(params)
    assert float(loss) == pytest.approx(float(ref_value), rel=1e-6)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    model.train()  # dropout draws from the RNG stream: its counter must move forward
    graphdef, params, rest = split_model(model)
    step = jax.jit(make_train_step(graphdef, tx, regression_loss))
    _, _, new_rest, _ = step(params, tx.init(params), rest, batch)
    count = rest["drop"]["rngs"]["count"]
    assert int(new_rest["drop"]["rngs"]["count"][...]) == int(count[...]) + 1


def test_opt_state_shardings_follow_the_parameters():
    tx = default_optimizer()
    mesh = make_mesh(jax.devices(), 4, 2)
    params, opt_state, rest = abstract_state(DropoutMLP(128, 256, nnx.Rngs(0)), tx)
    shardings = default_step_shardings(mesh, params, opt_state, rest, tx)
    # leaves in key order: down (256 -> 128) split by rows, up (128 -> 256) by columns
    assert _specs(shardings.params) == [P(), P("model", None), P(), P(None, "model")]
    inner = shardings.opt_state.inner_state[0]
    assert _specs(inner.mu) == _specs(shardings.params) == _specs(inner.nu)
    assert shardings.opt_state.hyperparams["learning_rate"].spec == P()


def test_factored_optimizer_state_is_replicated_where_shapes_differ():
    tx = optax.adafactor(1e-2)
    mesh = make_mesh(jax.devices(), 4, 2)
    params, opt_state, rest = abstract_state(DropoutMLP(128, 256, nnx.Rngs(0)), tx)
    shardings = default_step_shardings(mesh, params, opt_state, rest, tx)
    leaves = jax.tree.leaves(opt_state)
    for leaf, s in zip(leaves, jax.tree.leaves(shardings.opt_state), strict=True):
        s.shard_shape(leaf.shape)  # raises if a spec does not fit the leaf
    row = shardings.opt_state[0].v_row
    assert all(spec == P() for spec in _specs(row))


def test_two_sharded_steps_keep_shardings_and_match_one_device():
    model = DropoutMLP(128, 256, nnx.Rngs(0))
    model.eval()
    tx = default_optimizer()
    x = jax.random.normal(jax.random.key(1), (16, 128))
    batch = (x, jnp.flip(x, axis=1))
    losses = {}
    for name, mesh in {"sharded": make_mesh(jax.devices(), 4, 2),
                       "single": single_device_mesh()}.items():
        params, opt_state, rest = abstract_state(model, tx)
        shardings = default_step_shardings(mesh, params, opt_state, rest, tx)
        graphdef, p, o, r = place_train_state(model, tx, shardings)
        step = jit_train_step(graphdef, tx, regression_loss, shardings)
        data = jax.device_put(batch, shardings.batch)
        run = []
        for _ in range(2):
            p, o, r, loss = step(p, o, r, data)
            run.append(float(loss))
        losses[name] = (run, p)
        expected = jax.tree.leaves(
            shardings.params, is_leaf=lambda s: isinstance(s, jax.NamedSharding))
        for array, sharding in zip(jax.tree.leaves(p), expected, strict=True):
            assert array.sharding.is_equivalent_to(sharding, array.ndim)
    assert all(np.isfinite(losses["sharded"][0]))
    assert losses["sharded"][0][1] < losses["sharded"][0][0]
    np.testing.assert_allclose(losses["sharded"][0], losses["single"][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(losses["sharded"][1]), jax.tree.leaves(losses["single"][1]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the model's own arrays survive the donation of the placed copies
    assert not model.up.kernel[...].is_deleted()


def test_step_shardings_mesh_requires_named_shardings():
    mesh = make_mesh(jax.devices()[:2], 2, 1)
    s = StepShardings(params={}, opt_state={}, rest={}, batch=jax.NamedSharding(mesh, P("data")))
    assert s.mesh is mesh and s.replicated().spec == P()
    bad = StepShardings(params={}, opt_state={}, rest={},
                        batch=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(TypeError, match="NamedSharding"):
        _ = bad.mesh


def test_init_train_state_builds_on_the_shardings_without_moving_arrays():
    """The model is created where it lives: no device holds it whole, nothing is transferred
    (building eagerly and placing it, as `place_train_state` needs, moves it from device 0)."""
    mesh = make_mesh(jax.devices(), 4, 2)
    tx = default_optimizer()

    def build() -> DropoutMLP:
        return DropoutMLP(128, 256, nnx.Rngs(0))

    params, opt_state, rest = abstract_state(nnx.eval_shape(build), tx)
    shardings = default_step_shardings(mesh, params, opt_state, rest, tx)
    assert P(None, "model") in _specs(shardings.params)  # the test needs a sharded kernel
    with jax.transfer_guard("disallow"):
        graphdef, p, o, r = init_train_state(build, tx, shardings)
        with pytest.raises(Exception, match="[Dd]isallowed"):
            place_train_state(build(), tx, shardings)
    for tree, expected in ((p, shardings.params), (o, shardings.opt_state)):
        expected = jax.tree.leaves(expected, is_leaf=lambda s: isinstance(s, jax.NamedSharding))
        for array, sharding in zip(jax.tree.leaves(tree), expected, strict=True):
            assert array.sharding.is_equivalent_to(sharding, array.ndim)
    _, eager, _ = split_model(build())
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(a, b)  # the same initial values as an eager build
    step = jit_train_step(graphdef, tx, default_loss, shardings)
    x = jax.device_put(np.ones((8, 128), np.float32), shardings.batch)
    p, o, r, loss = step(p, o, r, x)
    assert np.isfinite(float(loss))
