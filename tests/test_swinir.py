"""SwinIR in Flax: shapes, padding, windows, the shift mask, the weight converter, the space."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optuna
import pytest
from flax import nnx

from scamp_jax.planning.train_step import split_model
from search_spaces import swinir as sw
from tests._residuals import saved_residuals

TINY = dict(embed_dim=12, depths=(2,), num_heads=(3,), mlp_ratio=1.0, window_size=4)


def _tiny(**kw) -> sw.SwinIR:
    return sw.SwinIR(**{**TINY, **kw}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "upsampler, scale, hw, want",
    [
        ("pixelshuffle", 2, (7, 9), (14, 18)),
        ("pixelshuffle", 3, (4, 4), (12, 12)),
        ("pixelshuffledirect", 4, (5, 8), (20, 32)),
        ("nearest+conv", 4, (4, 5), (16, 20)),
        ("", 1, (6, 7), (6, 7)),
    ],
)
def test_output_shapes_for_every_upsampler(upsampler, scale, hw, want):
    abstract = nnx.eval_shape(lambda: _tiny(upsampler=upsampler, upscale=scale))
    x = jax.ShapeDtypeStruct((2, *hw, 3), jnp.float32)
    out = nnx.eval_shape(lambda m, v: m(v), abstract, x)
    assert out.shape == (2, *want, 3)


@pytest.mark.parametrize("upsampler, scale", [("pixelshuffle", 2), ("pixelshuffle", 3),
                                               ("pixelshuffledirect", 4)])
def test_two_builds_of_one_configuration_have_equal_graph_definitions(upsampler, scale):
    # What trials of one architecture share (their jitted step, initial state and the
    # planner's step) is keyed by the graph definition: it must not depend on the build.
    graphdefs = [split_model(nnx.eval_shape(lambda s=seed: sw.SwinIR(
        **TINY, upsampler=upsampler, upscale=scale, rngs=nnx.Rngs(s))))[0] for seed in (0, 1)]
    assert graphdefs[0] == graphdefs[1]


def test_denoise_head_keeps_upstream_crop_rule():
    # Upstream crops to H * upscale, so with upscale=2 the padded size (8) survives.
    abstract = nnx.eval_shape(lambda: _tiny(upsampler="", upscale=2))
    x = jax.ShapeDtypeStruct((1, 6, 7, 3), jnp.float32)
    out = nnx.eval_shape(lambda m, v: m(v), abstract, x)
    assert out.shape == (1, 8, 8, 3)


def test_window_partition_round_trip_and_order():
    x = jnp.arange(2 * 8 * 12 * 3, dtype=jnp.float32).reshape(2, 8, 12, 3)
    win = sw.window_partition(x, 4)
    assert win.shape == (2 * 2 * 3, 4, 4, 3)
    np.testing.assert_array_equal(win[1], x[0, 0:4, 4:8])  # windows row-major in one image
    np.testing.assert_array_equal(win[6], x[1, 0:4, 0:4])  # then the next image
    np.testing.assert_array_equal(sw.window_reverse(win, 4, 8, 12), x)
    with pytest.raises(ValueError, match="not a multiple of window_size"):
        sw.window_partition(x, 5)


def test_relative_position_index_values():
    idx = sw.relative_position_index(2)
    # Tokens (0,0),(0,1),(1,0),(1,1); row = (dy + 1) * 3 + (dx + 1).
    want = np.array([[4, 3, 1, 0], [5, 4, 2, 1], [7, 6, 4, 3], [8, 7, 5, 4]])
    np.testing.assert_array_equal(idx, want)
    big = sw.relative_position_index(8)
    assert big.shape == (64, 64) and big.min() == 0 and big.max() == 15 * 15 - 1
    np.testing.assert_array_equal(np.diag(big), np.full(64, 7 * 15 + 7))


def test_shift_mask_separates_regions():
    mask = sw.shift_attention_mask(8, 8, 4, 2)
    assert mask.shape == (4, 16, 16) and set(np.unique(mask)) == {0.0, -100.0}
    np.testing.assert_array_equal(mask[0], 0.0)  # top-left window holds one region only
    # Last window after the shift mixes four regions: a token attends only to its region.
    last = mask[3]
    np.testing.assert_array_equal(last, last.T)
    assert (last == 0).sum(axis=1).tolist() == [4] * 16
    with pytest.raises(ValueError, match="shift_size"):
        sw.shift_attention_mask(8, 8, 4, 0)


def test_block_window_collapses_when_resolution_not_above_window():
    assert sw.effective_window((8, 8), 8, 4) == (8, 0)
    assert sw.effective_window((6, 9), 8, 4) == (6, 0)
    assert sw.effective_window((16, 16), 8, 4) == (8, 4)


def test_padding_is_reflect_and_output_cropped():
    # A constant image stays constant through padding; check padding is reflect by comparing a
    # non-multiple input with the same image padded by hand.
    model = _tiny(upsampler="pixelshuffledirect", upscale=2, drop_path_rate=0.0, depths=(1,))
    model.eval()
    x = jnp.asarray(np.random.default_rng(0).uniform(size=(1, 6, 7, 3)), jnp.float32)
    padded = jnp.pad(x, ((0, 0), (0, 2), (0, 1), (0, 0)), mode="reflect")
    fwd = nnx.jit(lambda m, v: m(v))
    np.testing.assert_allclose(fwd(model, x), fwd(model, padded)[:, :12, :14], atol=1e-6)


def test_eval_is_deterministic_and_train_uses_drop_path():
    model = _tiny(upsampler="pixelshuffledirect", upscale=2, drop_path_rate=0.5)  # block 2: 0.5
    fwd = nnx.jit(lambda m, v: m(v))
    x = jnp.full((2, 4, 4, 3), 0.5, jnp.float32)
    model.eval()
    a, b = fwd(model, x), fwd(model, x)
    np.testing.assert_array_equal(a, b)
    model.train()
    c, d = fwd(model, x), fwd(model, x)
    assert not np.allclose(c, d)


def test_stochastic_depth_drops_each_branch_per_sample_at_its_rate():
    sd = sw.StochasticDepth([0.0, 0.25, 0.5], rngs=nnx.Rngs(0))
    keep = np.asarray(sd(20_000))
    assert keep.shape == (3, 20_000) and keep.dtype == np.float32
    np.testing.assert_array_equal(keep[0], 1.0)  # rate 0: always kept, divided by 1
    for row, rate in ((1, 0.25), (2, 0.5)):
        assert set(np.unique(keep[row]).tolist()) == {0.0, 1.0 - rate}
        assert abs((keep[row] == 0).mean() - rate) < 0.015  # over 4 standard deviations
    # branches are drawn independently, and every call draws anew
    assert abs(np.corrcoef(keep[1] == 0, keep[2] == 0)[0, 1]) < 0.03
    assert not np.array_equal(np.asarray(sd(64)), np.asarray(sd(64)))
    sd.eval()
    assert sd(4) is None
    assert sw.StochasticDepth([0.0, 0.0], rngs=nnx.Rngs(0))(4) is None
    np.testing.assert_array_equal(np.asarray(sw.StochasticDepth([1.0], rngs=nnx.Rngs(0))(8)), 0.0)
    with pytest.raises(ValueError, match="not in"):
        sw.StochasticDepth([1.5], rngs=nnx.Rngs(0))
    # a kept branch is divided by its keep probability, a dropped one is 0, in float16 too
    y = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 4)), jnp.float32)
    keep = jnp.asarray([0.8, 0.0, 1e-6], jnp.float32)
    out = sw.drop_branch(y, keep)
    np.testing.assert_array_equal(out[0], y[0] / np.float32(0.8))
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[2], y[2] / np.float32(1e-6))
    half = sw.drop_branch(y.astype(jnp.float16), keep)
    assert half.dtype == jnp.float16 and bool(jnp.all(half[2] != 0))


def test_a_block_drops_the_branches_of_the_samples_its_draws_say():
    blk = sw.SwinTransformerBlock(8, (4, 4), 2, window_size=4, shift_size=2, drop_path=0.5,
                                  rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16, 8)), jnp.float32)
    whole = blk(x, (4, 4))
    # sample 0: both branches dropped; 1: both kept (divided by 0.5); 2: the MLP branch dropped
    keep = jnp.asarray([[0.0, 0.5, 1.0], [0.0, 0.5, 0.0]], jnp.float32)
    out = blk(x, (4, 4), keep)
    np.testing.assert_array_equal(out[0], x[0])
    attn_only = blk(x, (4, 4), jnp.asarray([[1.0] * 3, [0.0] * 3], jnp.float32))
    np.testing.assert_allclose(out[2], attn_only[2], rtol=1e-6, atol=1e-6)
    assert not np.allclose(out[2], whole[2]) and not np.allclose(out[1], whole[1])
    # a dropped branch passes no gradient to the weights, and nothing is NaN
    grads = nnx.grad(lambda b: b(x[:1], (4, 4), keep[:, :1]).sum())(blk)
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
    model = _tiny(upsampler="pixelshuffledirect", upscale=2, drop_path_rate=0.5, depths=(2, 2),
                  num_heads=(3, 3))
    rates = np.linspace(0.0, 0.5, 4)
    np.testing.assert_allclose(model.stochastic_depth.rates, np.repeat(rates, 2))
    assert [blk.drop_path for layer in model.layers
            for blk in layer.residual_group.blocks] == pytest.approx(rates.tolist())


def test_the_initial_weights_do_not_depend_on_the_stochastic_depth_rate():
    with_sd = split_model(_tiny(upsampler="pixelshuffle", drop_path_rate=0.3, depths=(2, 2),
                                num_heads=(3, 3)))[1]
    without = split_model(_tiny(upsampler="pixelshuffle", drop_path_rate=0.0, depths=(2, 2),
                                num_heads=(3, 3)))[1]
    jax.tree.map(np.testing.assert_array_equal, with_sd, without)


def test_stochastic_depth_traces_at_a_symbolic_batch():
    """The planner's estimate from shapes traces a training step once, at a symbolic batch
    (`scamp_jax.planning.memory`): the draws take the batch as a dimension, not a number."""
    model = _tiny(upsampler="pixelshuffledirect", upscale=2, drop_path_rate=0.5)
    graphdef, state = nnx.split(model)
    (b,) = jax.export.symbolic_shape("b")

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    out = jax.eval_shape(forward, state, jax.ShapeDtypeStruct((b, 4, 4, 3), jnp.float32))
    assert out.shape == (b, 8, 8, 3)


def _attention_residuals(save_output: bool) -> list[tuple[tuple[int, ...], str]]:
    attn = sw.WindowAttention(8, 4, 2, rngs=nnx.Rngs(0))
    attn.set_attributes(save_softmax_output=save_output)
    graphdef, params = nnx.split(attn)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 16, 8)), jnp.float32)
    return saved_residuals(lambda p, v: nnx.merge(graphdef, p)(v).sum(), params, x)


def test_window_attention_keeps_only_the_softmax_output_for_the_backward_pass():
    """JAX's default derivative of ``exp(x - max) / sum`` keeps the exponentials and the
    output; the attention's softmax keeps the output only (`search_spaces.softmax`), the same
    forward values and gradients within rounding."""
    weights = (3, 2, 16, 16)  # windows, heads, tokens, tokens
    kept = [note for shape, note in _attention_residuals(True) if shape == weights]
    default = [note for shape, note in _attention_residuals(False) if shape == weights]
    assert len(kept) == 1 and "custom_jvp" in kept[0]
    assert len(default) == 2 and any("exp" in note for note in default)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 16, 8)), jnp.float32)
    mask = jnp.asarray(sw.shift_attention_mask(8, 8, 4, 2))[:3]

    def run(save_output: bool):
        attn = sw.WindowAttention(8, 4, 2, rngs=nnx.Rngs(0))
        attn.set_attributes(save_softmax_output=save_output)
        return attn(x, mask), nnx.grad(lambda m: (m(x, mask) ** 2).sum())(attn)

    (out, grads), (out0, grads0) = run(True), run(False)
    np.testing.assert_array_equal(out, out0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads, grads0)


def test_lightweight_x2_parameter_count_matches_paper():
    abstract = nnx.eval_shape(
        lambda: sw.SwinIR(
            img_size=64, embed_dim=60, depths=(6, 6, 6, 6), num_heads=(6, 6, 6, 6), window_size=8,
            mlp_ratio=2.0, upsampler="pixelshuffledirect", rngs=nnx.Rngs(0),
        )
    )
    # Paper: 878K for SwinIR lightweight x2, bias tables excluded.
    assert sw.count_params(abstract, exclude_bias_tables=True) == 877_752
    assert sw.count_params(abstract) == 910_152


def _fake_state_dict(model: sw.SwinIR) -> dict[str, np.ndarray]:
    """Official-layout arrays for every parameter of ``model`` (inverse of the converter)."""
    out = {}
    for name, (var, kind) in sw._torch_names(model).items():
        shape = tuple(var.shape)
        if kind == "conv" and name.endswith(".weight"):
            shape = (shape[3], shape[2], shape[0], shape[1])
        elif kind == "linear" and name.endswith(".weight"):
            shape = shape[::-1]
        elif kind == "heads_qkv" and name.endswith(".weight"):
            shape = (3 * shape[0], shape[0])
        elif kind == "heads_qkv":
            shape = (int(np.prod(shape)),)
        elif kind == "heads_proj" and name.endswith(".weight"):
            shape = (shape[2], shape[0] * shape[1])
        out[name] = np.random.default_rng(len(out)).normal(size=shape).astype(np.float32)
    return out


def test_converter_names_layouts_and_buffers():
    # An abstract model (nothing allocated) becomes concrete as the weights are loaded.
    model = nnx.eval_shape(
        lambda: _tiny(upsampler="pixelshuffle", upscale=2, resi_connection="3conv")
    )
    sd = _fake_state_dict(model)
    assert "layers.0.residual_group.blocks.1.attn.qkv.weight" in sd
    assert "conv_after_body.4.weight" in sd and "upsample.0.weight" in sd
    assert "conv_before_upsample.0.bias" in sd and "patch_embed.norm.weight" in sd
    sd["layers.0.residual_group.blocks.1.attn.relative_position_index"] = np.zeros((16, 16))
    sd["layers.0.residual_group.blocks.1.attn_mask"] = np.zeros((4, 16, 16))
    sw.load_torch_state_dict(model, {"params": sd})
    attn = model.layers[0].residual_group.blocks[1].attn
    official = sd["layers.0.residual_group.blocks.1.attn.qkv.weight"]  # (3C, C): [q | k | v]
    qkv = np.asarray(attn.qkv.kernel[...])  # (C, heads, 3 * hd), heads-major
    c, heads = official.shape[1], attn.num_heads
    hd = c // heads
    for h in range(heads):
        for j, part in enumerate("qkv"):
            np.testing.assert_array_equal(
                qkv[:, h, j * hd:(j + 1) * hd],
                official[j * c + h * hd: j * c + (h + 1) * hd].T,
                err_msg=f"head {h} {part}",
            )
    np.testing.assert_array_equal(sw.qkv_to_official(qkv), official)
    bias = sd["layers.0.residual_group.blocks.1.attn.qkv.bias"]
    np.testing.assert_array_equal(sw.qkv_to_official(np.asarray(attn.qkv.bias[...])), bias)
    proj = sd["layers.0.residual_group.blocks.1.attn.proj.weight"]  # (C, C), (out, in)
    np.testing.assert_array_equal(np.asarray(attn.proj.kernel[...]).reshape(c, c), proj.T)
    conv = model.conv_first.kernel[...]
    np.testing.assert_array_equal(conv, sd["conv_first.weight"].transpose(2, 3, 1, 0))
    ln = model.layers[0].residual_group.blocks[0].norm1.scale[...]
    np.testing.assert_array_equal(ln, sd["layers.0.residual_group.blocks.0.norm1.weight"])


def test_converter_reports_every_problem():
    model = _tiny(upsampler="pixelshuffledirect", upscale=2, depths=(1,))
    sd = _fake_state_dict(model)
    del sd["conv_first.bias"]
    sd["layers.5.conv.weight"] = np.zeros((12, 12, 3, 3), np.float32)
    sd["norm.weight"] = np.zeros((13,), np.float32)
    before = np.asarray(model.conv_first.kernel[...])
    with pytest.raises(ValueError) as err:
        sw.load_torch_state_dict(model, sd)
    text = str(err.value)
    assert "conv_first.bias" in text and "layers.5.conv.weight" in text
    assert "norm.weight: checkpoint (13,) vs model (12,)" in text
    np.testing.assert_array_equal(model.conv_first.kernel[...], before)  # nothing half-loaded


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(upsampler="bilinear"), "upsampler"),
        (dict(upsampler="nearest+conv", upscale=2), "upscale=4"),
        (dict(resi_connection="2conv"), "resi_connection"),
        (dict(num_heads=(5,)), "not divisible"),
        (dict(depths=(2, 2)), "one entry per residual group"),
        (dict(upsampler="pixelshuffle", upscale=5), "upscale=5"),
    ],
)
def test_bad_arguments_are_explained(kw, match):
    with pytest.raises(ValueError, match=match):
        nnx.eval_shape(lambda: _tiny(**kw))


def test_input_layout_error():
    abstract = nnx.eval_shape(lambda: _tiny(upsampler="pixelshuffledirect"))
    with pytest.raises(ValueError, match="NHWC"):
        nnx.eval_shape(lambda m, x: m(x), abstract, jax.ShapeDtypeStruct((1, 3, 8, 8), jnp.float32))


@pytest.mark.parametrize("variant", ["small", "paper"])
def test_space_suggest_build_and_grid(variant):
    space = sw.space(variant)
    assert space.name == f"swinir-{variant}"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(3 if variant == "small" else 1):  # paper models take long to trace
        trial = study.ask()
        cfg = space.suggest(trial)
        assert set(cfg) == set(space.grid)
        lo, hi = min(space.grid["learning_rate"]), max(space.grid["learning_rate"])
        assert lo <= cfg["learning_rate"] <= hi
        model = nnx.eval_shape(lambda c=cfg: space.build(c, nnx.Rngs(0)))
        assert len(model.layers) == cfg["num_groups"]
        study.tell(trial, 0.0)
    assert set(space.largest) == set(space.grid)


def test_small_space_is_small():
    space = sw.space("small")
    largest = nnx.eval_shape(lambda: space.build(space.largest, nnx.Rngs(0)))
    assert sw.count_params(largest) < 200_000
    smallest = space.suggest(optuna.trial.FixedTrial({k: min(v) for k, v in space.grid.items()}))
    small = nnx.eval_shape(lambda: space.build(smallest, nnx.Rngs(0)))
    assert sw.count_params(small) < sw.count_params(largest)
    out = nnx.eval_shape(
        lambda m, x: m(x), largest, jax.ShapeDtypeStruct((4, 24, 24, 3), jnp.float32)
    )
    assert out.shape == (4, 48, 48, 3)
    with pytest.raises(ValueError, match="variant"):
        sw.space("huge")
