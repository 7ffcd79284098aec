"""A plain, single-device trainer of the SR supernet: the reference the pipeline is checked against.

`train_reference` trains subnets one after another on the supernet's Flax modules
(`search_spaces.supernet.CandidateOp`, `Stem`, `Head`) with one ``optax.adam`` state per
(layer, candidate) block, as NASPipe keeps it. It shares nothing with the pipeline's stage
executor but the model definition and its initial weights (`SupernetLayout.init`): no flat weight
vectors inside the training step, no ``lax.switch`` over candidates, no stages, no
hand-written optimizer. Each subnet's step is one ``jax.jit`` of the whole subnet, specialised
to its (static) choices.

Against the pipeline (``tests/test_pipeline.py``, seeds 0-2, 2 and 4 stages, 6 subnets) the
losses agree bit for bit and the weights to within 5e-7. The difference is XLA's: the pipeline
runs each candidate inside a run-time ``lax.switch`` branch, a separate computation that XLA
fuses and orders differently, so a few float sums in the backward of MLP and attention blocks
are associated differently; Adam turns those last-bit gradient differences into last-bit step
differences that later subnets build on. The flat weight layout and the optimizer are not it:
the same block through a constant-index switch, and `OptimizerSpec.update` against
``optax.adam``, match bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from search_spaces.supernet import SupernetLayout


def _l1(sr: jax.Array, hr: jax.Array) -> jax.Array:
    return jnp.mean(jnp.abs(sr - hr))


def train_reference(
    layout: SupernetLayout,
    subnets: Sequence[Sequence[int]],
    lr_batches: np.ndarray,
    hr_batches: np.ndarray,
    *,
    seed: int = 0,
    train_shared: bool = False,
    learning_rate: float = 1e-3,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Train ``subnets`` in order, subnet ``i`` on batch ``i``, with per-block ``optax.adam``.

    Args:
      layout: the supernet (its modules and initial weights are used, nothing else).
      subnets: N choice vectors (L,).
      lr_batches: (N, B, h, w, 3) LR inputs; hr_batches: (N, B, 2h, 2w, 3) targets.
      seed: initial weights, ``layout.init(seed)``.
      train_shared: also train the stem and head (one Adam state for the two together).
      learning_rate: Adam step size (default betas and eps).
    Returns:
      ``(losses (N,), blocks (L, C, P), shared (P_shared,))`` with the weights in the layout's
      flat, zero-padded form so that they compare with the pipeline's.
    """
    blocks0, shared0 = layout.init(seed)
    tx = optax.adam(learning_rate)
    cands = layout.candidates
    block_state: dict[tuple[int, int], Any] = {}
    for layer in range(layout.num_layers):
        for c, cand in enumerate(cands):
            block_state[(layer, c)] = nnx.state(cand.module(jnp.asarray(blocks0[layer, c])))
    shared_state = {
        "stem": nnx.state(layout.stem.module(jnp.asarray(shared0[: layout.stem.size]))),
        "head": nnx.state(layout.head.module(jnp.asarray(shared0[layout.stem.size :]))),
    }
    block_opt = {k: tx.init(v) for k, v in block_state.items()}
    shared_opt = tx.init(shared_state)
    stem_def, head_def = layout.stem.graphdef, layout.head.graphdef

    def step(choices: tuple[int, ...], params, opts, shared, shared_opt, lr, hr):
        def loss_fn(params, shared):
            x = nnx.merge(stem_def, shared["stem"])(lr)
            for p, c in zip(params, choices, strict=True):
                x = nnx.merge(cands[c].graphdef, p)(x)
            return _l1(nnx.merge(head_def, shared["head"])(x, lr), hr)

        loss, (g_params, g_shared) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, shared)
        new_params, new_opts = [], []
        for p, g, o in zip(params, g_params, opts, strict=True):
            updates, o = tx.update(g, o, p)
            new_params.append(optax.apply_updates(p, updates))
            new_opts.append(o)
        if train_shared:
            updates, shared_opt = tx.update(g_shared, shared_opt, shared)
            shared = optax.apply_updates(shared, updates)
        return loss, new_params, new_opts, shared, shared_opt

    jitted = jax.jit(step, static_argnums=0)
    losses = []
    for i, choices in enumerate(subnets):
        keys = [(layer, int(c)) for layer, c in enumerate(choices)]
        loss, params, opts, shared_state, shared_opt = jitted(
            tuple(int(c) for c in choices), [block_state[k] for k in keys],
            [block_opt[k] for k in keys], shared_state, shared_opt,
            jnp.asarray(lr_batches[i]), jnp.asarray(hr_batches[i]),
        )
        for k, p, o in zip(keys, params, opts, strict=True):
            block_state[k], block_opt[k] = p, o
        losses.append(float(loss))

    blocks = np.zeros_like(blocks0)
    for (layer, c), state in block_state.items():
        flat = np.asarray(ravel_pytree(state)[0])
        blocks[layer, c, : flat.size] = flat
    shared = np.concatenate([
        np.asarray(ravel_pytree(shared_state["stem"])[0]),
        np.asarray(ravel_pytree(shared_state["head"])[0]),
    ])
    return np.asarray(losses, np.float32), blocks, shared
