"""How a fused program runs per-member convolutions: on CPU each member's is its solo one."""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from scamp_jax.planning.member_ops import FORM_VARIABLE, member_program, per_member_on_cpu

WIDTH = 3


def conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


@jax.jit
def _inner(x: jax.Array, w: jax.Array) -> jax.Array:
    # a convolution inside a nested jit (as jnp functions and Flax layers produce)
    return jax.nn.gelu(conv(x, w, 2))


def loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    y = jax.nn.relu(conv(x, params["w1"]) + params["b"])
    return jnp.mean(jnp.square(_inner(y, params["w2"])))


def _data(seed: int = 0) -> tuple[dict[str, jax.Array], jax.Array]:
    rng = np.random.default_rng(seed)
    params = {"w1": rng.normal(size=(WIDTH, 3, 3, 3, 4)),
              "w2": rng.normal(size=(WIDTH, 3, 3, 4, 5)), "b": rng.normal(size=(WIDTH, 4))}
    x = rng.normal(size=(WIDTH, 2, 8, 8, 3))
    return (jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params),
            jnp.asarray(x, jnp.float32))


def test_vmapped_member_program_computes_each_members_own_values() -> None:
    """Loss and gradients (forward, input-gradient and weight-gradient convolutions, one in a
    nested jit) of each member equal its solo computation to float32 rounding: within 2e-7 of
    each gradient's largest magnitude (about one ulp; on this example the grouped convolution
    of a plain vmap is 8e-7 off)."""
    params, x = _data()
    step = jax.value_and_grad(loss)
    fused = jax.jit(jax.vmap(member_program(step)))(params, x)
    solo = [jax.jit(step)(jax.tree.map(lambda a, i=i: a[i], params), x[i]) for i in range(WIDTH)]
    for i, (value, grads) in enumerate(solo):
        assert np.asarray(fused[0][i]) == np.asarray(value)
        for name, want in grads.items():
            got, want = np.asarray(fused[1][name][i]), np.asarray(want)
            assert np.max(np.abs(got - want)) <= 2e-7 * np.max(np.abs(want)), (i, name)


def test_unbatched_and_convolution_free_functions_are_unchanged() -> None:
    params, x = _data(1)
    one = jax.tree.map(lambda a: a[0], params)
    # not vmapped: the function's own value
    assert float(member_program(loss)(one, x[0])) == float(jax.jit(loss)(one, x[0]))
    # shared weights, per-member inputs: the member axis folds into the batch as vmap's rule
    shared = jax.jit(jax.vmap(member_program(loss), in_axes=(None, 0)))(one, x)
    np.testing.assert_allclose(np.asarray(shared),
                               [float(jax.jit(loss)(one, x[i])) for i in range(WIDTH)],
                               rtol=1e-6)

    def dense(w: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.tanh(v @ w).sum()

    w = jnp.ones((WIDTH, 3, 2))
    v = jnp.arange(WIDTH * 3, dtype=jnp.float32).reshape(WIDTH, 3)
    np.testing.assert_array_equal(np.asarray(jax.vmap(member_program(dense))(w, v)),
                                  np.asarray(jax.vmap(dense)(w, v)))


def _groups(platform: str) -> list[int]:
    """``feature_group_count`` of every convolution of the fused gradient lowered for
    ``platform``."""
    params, x = _data()
    traced = jax.jit(jax.vmap(member_program(jax.grad(loss)))).trace(params, x)
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    return [int(n) for n in re.findall(r"feature_group_count = (\d+)", text)]


def test_the_platform_decides_the_form_at_lowering() -> None:
    """One traced program: K convolutions per convolution for CPU, one grouped for a GPU."""
    cpu, gpu = _groups("cpu"), _groups("cuda")
    assert set(cpu) == {1} and set(gpu) == {WIDTH}
    assert len(cpu) == WIDTH * len(gpu)


def test_the_environment_can_choose_one_form_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FORM_VARIABLE, "grouped")
    assert set(_groups("cpu")) == {WIDTH}
    monkeypatch.setenv(FORM_VARIABLE, "per_member")
    assert set(_groups("cuda")) == {1}
    monkeypatch.setenv(FORM_VARIABLE, "sometimes")
    with pytest.raises(ValueError, match="SCAMP_FUSED_CONVOLUTIONS='sometimes'"):
        _groups("cpu")


def test_a_form_forced_for_a_block_is_undone_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from scamp_jax.planning.member_ops import forced_form, form_on

    monkeypatch.delenv(FORM_VARIABLE, raising=False)
    assert (form_on("cpu"), form_on("gpu")) == ("per_member", "grouped")
    with forced_form("grouped"):
        assert set(_groups("cpu")) == {WIDTH} and form_on("cpu") == "grouped"
    assert set(_groups("cpu")) == {1} and FORM_VARIABLE not in os.environ
    monkeypatch.setenv(FORM_VARIABLE, "per_member")
    with forced_form("grouped"):
        assert form_on("gpu") == "grouped"
    assert os.environ[FORM_VARIABLE] == "per_member" and form_on("gpu") == "per_member"
    with pytest.raises(ValueError, match="form='sometimes' is not one of"), \
            forced_form("sometimes"):
        pass


def test_per_member_on_cpu_batches_any_array_function() -> None:
    f = per_member_on_cpu(functools.partial(jnp.einsum, "ij,jk->ik"))
    a = jnp.arange(WIDTH * 6, dtype=jnp.float32).reshape(WIDTH, 2, 3)
    b = jnp.ones((3, 4))
    out = jax.vmap(f, in_axes=(0, None))(a, b)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a @ b))
