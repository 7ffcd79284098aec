"""The initial state computed with NumPy (`scamp_jax.planning.host_init`): JAX's keys and random
bits bit for bit, the models' initialisations within a few units in the last place of JAX's
jitted ones, and no compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.memory_accuracy import BY_NAME
from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.planning import host_init
from scamp_jax.planning.compile_events import CompileCounter
from scamp_jax.planning.initial_state import _init_fn, initial_model
from tests.test_reuse import assert_initialisations_agree


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 12345)),
                                  2**31 - 1])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (2, 3, 4), (300, 700), (1024, 1100)])
def test_keys_and_random_bits_are_jaxs_bit_for_bit(seed, shape):
    def draw(s):
        key = jax.random.fold_in(jax.random.key(s), 7)
        keys = jax.random.split(key, (2, 3))
        return (jax.random.key_data(key), jax.random.key_data(keys),
                jax.random.bits(key, shape), jax.random.bits(keys[1, 2], shape, jnp.uint8),
                jax.random.uniform(key, shape), jax.vmap(lambda k: jax.random.bits(k, shape))(
                    keys[0]))

    closed = jax.make_jaxpr(draw)(jnp.int32(0))
    assert host_init.unsupported(closed) is None
    for got, want in zip(host_init.evaluate(closed, np.int32(seed)), jax.jit(draw)(seed),
                         strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_shifts_past_the_width_follow_xla():
    x = np.array([1, -8, 2**30], np.int32)
    s = np.array([31, 40, 32], np.int32)

    def shifts(x, s):
        return (jax.lax.shift_left(x, s), jax.lax.shift_right_logical(x, s),
                jax.lax.shift_right_arithmetic(x, s))

    closed = jax.make_jaxpr(shifts)(x, s)
    for got, want in zip(host_init.evaluate(closed, x, s), jax.jit(shifts)(x, s), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize("case", ["mlp", "transformer", "swinir", "vit"])
def test_the_models_initialisations_agree_with_jaxs_and_compile_nothing(case):
    build = BY_NAME[case].build
    init = _init_fn(build, make_optimizer({}), None)
    args = (jnp.int32(5), {"learning_rate": jnp.float32(3e-4)})
    closed = jax.make_jaxpr(init)(*args)
    assert host_init.unsupported(closed) is None
    with CompileCounter() as count:
        got = host_init.evaluate(closed, np.int32(5), np.float32(3e-4))
    assert count.total == 0
    want = jax.jit(init)(*args)
    keys = [jax.random.key_data(w) if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key)
            else w for w in jax.tree.leaves(want)]
    assert_initialisations_agree(got, keys)


def test_an_unknown_operation_is_named():
    closed = jax.make_jaxpr(lambda x: jnp.linalg.qr(x)[0])(jnp.ones((3, 3)))
    reason = host_init.unsupported(closed)
    assert reason is not None and "no rule" in reason
    with pytest.raises(NotImplementedError):
        host_init.evaluate(closed, np.ones((3, 3), np.float32))


def test_initial_model_is_the_plain_model_to_a_few_units_in_the_last_place():
    build = BY_NAME["vit"].build
    model = initial_model(build, 3)
    assert_initialisations_agree(nnx.state(model), nnx.state(build(nnx.Rngs(3))))


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit (a NaN's payload aside)."""
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind != "f":
        return bool(np.array_equal(got, want))
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and np.array_equal(
        np.where(nan, 0, got).view(np.uint8), np.where(nan, 0, want).view(np.uint8)))


_INT = np.array([np.iinfo(np.int32).min, 7, np.iinfo(np.int32).min, -7, 7, -7], np.int32)
_BY = np.array([2, 0, 3, 2, -2, 0], np.int32)
_FLOATS = np.array([np.nan, 3e9, np.inf, -np.inf, -3.7, 2.9, -1e10, -0.0], np.float32)
_ZEROS = (np.array([-0.0, 0.0, np.nan, -1.0, 2.0], np.float32),
          np.array([0.0, -0.0, 1.0, np.nan, 2.0], np.float32))
EDGES = {
    "integer division": (jax.lax.div, (_INT, _BY)),
    "integer remainder": (jax.lax.rem, (_INT, _BY)),
    "unsigned by zero": (lambda a, b: (jax.lax.div(a, b), jax.lax.rem(a, b)),
                         (np.array([7, 0, 5], np.uint32), np.array([0, 0, 2], np.uint32))),
    "float to int32": (lambda x: jax.lax.convert_element_type(x, jnp.int32), (_FLOATS,)),
    "float to uint8": (lambda x: jax.lax.convert_element_type(x, jnp.uint8), (_FLOATS,)),
    "integer powers": (lambda x: [jax.lax.integer_pow(x, y) for y in (3, 5, -2, 0)],
                       (np.array([7.77, 1.3, -2.5, 0.0], np.float32),)),
    "sign of zeros": (jax.lax.sign, (_ZEROS[0],)),
    "max and min of zeros": (lambda a, b: (jax.lax.max(a, b), jax.lax.min(a, b)), _ZEROS),
    "subnormals flushed": (lambda x: (jax.nn.sigmoid(x), x * x),
                           (np.array([-100.0, 1e-20, 3.0], np.float32),)),
    "split, unstack, rev, any": (
        lambda x: (*jnp.split(x, 2), *x.reshape(2, 2), x[::-1], jnp.any(x > 1)),
        (np.arange(4, dtype=np.float32),)),
}


@pytest.mark.parametrize("case", sorted(EDGES))
def test_rules_follow_xla_at_the_edges(case):
    fn, args = EDGES[case]
    closed = jax.make_jaxpr(fn)(*args)
    assert host_init.unsupported(closed) is None
    want = jax.tree.leaves(jax.jit(fn)(*args))
    for got, expected in zip(host_init.evaluate(closed, *args), want, strict=True):
        assert _same(got, np.asarray(expected)), (case, got, expected)


def test_a_key_the_program_closes_over_and_a_bit_cast_across_widths():
    key = jax.random.key(11)

    def draw(s):
        return jax.random.normal(jax.random.fold_in(key, s), (4,))

    closed = jax.make_jaxpr(draw)(jnp.int32(0))
    got = host_init.evaluate(closed, np.int32(3))[0]
    np.testing.assert_allclose(got, np.asarray(jax.jit(draw)(3)), rtol=0, atol=1e-6)
    widths = jax.make_jaxpr(lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8))(
        jnp.ones(2, jnp.uint32))
    assert "width" in host_init.unsupported(widths)
