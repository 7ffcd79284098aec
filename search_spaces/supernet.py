"""A weight-sharing super-resolution supernet built from SwinIR pieces (Flax NNX, NHWC).

``stem -> L choice layers -> head``. Every choice layer offers the same C candidate operations of
different kinds and costs (window attention with different head counts, MLPs of different widths,
convolutions of different kernel sizes), each a residual block ``x + op(x)`` on a
``(B, h, w, width)`` feature map; each (layer, candidate) pair owns its own weights. A *subnet*
picks one candidate per layer.

For pipelined training the weights are kept as flat float32 vectors (one per block, zero-padded
to a common length ``P``) so that a stage can hold "the chosen block of layer j" in one array
slot whatever its kind, fetch it from host memory, and update it with an element-wise optimizer.
The modules are rebuilt from a vector inside the traced function (`nnx.merge`), so the flat
layout costs nothing at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.flatten_util import ravel_pytree

from search_spaces.swin_blocks import (
    Mlp,
    WindowAttention,
    conv2d,
    gelu,
    layer_norm,
    pixel_shuffle,
    window_partition,
    window_reverse,
)

_KINDS = ("conv", "mlp", "attn")
#: Factor on the head's initial weights (PyTorch default init otherwise).
HEAD_INIT_SCALE = 0.1
#: Weights of a candidate's last layer (its residual branch's output), zero with
#: ``SupernetConfig.zero_init_residual``.
_OUTPUT_PROJECTIONS = ("conv.", "mlp.fc2.", "attn.proj.")
# Sizes each kind cycles through: kernel sizes, hidden-width ratios, head counts.
_SIZES = {"conv": (3, 5, 1, 7), "mlp": (2, 1, 4, 3), "attn": (1, 2, 4, 8)}


@dataclass(frozen=True)
class OpSpec:
    """One candidate operation: ``kind`` in {conv, mlp, attn} and its ``size`` (kernel side,
    MLP hidden ratio, or attention heads)."""

    kind: str
    size: int

    @property
    def label(self) -> str:
        """Short name, e.g. ``conv3``, ``mlp2``, ``attn4``."""
        return f"{self.kind}{self.size}"


def candidate_ops(num_choices: int, width: int) -> tuple[OpSpec, ...]:
    """The C candidates of every choice layer, cycling kinds and sizes: conv3, mlp2, attn1, ...

    Head counts that do not divide ``width`` are skipped; repeats of a spec are distinct candidates
    (each (layer, candidate) has its own weights).
    """
    if num_choices < 1:
        raise ValueError(f"{num_choices=} must be at least 1")
    heads = [h for h in _SIZES["attn"] if width % h == 0]
    specs: list[OpSpec] = []
    i = 0
    while len(specs) < num_choices:
        kind = _KINDS[i % 3]
        sizes = heads if kind == "attn" else _SIZES[kind]
        specs.append(OpSpec(kind, sizes[(i // 3) % len(sizes)]))
        i += 1
    return tuple(specs)


@dataclass(frozen=True)
class SupernetConfig:
    """Sizes of the supernet.

    Attributes:
      num_layers: L choice layers.
      num_choices: C candidates per layer.
      width: feature channels.
      scale: super-resolution factor r (HR side = r x LR side).
      window_size: attention window side; LR patch sides must be multiples of it.
      zero_init_residual: start every candidate's output projection (the conv, the MLP's second
        layer, the attention's projection) at zero, so that every block starts as the identity
        and every subnet as the same stem-head network; blocks a subnet rarely trains then add
        nothing instead of a random residual.
    """

    num_layers: int = 8
    num_choices: int = 4
    width: int = 16
    scale: int = 2
    window_size: int = 4
    zero_init_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_choices", "width", "scale", "window_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

    @property
    def ops(self) -> tuple[OpSpec, ...]:
        """The candidates of every layer."""
        return candidate_ops(self.num_choices, self.width)


class CandidateOp(nnx.Module):
    """Residual candidate block ``x + op(x)`` on (B, h, w, width) maps; ``op`` from an `OpSpec`."""

    def __init__(self, spec: OpSpec, width: int, window_size: int, *, rngs: nnx.Rngs):
        self.kind = spec.kind
        self.window_size = window_size
        if spec.kind == "conv":
            self.conv = conv2d(width, width, spec.size, rngs=rngs)
        elif spec.kind == "mlp":
            self.norm = layer_norm(width, rngs=rngs)
            self.mlp = Mlp(width, width * spec.size, rngs=rngs)
        elif spec.kind == "attn":
            self.norm = layer_norm(width, rngs=rngs)
            self.attn = WindowAttention(width, window_size, spec.size, rngs=rngs)
        else:
            raise ValueError(f"unknown candidate kind {spec.kind!r}; use one of {_KINDS}")

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "conv":
            return x + self.conv(gelu(x))
        if self.kind == "mlp":
            return x + self.mlp(self.norm(x))
        b, h, w, c = x.shape
        ws = self.window_size
        win = window_partition(self.norm(x), ws).reshape(-1, ws * ws, c)
        out = self.attn(win).reshape(-1, ws, ws, c)
        return x + window_reverse(out, ws, h, w)


class Stem(nnx.Module):
    """3x3 convolution from RGB to features: (B, h, w, 3) -> (B, h, w, width)."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.conv = conv2d(3, width, 3, rngs=rngs)

    def __call__(self, lr: jax.Array) -> jax.Array:
        return self.conv(lr)


class Head(nnx.Module):
    """Features to the HR image: conv + pixel shuffle, added to the bicubic upscaled input.

    (B, h, w, width), (B, h, w, 3) -> (B, r h, r w, 3).
    """

    def __init__(self, width: int, scale: int, *, rngs: nnx.Rngs):
        self.scale = scale
        self.conv = conv2d(width, 3 * scale * scale, 3, rngs=rngs)

    def __call__(self, h: jax.Array, lr: jax.Array) -> jax.Array:
        b, hh, ww, _ = lr.shape
        base = jax.image.resize(lr, (b, hh * self.scale, ww * self.scale, 3), "bicubic")
        return base + pixel_shuffle(self.conv(h), self.scale)


@dataclass(frozen=True)
class Subnet:
    """One subnet: its sequence id (training order) and one candidate index per choice layer."""

    seq_id: int
    choices: tuple[int, ...]


def sample_subnets(num: int, config: SupernetConfig, seed: int, start: int = 0) -> list[Subnet]:
    """``num`` subnets with uniform random choices from a generator seeded by ``seed``.

    Sequence ids are ``start, start + 1, ...``; the same arguments always give the same subnets.
    """
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, config.num_choices, size=(start + num, config.num_layers))
    return [Subnet(start + i, tuple(int(c) for c in picks[start + i])) for i in range(num)]


def distinct_subnets(num: int, config: SupernetConfig, seed: int) -> list[Subnet]:
    """``num`` different subnets (every choice tuple once), ids ``0 .. num - 1``: the draws of
    `sample_subnets` with ``seed`` in their order, a repeat replaced by the generator's next
    new draw, so that where the first ``num`` draws differ these are those draws. Raises
    ``ValueError`` when the space holds fewer than ``num`` subnets."""
    space = config.num_choices ** config.num_layers
    if num > space:
        raise ValueError(
            f"{num} different subnets asked of a supernet of {space} ({config.num_choices} "
            f"choices in each of {config.num_layers} layers); ask at most {space}")
    rng = np.random.default_rng(seed)
    seen: dict[tuple[int, ...], None] = {}
    size = num
    while len(seen) < num:
        for row in rng.integers(0, config.num_choices, size=(size, config.num_layers)):
            seen.setdefault(tuple(int(c) for c in row), None)
            if len(seen) == num:
                break
        size = num - len(seen)
    return [Subnet(i, choices) for i, choices in enumerate(seen)]


def _trunc_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Normal(0, std) truncated to two standard deviations (as SwinIR's ``trunc_normal_``)."""
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out * std


def _leaf_init(
    path: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]], rng: np.random.Generator
) -> np.ndarray:
    """Initial value of one weight, following the initialisers of `search_spaces.swin_blocks`.

    ``path`` is the dotted state path (``attn.qkv.kernel``), ``shapes`` maps every path of the
    module to its shape. Done in numpy: building a few hundred small modules through JAX would
    spend minutes compiling initialisers on a small CPU, for the same distributions.
    """
    prefix, _, name = path.rpartition(".")
    if name == "relative_position_bias_table":
        return _trunc_normal(rng, shape, 0.02)
    if name == "scale":  # LayerNorm
        return np.ones(shape)
    if prefix.rpartition(".")[-1] == "conv":
        # torch Conv2d default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for kernel and bias.
        fan_in = int(np.prod(shapes[f"{prefix}.kernel"][:-1]))
        return rng.uniform(-1.0, 1.0, shape) / np.sqrt(fan_in)
    if name == "kernel":  # Linear
        return _trunc_normal(rng, shape, 0.02)
    return np.zeros(shape)  # Linear and LayerNorm biases


def _key_name(key: object) -> str:
    """Plain name of one pytree path entry (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class _Flat:
    """A module class flattened to a vector: its graph, unravel function and size."""

    def __init__(self, make: Callable[[nnx.Rngs], nnx.Module]):
        abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
        self.graphdef, state = nnx.split(abstract)
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state)
        flat, self.unravel = ravel_pytree(zeros)
        self.size = int(flat.shape[0])
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        names = [".".join(n for n in map(_key_name, path) if n != "value") for path, _ in leaves]
        self._leaves = [(n, tuple(leaf.shape)) for n, (_, leaf) in zip(names, leaves, strict=True)]

    def init(self, rng: np.random.Generator, zero: tuple[str, ...] = ()) -> np.ndarray:
        """Freshly initialised flat weights (size,) float32 drawn from ``rng``.

        The order of the entries is that of ``ravel_pytree`` over the module state. Weights whose
        path starts with one of ``zero`` are zeros (their random draws are still made, so the
        other weights do not change).
        """
        shapes = dict(self._leaves)
        parts = [_leaf_init(path, shape, shapes, rng) for path, shape in self._leaves]
        parts = [
            np.zeros_like(part) if path.startswith(zero) else part
            for (path, _), part in zip(self._leaves, parts, strict=True)
        ] if zero else parts
        return np.concatenate([p.astype(np.float32).ravel() for p in parts])

    def module(self, vec: jax.Array) -> nnx.Module:
        """The module whose weights are the first ``size`` entries of ``vec``."""
        return nnx.merge(self.graphdef, self.unravel(vec[: self.size]))


def _candidate_factory(spec: OpSpec, width: int, window: int) -> Callable[[nnx.Rngs], nnx.Module]:
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return CandidateOp(spec, width, window, rngs=rngs)

    return make


class SupernetLayout:
    """Flat-vector layout of a supernet's weights and the pure functions that apply them.

    Block weights are ``(L, C, P)`` float32 (block (l, c) zero-padded to ``P = max size``);
    shared weights are one vector ``(P_stem + P_head,)``: stem first, then head.
    """

    def __init__(self, config: SupernetConfig):
        self.config = config
        w, ws = config.width, config.window_size
        self.candidates = [_Flat(_candidate_factory(spec, w, ws)) for spec in config.ops]
        self.stem = _Flat(lambda r: Stem(w, rngs=r))
        self.head = _Flat(lambda r: Head(w, config.scale, rngs=r))
        self.block_size = max(c.size for c in self.candidates)
        self.shared_size = self.stem.size + self.head.size

    @property
    def num_layers(self) -> int:
        """L choice layers."""
        return self.config.num_layers

    @property
    def num_choices(self) -> int:
        """C candidates per layer."""
        return self.config.num_choices

    @property
    def stem_size(self) -> int:
        """Floats of the stem (the first entries of the shared vector)."""
        return self.stem.size

    def loss(self, output: jax.Array, target: jax.Array) -> jax.Array:
        """Training loss of an SR output against its HR target: `l1_loss`."""
        return l1_loss(output, target)

    def feature_shape(self, batch: int, side: int) -> tuple[int, ...]:
        """Features between choice layers for ``batch`` LR patches of ``side`` pixels:
        ``(batch, side, side, width)``."""
        return (batch, side, side, self.config.width)

    def check_input(self, side: int) -> None:
        """`check_patch`: raise unless LR patches of ``side`` pixels fit the windows."""
        self.check_patch(side)

    @cached_property
    def block_sizes(self) -> tuple[int, ...]:
        """Unpadded parameter count of each candidate (C,)."""
        return tuple(c.size for c in self.candidates)

    def param_count(self) -> int:
        """Trainable parameters of the whole supernet (unpadded), a count."""
        return self.config.num_layers * sum(self.block_sizes) + self.shared_size

    def init(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Initial ``(blocks (L, C, P), shared (P_shared,))`` float32 numpy arrays.

        Block (l, c) draws from a generator seeded by ``(seed, l, c)``, so the weights do not
        depend on how layers are later split into stages.
        """
        cfg = self.config
        blocks = np.zeros((cfg.num_layers, cfg.num_choices, self.block_size), np.float32)
        for layer in range(cfg.num_layers):
            for c, cand in enumerate(self.candidates):
                rng = np.random.default_rng((seed, layer, c))
                zero = _OUTPUT_PROJECTIONS if cfg.zero_init_residual else ()
                blocks[layer, c, : cand.size] = cand.init(rng, zero)
        stem = self.stem.init(np.random.default_rng((seed, cfg.num_layers, 0)))
        # A small head makes the untrained network close to bicubic upscaling, so short training
        # improves on bicubic instead of first undoing a large random residual.
        head = HEAD_INIT_SCALE * self.head.init(np.random.default_rng((seed, cfg.num_layers, 1)))
        return blocks, np.concatenate([stem, head])

    def apply_block(self, choice: jax.Array, vec: jax.Array, x: jax.Array) -> jax.Array:
        """Apply candidate ``choice`` (traced int) with flat weights ``vec`` (P,) to ``x``."""
        branches = [lambda v, h, c=c: c.module(v)(h) for c in self.candidates]
        return lax.switch(choice, branches, vec, x)

    def apply_layers(self, blocks: jax.Array, choices: jax.Array, x: jax.Array) -> jax.Array:
        """Consecutive choice layers: ``blocks`` (n, P), ``choices`` (n,), x (B, h, w, width)."""
        for j in range(blocks.shape[0]):
            x = self.apply_block(choices[j], blocks[j], x)
        return x

    def apply_stem(self, shared: jax.Array, lr: jax.Array) -> jax.Array:
        """(B, h, w, 3) LR image -> (B, h, w, width) features."""
        return self.stem.module(shared[: self.stem.size])(lr)

    def apply_head(self, shared: jax.Array, h: jax.Array, lr: jax.Array) -> jax.Array:
        """Features (B, h, w, width) and the LR input -> SR image (B, r h, r w, 3)."""
        return self.head.module(shared[self.stem.size :])(h, lr)

    def forward(
        self, blocks: jax.Array, shared: jax.Array, choices: jax.Array, lr: jax.Array
    ) -> jax.Array:
        """Whole subnet: ``blocks`` (L, C, P), ``choices`` (L,) -> SR image (B, r h, r w, 3)."""
        chosen = jnp.take_along_axis(blocks, choices[:, None, None], axis=1)[:, 0]
        h = self.apply_layers(chosen, choices, self.apply_stem(shared, lr))
        return self.apply_head(shared, h, lr)

    def check_patch(self, lr_side: int) -> None:
        """Raise unless an LR patch side ``lr_side`` (pixels) fits the attention windows."""
        ws = self.config.window_size
        if lr_side % ws:
            raise ValueError(
                f"LR patch side {lr_side} is not a multiple of window_size={ws}; use an HR patch "
                f"of {ws * self.config.scale * max(1, lr_side // ws)} pixels"
            )


def l1_loss(sr: jax.Array, hr: jax.Array) -> jax.Array:
    """Mean absolute error, the SwinIR training loss: scalar."""
    return jnp.mean(jnp.abs(sr - hr))


def subnet_labels(config: SupernetConfig, choices: Sequence[int]) -> str:
    """Readable subnet description, e.g. ``conv3-mlp2-attn1``."""
    ops = config.ops
    return "-".join(ops[c].label for c in choices)
