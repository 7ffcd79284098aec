"""The weight-sharing SR supernet: candidates, subnet sampling, flat weight layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from search_spaces.supernet import (
    SupernetConfig,
    SupernetLayout,
    candidate_ops,
    l1_loss,
    sample_subnets,
    subnet_labels,
)

TINY = SupernetConfig(num_layers=4, num_choices=6, width=8, scale=2, window_size=4)


@pytest.fixture(scope="module")
def layout() -> SupernetLayout:
    return SupernetLayout(TINY)


def test_candidates_mix_kinds_and_costs():
    ops = candidate_ops(12, 8)
    assert {o.kind for o in ops} == {"conv", "mlp", "attn"}
    assert all(8 % o.size == 0 for o in ops if o.kind == "attn")
    assert len({o.label for o in ops}) == 12
    assert [o.label for o in candidate_ops(3, 16)] == ["conv3", "mlp2", "attn1"]
    with pytest.raises(ValueError, match="num_choices=0"):
        candidate_ops(0, 8)


def test_sample_subnets_seeded_with_sequence_ids():
    a = sample_subnets(5, TINY, seed=3)
    assert a == sample_subnets(5, TINY, seed=3)
    assert a != sample_subnets(5, TINY, seed=4)
    assert [s.seq_id for s in a] == list(range(5))
    assert all(len(s.choices) == 4 and all(0 <= c < 6 for c in s.choices) for s in a)
    # Later subnets of the same stream continue it.
    assert sample_subnets(3, TINY, seed=3, start=2) == a[2:5]


def test_init_is_seeded_padded_and_sized(layout):
    blocks, shared = layout.init(0)
    again, _ = layout.init(0)
    other, _ = layout.init(1)
    assert blocks.shape == (4, 6, layout.block_size) and blocks.dtype == np.float32
    assert shared.shape == (layout.shared_size,)
    np.testing.assert_array_equal(blocks, again)
    assert not np.array_equal(blocks, other)
    for c, size in enumerate(layout.block_sizes):
        assert np.all(blocks[:, c, size:] == 0)
        assert np.any(blocks[:, c, :size] != 0)
    assert layout.param_count() == 4 * sum(layout.block_sizes) + layout.shared_size
    # Different layers draw different weights for the same candidate.
    assert not np.array_equal(blocks[0, 0], blocks[1, 0])


def test_forward_shapes_and_choice_matters(layout):
    blocks, shared = layout.init(0)
    lr = jax.random.uniform(jax.random.key(0), (2, 4, 4, 3))
    fwd = jax.jit(layout.forward)
    outs = [fwd(blocks, shared, jnp.array([c] * 4), lr) for c in range(6)]
    assert outs[0].shape == (2, 8, 8, 3)
    for c in range(1, 6):
        assert not np.allclose(outs[0], outs[c])
    # Padding beyond a block's size is never read.
    noisy = blocks.copy()
    for c, size in enumerate(layout.block_sizes):
        noisy[:, c, size:] = 7.0
    np.testing.assert_array_equal(fwd(noisy, shared, jnp.array([0, 1, 2, 3]), lr),
                                  fwd(blocks, shared, jnp.array([0, 1, 2, 3]), lr))


def test_flat_vector_round_trips_module_weights(layout):
    blocks, _ = layout.init(0)
    cand = layout.candidates[2]  # window attention
    module = cand.module(jnp.asarray(blocks[0, 2]))
    assert module.attn.num_heads == TINY.ops[2].size
    flat = jax.flatten_util.ravel_pytree(jax.tree.leaves(module))[0]
    assert flat.shape == (cand.size,)


def test_patch_must_fit_window(layout):
    layout.check_patch(8)
    with pytest.raises(ValueError, match="window_size=4"):
        layout.check_patch(6)


def test_l1_and_labels():
    assert float(l1_loss(jnp.ones((2, 2)), jnp.zeros((2, 2)))) == 1.0
    assert subnet_labels(TINY, (0, 1, 2, 0)) == "conv3-mlp2-attn1-conv3"


def test_zero_init_residual_starts_every_block_as_the_identity():
    import dataclasses

    plain = SupernetLayout(TINY)
    zeroed = SupernetLayout(dataclasses.replace(TINY, zero_init_residual=True))
    before, shared_before = plain.init(0)
    after, shared_after = zeroed.init(0)
    np.testing.assert_array_equal(shared_before, shared_after)
    # Only output projections were zeroed; everything else is drawn as before.
    changed = before != after
    assert changed.any() and np.all(after[changed] == 0)
    x = jax.random.normal(jax.random.key(0), (1, 4, 4, TINY.width))
    for c, cand in enumerate(zeroed.candidates):
        np.testing.assert_array_equal(cand.module(jnp.asarray(after[0, c]))(x), x)
        if TINY.ops[c].kind != "conv":  # a conv block is its projection alone
            assert np.any(after[0, c] != 0)  # the rest of the block is not zero


def test_shared_warm_up_trains_the_network_every_fresh_subnet_computes():
    import dataclasses

    from scamp_jax.pipeline.stage import OptimizerSpec
    from search_spaces.supernet_nas import warm_up_shared

    zeroed = SupernetLayout(dataclasses.replace(TINY, zero_init_residual=True))
    blocks, shared = zeroed.init(0)
    rng = np.random.default_rng(0)
    lr = rng.random((3, 2, 4, 4, 3), dtype=np.float32)
    hr = np.repeat(np.repeat(lr, 2, axis=2), 2, axis=3)  # a learnable target: nearest x2
    warm, losses = warm_up_shared(zeroed, shared, lr, hr, steps=40,
                                  optimizer=OptimizerSpec("adam", 1e-2))
    assert losses.shape == (40,) and losses[-3:].mean() < 0.5 * losses[:3].mean()
    assert warm.shape == shared.shape and not np.array_equal(warm, shared)
    # Blocks start as the identity, so every subnet computes the warmed-up stem-head network.
    stem_head = zeroed.apply_head(warm, zeroed.apply_stem(warm, lr[0]), lr[0])
    forward = jax.jit(zeroed.forward)
    for choices in [(0, 1, 2, 3), (5, 4, 3, 2)]:
        out = forward(blocks, warm, jnp.asarray(choices), lr[0])
        np.testing.assert_array_equal(out, stem_head)
    _, none = warm_up_shared(zeroed, shared, lr, hr, steps=0, optimizer=OptimizerSpec())
    assert none.shape == (0,)
    with pytest.raises(ValueError, match="zero_init_residual=True"):
        warm_up_shared(SupernetLayout(TINY), shared, lr, hr, steps=3, optimizer=OptimizerSpec())
    # No warm-up asked: nothing to check, the weights come back as they were.
    same, _ = warm_up_shared(SupernetLayout(TINY), shared, lr, hr, steps=0,
                             optimizer=OptimizerSpec())
    np.testing.assert_array_equal(same, shared)
    with pytest.raises(ValueError, match="steps=-1 must be >= 0"):
        warm_up_shared(zeroed, shared, lr, hr, steps=-1, optimizer=OptimizerSpec())


def test_evaluation_candidates_are_distinct_and_keep_the_draws_they_can():
    """Ranked candidates differ (a repeat would rank the same weights twice); the first draws
    are kept where they differ, so a run without repeats ranks what it ranked before."""
    from search_spaces.supernet import SupernetConfig, distinct_subnets, sample_subnets

    small = SupernetConfig(num_layers=2, num_choices=4, width=8, scale=2, window_size=4)
    drawn = [s.choices for s in sample_subnets(50, small, 1)]
    assert len(set(drawn)) < 50  # 50 draws of 16 subnets repeat
    chosen = [s.choices for s in distinct_subnets(16, small, 1)]
    assert sorted(chosen) == sorted({(a, b) for a in range(4) for b in range(4)})
    kept = list(dict.fromkeys(drawn[:16]))  # the first 16 draws, each once, in their order
    assert chosen[:len(kept)] == kept
    big = SupernetConfig(num_layers=8, num_choices=12, width=8, scale=2, window_size=4)
    first = [s.choices for s in sample_subnets(12, big, 1)]
    assert len(set(first)) == 12
    assert [s.choices for s in distinct_subnets(12, big, 1)] == first
    with pytest.raises(ValueError, match="ask at most 16"):
        distinct_subnets(17, small, 1)
