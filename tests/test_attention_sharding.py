"""Attention is split by whole heads: every projection of ViT and SwinIR, and the compiled step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from scamp_jax.planning import sharding as sh
from scamp_jax.planning.memory import default_step_shardings
from scamp_jax.planning.train_step import (
    abstract_state,
    default_optimizer,
    jit_train_step,
    split_model,
)
from search_spaces import swinir as sw
from search_spaces import vit


def _vit(heads: int) -> nnx.Module:
    return nnx.eval_shape(lambda: vit.ViT(image_size=16, patch_size=4, embed_dim=48, depth=2,
                                          num_heads=heads, rngs=nnx.Rngs(0)))


def _swinir(heads: int) -> nnx.Module:
    return nnx.eval_shape(lambda: sw.SwinIR(embed_dim=48, depths=(2,), num_heads=(heads,),
                                            window_size=4, mlp_ratio=1.0, img_size=8,
                                            upsampler="pixelshuffledirect", upscale=2,
                                            rngs=nnx.Rngs(0)))


#: (owner of the parameter, parameter name) -> index of its heads axis, per family.
_HEADS_AXIS = {
    "vit": {("query", "kernel"): 1, ("key", "kernel"): 1, ("value", "kernel"): 1,
            ("query", "bias"): 0, ("key", "bias"): 0, ("value", "bias"): 0,
            ("out", "kernel"): 0},
    "swinir": {("qkv", "kernel"): 1, ("qkv", "bias"): 0, ("proj", "kernel"): 0},
}


def _attention_specs(model: nnx.Module, mp: int) -> list[tuple[tuple[str, ...], tuple, object]]:
    """(path, shape, spec) of every parameter under an ``attn`` module, all sizes split."""
    params = nnx.state(model, nnx.Param)
    specs = sh.param_partition_specs(params, mp, min_shard_elements=0)
    out = []
    for (path, leaf), spec in zip(jax.tree.leaves_with_path(params),
                                  jax.tree.leaves(specs, is_leaf=lambda x: isinstance(
                                      x, jax.sharding.PartitionSpec)), strict=True):
        names = tuple(sh._path_names(path))
        if "attn" in names:
            out.append((names, tuple(leaf.shape), spec))
    return out


@pytest.mark.parametrize("mp", [2, 4])
@pytest.mark.parametrize("family, heads", [("vit", 4), ("vit", 8), ("swinir", 4), ("swinir", 8)])
def test_every_attention_projection_is_split_on_its_heads_axis(family, heads, mp):
    model = _vit(heads) if family == "vit" else _swinir(heads)
    found = set()
    for names, shape, spec in _attention_specs(model, mp):
        owner, leaf = names[names.index("attn") + 1], names[names.index("attn") + 2]
        axis = _HEADS_AXIS[family].get((owner, leaf))
        if axis is None:
            continue  # output biases (C,), SwinIR's relative position bias table
        found.add((owner, leaf))
        assert shape[axis] == heads, (names, shape)
        split = [i for i, a in enumerate(spec) if a == sh.MODEL_AXIS]
        assert split == [axis], f"{'/'.join(names)} {shape} got {spec}; heads axis is {axis}"
    assert found == set(_HEADS_AXIS[family])


@pytest.mark.parametrize("family", ["vit", "swinir"])
def test_heads_that_do_not_divide_never_split_head_dim(family):
    # 6 heads on 4 devices: the projection falls back to its feature axis, not head_dim.
    model = _vit(6) if family == "vit" else _swinir(6)
    for names, shape, spec in _attention_specs(model, 4):
        owner = names[names.index("attn") + 1]
        if owner in ("query", "key", "value", "qkv") and len(shape) == 3:
            assert spec == jax.sharding.PartitionSpec("model", None, None), (names, spec)
        if owner in ("query", "key", "value", "qkv") and len(shape) == 2:
            assert spec == jax.sharding.PartitionSpec(), (names, spec)
        if owner in ("out", "proj") and len(shape) == 3:
            assert spec == jax.sharding.PartitionSpec(None, None, "model"), (names, spec)


def _compiled_step_hlo(model: nnx.Module, batch: tuple) -> str:
    optimizer = default_optimizer()
    params, opt_state, rest = abstract_state(model, optimizer)
    mesh = sh.make_mesh(jax.devices()[:2], 1, 2)
    shardings = default_step_shardings(mesh, params, opt_state, rest, optimizer,
                                       min_shard_elements=0)
    graphdef = split_model(model)[0]

    def loss(m: nnx.Module, b: tuple) -> jax.Array:
        out = m(b[0])
        return jnp.mean((out - b[1]) ** 2) if out.shape == b[1].shape else jnp.mean(out**2)

    step = jit_train_step(graphdef, optimizer, loss, shardings)
    return step.lower(params, opt_state, rest, batch).compile().as_text()


@pytest.mark.parametrize("family", [pytest.param("vit", marks=pytest.mark.slow), "swinir"])
def test_compiled_step_at_model_parallel_2_has_no_all_to_all(family):
    if family == "vit":
        model = _vit(4)
        batch = (jax.ShapeDtypeStruct((4, 16, 16, 3), jnp.float32),
                 jax.ShapeDtypeStruct((4, 10), jnp.float32))
    else:
        model = _swinir(4)
        batch = (jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32),
                 jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32))
    hlo = _compiled_step_hlo(model, batch)
    assert re.search(r"\ball-reduce", hlo), "expected a model-parallel split (an all-reduce)"
    assert not re.search(r"\ball-to-all", hlo), [
        line.strip()[:200] for line in hlo.splitlines() if "all-to-all" in line][:5]
