"""ViT family: shapes, errors, the search space, and the synthetic task being learnable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optuna
import pytest
from flax import nnx

from search_spaces import vit
from search_spaces.sr_task import train
from search_spaces.swinir import count_params
from tests._residuals import saved_residuals


def test_logits_shape_and_token_count():
    model = nnx.eval_shape(
        lambda: vit.ViT(image_size=16, patch_size=4, num_classes=7, embed_dim=8, depth=2,
                        num_heads=2, rngs=nnx.Rngs(0))
    )
    x = jax.ShapeDtypeStruct((3, 16, 16, 3), jnp.float32)
    out = nnx.eval_shape(lambda m, v: m(v), model, x)
    assert out.shape == (3, 7)
    assert model.pos_embed.shape == (1, 16 + 1, 8)


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        vit.ViT(image_size=30, patch_size=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divisible"):
        vit.ViT(embed_dim=30, num_heads=4, rngs=nnx.Rngs(0))
    model = nnx.eval_shape(lambda: vit.ViT(embed_dim=8, depth=1, num_heads=2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="NHWC"):
        nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((1, 3, 32, 32), jnp.float32))
    with pytest.raises(ValueError, match="variant"):
        vit.space("tiny")


@pytest.mark.parametrize("variant", ["small", "paper"])
def test_space_suggests_buildable_configs(variant):
    space = vit.space(variant)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(3):
        trial = study.ask()
        cfg = space.suggest(trial)
        assert set(cfg) == set(space.grid)
        model = nnx.eval_shape(lambda c=cfg: space.build(c, nnx.Rngs(0)))
        assert len(model.blocks) == cfg["depth"]
        study.tell(trial, 0.0)
    for width in space.grid["embed_dim"]:
        assert all(width % h == 0 for h in space.grid["num_heads"])
    largest = nnx.eval_shape(lambda: space.build(space.largest, nnx.Rngs(0)))
    assert count_params(largest) >= count_params(model)


def test_synthetic_task_batches_are_seeded_and_shaped():
    task = vit.SyntheticClassification(image_size=8, num_classes=3, eval_size=16)
    images, labels = task.sample_batch(5)
    assert images.shape == (5, 8, 8, 3) and labels.shape == (5,) and labels.dtype == jnp.int32
    a = next(task.batches(4, seed=2))
    b = next(task.batches(4, seed=2))
    c = next(task.batches(4, seed=3))
    np.testing.assert_array_equal(a[0], b[0])
    assert not np.array_equal(a[0], c[0])
    assert a[0].shape == (4, 8, 8, 3) and set(a[1]) <= {0, 1, 2}


def test_the_synthetic_tasks_test_samples_are_other_samples():
    """`test` scores samples of a stream of their own: neither the held-out samples (drawn as
    before, so a resumed study's scores compare) nor a training stream's."""
    task = vit.SyntheticClassification(image_size=8, num_classes=3, eval_size=16)
    again = vit.SyntheticClassification(image_size=8, num_classes=3, eval_size=16)
    np.testing.assert_array_equal(task.eval_inputs()[0], again.eval_inputs()[0])

    class Constant(nnx.Module):  # every sample called class 1, whatever it shows
        def __call__(self, x):
            return jnp.tile(jnp.array([0.0, 1.0, 0.0]), (x.shape[0], 1))

    test, held = task.test(Constant()), task.evaluate(Constant())
    images, labels = task._test
    assert test["accuracy"] == float(np.mean(labels == 1))
    assert not np.array_equal(images, task.eval_inputs()[0])
    assert not np.array_equal(images, next(task.batches(16, seed=0))[0])
    assert set(test) == set(held) == {"accuracy", "loss"}


def test_vit_learns_the_synthetic_task():
    task = vit.SyntheticClassification(image_size=8, num_classes=4, eval_size=128, noise=1.0)
    model = vit.ViT(image_size=8, patch_size=4, num_classes=4, embed_dim=16, depth=1,
                    num_heads=2, mlp_ratio=2.0, rngs=nnx.Rngs(0))
    before = task.evaluate(model)
    history = train(model, task, steps=60, batch_size=32, learning_rate=3e-3, log_every=30)
    after = history[-1]
    assert before["accuracy"] < 0.5
    assert after["accuracy"] > 0.9 and after["loss"] < before["loss"]


def test_attention_keeps_only_the_softmax_output_for_the_backward_pass():
    """The block's attention softmax keeps its output only (`search_spaces.softmax`), not
    also its exponentials as JAX's default derivative does; same values, gradients within
    rounding."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 16)), jnp.float32)

    def block(save_output: bool) -> vit.ViTBlock:
        b = vit.ViTBlock(16, 2, 2.0, rngs=nnx.Rngs(0))
        b.set_attributes(save_softmax_output=save_output)
        return b

    def weights_saved(b: vit.ViTBlock) -> list[str]:
        graphdef, params = nnx.split(b)
        saved = saved_residuals(lambda p: nnx.merge(graphdef, p)(x).sum(), params)
        return [note for shape, note in saved if shape[-2:] == (5, 5)]  # (..., heads, 5, 5)

    assert len(weights_saved(block(True))) == 1
    assert len(weights_saved(block(False))) == 2
    np.testing.assert_array_equal(block(True)(x), block(False)(x))
    grads = [nnx.grad(lambda m: (m(x) ** 2).sum())(block(s)) for s in (True, False)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), *grads)
