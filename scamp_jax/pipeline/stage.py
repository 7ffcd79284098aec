"""What one pipeline stage computes in one tick, independent of how activations move.

`stage_tick` takes one stage's state, its instruction row, its input data and the activation and
gradient that arrived from its neighbours, and returns the new state plus what it sends on. It
uses no collective, so the same function can run on one device of a ``shard_map`` (activations
moved with ``ppermute``) or on one process of a multi-process pipeline (moved with MPI send/recv).

State of one stage (every array is that stage's shard):

- ``store``: all candidate blocks of the stage's layers, ``(n, C + 1, P)`` per optimizer field
  (weights ``p``, Adam moments ``m``, ``v``) and ``(n, C + 1)`` step counts ``t``; held in host
  memory when offloading. Row ``C`` is a scratch block that absorbs write-backs of ticks that do
  not update anything, so the write-back is one unconditional dynamic update.
- ``window``: the chosen blocks of in-flight subnets, ``(W, n, P)`` / ``(W, n)``, plus a gradient
  accumulator ``acc`` when batches are split into microbatches.
- ``shared``: stem and head weights ``(P_shared,)`` with their optimizer fields.
- ``act`` / ``grad``: saved stage inputs and arrived gradients, ``(K, mb, h, w, width)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from scamp_jax.pipeline.model import StageModel
from scamp_jax.pipeline.program import BWD, COL, NUM_FIELDS

State = dict[str, Any]


@dataclass(frozen=True)
class OptimizerSpec:
    """Per-block optimizer: ``"adam"`` (state per (layer, candidate), as in NASPipe) or ``"sgd"``,
    applied with optax (`transformation`).

    Attributes:
      name: ``"adam"`` or ``"sgd"``.
      learning_rate: step size.
      b1, b2, eps: Adam's moment decays and denominator offset.
    """

    name: str = "adam"
    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in ("adam", "sgd"):
            raise ValueError(f"optimizer {self.name!r} is not supported; use 'adam' or 'sgd'")
        if not self.learning_rate > 0:  # NaN too: it would turn every weight into NaN
            raise ValueError(f"learning_rate={self.learning_rate} must be a positive number")

    @property
    def fields(self) -> tuple[str, ...]:
        """Float arrays kept per weight: ``("p",)`` for SGD, ``("p", "m", "v")`` for Adam."""
        return ("p", "m", "v") if self.name == "adam" else ("p",)

    def transformation(self) -> optax.GradientTransformation:
        """The optax transformation of one block: ``optax.adam`` or ``optax.sgd``."""
        if self.name == "sgd":
            return optax.sgd(self.learning_rate)
        return optax.adam(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps)

    def update(self, fields: dict[str, jax.Array], step: jax.Array, grad: jax.Array):
        """One optimizer step of `transformation`, vmapped over the blocks.

        The moments and step counts live in the pipeline's flat arrays (``m``, ``v``, ``t``), so
        the optax state of a block is rebuilt from them, updated, and taken apart again.

        Args:
          fields: ``{"p": ..., "m": ..., "v": ...}`` arrays of one shape (..., P).
          step: updates applied so far (optax's ``count``), int32 of the leading dims (...).
          grad: gradient, same shape as ``fields["p"]``.
        Returns:
          ``(new fields, step + 1)``.
        """
        tx = self.transformation()

        def one(fields: dict[str, jax.Array], step: jax.Array, grad: jax.Array):
            p = fields["p"]
            state = tx.init(p)
            if self.name == "adam":
                adam = state[0]
                assert isinstance(adam, optax.ScaleByAdamState)
                state = (adam._replace(count=step, mu=fields["m"], nu=fields["v"]), *state[1:])
            updates, state = tx.update(grad, state, p)
            out = {"p": optax.apply_updates(p, updates)}
            if self.name == "adam":
                out["m"], out["v"] = state[0].mu, state[0].nu
            return out, step + 1

        for _ in range(jnp.ndim(step)):
            one = jax.vmap(one)
        return one(fields, step, grad)


@dataclass(frozen=True)
class StageSpec:
    """Static facts every stage program is compiled for.

    Attributes:
      num_stages: S.
      layers_per_stage: n.
      num_choices: C.
      num_microbatches: M (> 1 keeps a gradient accumulator).
      train_shared: update the stem and head (else frozen).
      offload: the store lives in host memory (memory kind ``pinned_host``).
      optimizer: the per-block optimizer.
      guard_idle: run the host-to-device fetch and the write-back under ``lax.cond`` so that
        ticks that fetch or update nothing skip them (False: every tick runs both, masked).
    """

    num_stages: int
    layers_per_stage: int
    num_choices: int
    num_microbatches: int
    train_shared: bool
    offload: bool
    optimizer: OptimizerSpec
    guard_idle: bool = True


def _to_device(x: jax.Array, spec: StageSpec) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device) if spec.offload else x


def _to_host(x: jax.Array, spec: StageSpec) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host) if spec.offload else x


def prefetch(store: State, window: State, ins: jax.Array, spec: StageSpec) -> State:
    """Copy the blocks named by the instruction's prefetch columns from the store into a slot.

    Only the chosen block of each layer crosses to the device: ``lax.switch`` over the candidates
    selects a static slice of the store, outside any differentiated function. With
    ``spec.guard_idle`` the whole fetch sits under a ``lax.cond`` on the prefetch slot, so a tick
    that prefetches nothing moves nothing from host memory.
    """
    n = spec.layers_per_stage
    slot = ins[COL["prefetch_slot"]]
    valid = slot >= 0
    slot = jnp.maximum(slot, 0)
    keys = (*spec.optimizer.fields, "t")

    def fetch_all(window: State, masked: bool) -> State:
        window = dict(window)
        for j in range(n):
            choice = ins[NUM_FIELDS + n + j]

            def fetch(i: int, j: int = j) -> tuple[jax.Array, ...]:
                return tuple(_to_device(store[k][j, i], spec) for k in keys)

            blocks = lax.switch(choice, [lambda i=i: fetch(i) for i in range(spec.num_choices)])
            for k, value in zip(keys, blocks, strict=True):
                if masked:
                    value = jnp.where(valid, value, window[k][slot, j])
                window[k] = window[k].at[slot, j].set(value)
        return window

    if spec.guard_idle:
        return lax.cond(valid, lambda w: fetch_all(w, False), lambda w: dict(w), window)
    return fetch_all(window, True)


def write_back(store: State, window: State, ins: jax.Array, spec: StageSpec) -> State:
    """Copy the op's window slot back to its blocks in the store after an applied update.

    With ``spec.guard_idle`` the copy sits under a ``lax.cond`` on the applied update, so only
    the ticks that apply an update write to host memory. Without it, ticks without an update
    write into the scratch row ``C`` instead (one unconditional dynamic update per layer and
    field, no data-dependent control flow on the store).
    """
    n = spec.layers_per_stage
    applied = (ins[COL["kind"]] == BWD) & (ins[COL["apply"]] == 1)
    slot = ins[COL["window_slot"]]

    def write(store: State, masked: bool) -> State:
        store = dict(store)
        for j in range(n):
            row = ins[NUM_FIELDS + j]
            if masked:
                row = jnp.where(applied, row, spec.num_choices)
            for k in (*spec.optimizer.fields, "t"):
                value = _to_host(window[k][slot, j], spec)
                start = (jnp.int32(j), row) + (jnp.int32(0),) * (value.ndim)
                store[k] = lax.dynamic_update_slice(store[k], value[None, None], start)
        return store

    if spec.guard_idle:
        return lax.cond(applied, lambda s: write(s, False), lambda s: dict(s), store)
    return write(store, True)


def _features(layout: StageModel, stage: jax.Array, choices: jax.Array, lr: jax.Array):
    """f(shared, blocks, x) -> stage output features (stem first on stage 0)."""

    def f(shared: jax.Array, blocks: jax.Array, x: jax.Array) -> jax.Array:
        h = lax.cond(stage == 0, lambda: layout.apply_stem(shared, lr).astype(x.dtype), lambda: x)
        return layout.apply_layers(blocks, choices, h)

    return f


def compute(
    layout: StageModel,
    spec: StageSpec,
    stage: jax.Array,
    state: State,
    ins: jax.Array,
    lr: jax.Array,
    hr: jax.Array,
) -> tuple[State, jax.Array, jax.Array, jax.Array]:
    """Run the tick's forward or backward (and update) on one stage.

    Args:
      stage: this stage's index (int32 scalar).
      state: the stage's ``window``, ``shared``, ``act`` and ``grad`` (``store`` is not read).
      ins: the stage's instruction row (see `scamp_jax.pipeline.program.FIELDS`).
      lr: (mb, h, w, 3) LR inputs of the op's microbatch (used on the first and last stage).
      hr: (mb, r h, r w, 3) targets (used on the last stage).
    Returns:
      ``(state, act_out, grad_out, loss)``: features sent to the next stage (after a forward),
      the input gradient sent to the previous stage (after a backward), and the microbatch loss
      computed by a backward on the last stage (0 elsewhere).
    """
    n, last = spec.layers_per_stage, spec.num_stages - 1
    choices = ins[NUM_FIELDS : NUM_FIELDS + n]
    slot = ins[COL["window_slot"]]
    window, shared = state["window"], state["shared"]
    x = state["act"][ins[COL["act_slot"]]]
    zeros = jnp.zeros_like(x)
    features = _features(layout, stage, choices, lr)

    def head_loss(sh: jax.Array, y: jax.Array) -> jax.Array:
        return layout.loss(layout.apply_head(sh, y, lr), hr)

    def idle() -> tuple[State, State, jax.Array, jax.Array, jax.Array]:
        return window, shared, zeros, zeros, jnp.float32(0.0)

    def forward() -> tuple[State, State, jax.Array, jax.Array, jax.Array]:
        y = features(shared["p"], window["p"][slot], x)
        # The last stage has no successor: its backward recomputes from the saved input.
        out = lax.cond(stage == last, lambda: zeros, lambda: y)
        return window, shared, out, zeros, jnp.float32(0.0)

    def backward() -> tuple[State, State, jax.Array, jax.Array, jax.Array]:
        # Recompute the stage's forward from its saved input, then pull back the output
        # gradient: the loss's on the last stage, the next stage's elsewhere. One traced copy
        # of the layers serves both cases, which keeps the compiled tick small.
        y, pull_back = jax.vjp(features, shared["p"], window["p"][slot], x)

        def at_last() -> tuple[jax.Array, ...]:
            loss, head_vjp = jax.vjp(head_loss, shared["p"], y)
            g_head, g_y = head_vjp(jnp.ones_like(loss))
            return g_y, g_head, loss

        def inside() -> tuple[jax.Array, ...]:
            g_y = state["grad"][ins[COL["grad_slot"]]]
            return g_y, jnp.zeros_like(shared["p"]), jnp.float32(0.0)

        g_y, g_head, loss = lax.cond(stage == last, at_last, inside)
        g_stem, g_blocks, g_x = pull_back(g_y)
        apply = ins[COL["apply"]] == 1
        new_window = _update(window, slot, g_blocks, apply, spec)
        if spec.train_shared:
            new_shared = _update_shared(shared, g_stem + g_head, apply, spec)
        else:
            new_shared = shared
        return new_window, new_shared, zeros, g_x, loss

    window, shared, act_out, grad_out, loss = lax.switch(
        jnp.clip(ins[COL["kind"]], 0, 2), [idle, forward, backward]
    )
    return {**state, "window": window, "shared": shared}, act_out, grad_out, loss


def _accumulate(acc: jax.Array | None, grad: jax.Array, apply: jax.Array, m_count: int):
    """Gradient to apply and new accumulator; identity when batches are not split."""
    if acc is None:
        return grad, None
    total = acc + grad
    return total * (1.0 / m_count), jnp.where(apply, jnp.zeros_like(total), total)


def _update(window: State, slot: jax.Array, grad: jax.Array, apply: jax.Array, spec: StageSpec):
    opt = spec.optimizer
    acc = window["acc"][slot] if "acc" in window else None
    g, new_acc = _accumulate(acc, grad, apply, spec.num_microbatches)
    fields = {k: window[k][slot] for k in opt.fields}
    new, step = opt.update(fields, window["t"][slot], g)
    window = dict(window)
    for k in opt.fields:
        window[k] = window[k].at[slot].set(jnp.where(apply, new[k], fields[k]))
    window["t"] = window["t"].at[slot].set(jnp.where(apply, step, window["t"][slot]))
    if new_acc is not None:
        window["acc"] = window["acc"].at[slot].set(new_acc)
    return window


def _update_shared(shared: State, grad: jax.Array, apply: jax.Array, spec: StageSpec) -> State:
    opt = spec.optimizer
    g, new_acc = _accumulate(shared.get("acc"), grad, apply, spec.num_microbatches)
    fields = {k: shared[k] for k in opt.fields}
    new, step = opt.update(fields, shared["t"], g)
    out = {k: jnp.where(apply, new[k], fields[k]) for k in opt.fields}
    out["t"] = jnp.where(apply, step, shared["t"])
    if new_acc is not None:
        out["acc"] = new_acc
    return out


def receive(state: State, ins: jax.Array, act_in: jax.Array, grad_in: jax.Array) -> State:
    """Store the activation and gradient that arrived at the end of the tick in their slots."""
    out = dict(state)
    for name, arrived, col in (("act", act_in, "recv_act"), ("grad", grad_in, "recv_grad")):
        slot = ins[COL[col]]
        keep = out[name][jnp.maximum(slot, 0)]
        value = jnp.where(slot >= 0, arrived, keep)
        out[name] = out[name].at[jnp.maximum(slot, 0)].set(value)
    return out


def stage_tick(
    layout: StageModel,
    spec: StageSpec,
    stage: jax.Array,
    state: State,
    ins: jax.Array,
    lr: jax.Array,
    hr: jax.Array,
) -> tuple[State, jax.Array, jax.Array, jax.Array]:
    """Prefetch, compute and write back on one stage: everything before the neighbours exchange.

    Returns ``(state, act_out, grad_out, loss)``; the caller moves ``act_out`` to stage + 1 and
    ``grad_out`` to stage - 1 and then calls `receive`.
    """
    state = {**state, "window": prefetch(state["store"], state["window"], ins, spec)}
    state, act_out, grad_out, loss = compute(layout, spec, stage, state, ins, lr, hr)
    state = {**state, "store": write_back(state["store"], state["window"], ins, spec)}
    return state, act_out, grad_out, loss
