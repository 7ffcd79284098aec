"""Building blocks of SwinIR (Liang et al., ICCVW 2021) as Flax NNX modules, NHWC.

Window attention with a relative position bias, shifted windows with their attention mask, the
Swin transformer block and the residual Swin transformer block (RSTB). Every block keeps the
attribute names of the official PyTorch implementation (``attn.qkv``, ``norm1``, ``mlp.fc1``,
``residual_group.blocks``, ...) so that released weights map onto it name for name
(see `search_spaces.swinir.load_torch_state_dict`).

Numerics follow the official model: LayerNorm epsilon 1e-5, exact (erf) GELU, shift mask value
-100, a window that collapses to the whole input when the configured resolution is not larger than
the window, LeakyReLU 0.2 in the ``3conv`` residual connection. Stochastic depth is drawn once per
forward pass for every block (`StochasticDepth`) and handed down to the blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from search_spaces.softmax import softmax_derivative

#: Value added to the attention logits of token pairs from different image regions after the
#: cyclic shift (the official model uses -100, not -inf, so a fully masked row stays finite).
MASK_VALUE = -100.0

_LN_EPS = 1e-5  # torch.nn.LayerNorm default; Flax's default (1e-6) would break weight parity.


def trunc_normal_init(stddev: float = 0.02) -> nnx.Initializer:
    """Truncated-normal initialiser used for linear layers and bias tables (std ``stddev``)."""
    return nnx.initializers.truncated_normal(stddev=stddev)


def torch_conv_kernel_init() -> nnx.Initializer:
    """PyTorch's default Conv2d weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def _torch_conv_bias_init(fan_in: int) -> nnx.Initializer:
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: jax.Array, shape: Sequence[int], dtype: DTypeLike = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def conv2d(
    in_ch: int, out_ch: int, kernel: int, *, rngs: nnx.Rngs
) -> nnx.Conv:
    """A stride-1, 'same'-padded NHWC convolution initialised like ``torch.nn.Conv2d``.

    Kernel shape ``(kernel, kernel, in_ch, out_ch)``; zero padding ``kernel // 2`` on each side.
    """
    pad = kernel // 2
    return nnx.Conv(
        in_ch,
        out_ch,
        kernel_size=(kernel, kernel),
        padding=((pad, pad), (pad, pad)),
        kernel_init=torch_conv_kernel_init(),
        bias_init=_torch_conv_bias_init(in_ch * kernel * kernel),
        rngs=rngs,
    )


def linear(in_f: int, out_f: int, *, use_bias: bool = True, rngs: nnx.Rngs) -> nnx.Linear:
    """Dense layer initialised as in SwinIR: truncated normal (std 0.02) kernel, zero bias."""
    return nnx.Linear(
        in_f,
        out_f,
        use_bias=use_bias,
        kernel_init=trunc_normal_init(0.02),
        bias_init=nnx.initializers.zeros_init(),
        rngs=rngs,
    )


def layer_norm(dim: int, *, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm over the last axis with PyTorch's epsilon (1e-5)."""
    return nnx.LayerNorm(dim, epsilon=_LN_EPS, rngs=rngs)


def gelu(x: jax.Array) -> jax.Array:
    """Exact (erf) GELU, as ``torch.nn.GELU()``; JAX defaults to the tanh approximation."""
    return jax.nn.gelu(x, approximate=False)


def leaky_relu_02(x: jax.Array) -> jax.Array:
    """LeakyReLU with slope 0.2 (the ``3conv`` and ``nearest+conv`` activations)."""
    return jax.nn.leaky_relu(x, negative_slope=0.2)


def leaky_relu_001(x: jax.Array) -> jax.Array:
    """LeakyReLU with PyTorch's default slope 0.01 (before the upsampler)."""
    return jax.nn.leaky_relu(x, negative_slope=0.01)


def window_partition(x: jax.Array, window_size: int) -> jax.Array:
    """Cut ``x`` of shape (B, H, W, C) into windows (B * nW, ws, ws, C), row-major over windows.

    ``H`` and ``W`` must be multiples of ``window_size``; nW = (H / ws) * (W / ws).
    """
    b, h, w, c = x.shape
    if h % window_size or w % window_size:
        raise ValueError(
            f"feature map {h}x{w} is not a multiple of window_size={window_size}; pad the input "
            "to a window multiple first (SwinIR does this with reflect padding)"
        )
    x = x.reshape(b, h // window_size, window_size, w // window_size, window_size, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window_size, window_size, c)


def window_reverse(windows: jax.Array, window_size: int, h: int, w: int) -> jax.Array:
    """Inverse of `window_partition`: (B * nW, ws, ws, C) -> (B, H, W, C)."""
    n_win = (h // window_size) * (w // window_size)
    b = windows.shape[0] // n_win
    x = windows.reshape(b, h // window_size, w // window_size, window_size, window_size, -1)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, h, w, -1)


@functools.lru_cache(maxsize=64)
def relative_position_index(window_size: int) -> np.ndarray:
    """Index into the bias table for every token pair of a window: int (ws*ws, ws*ws).

    Token ``i`` at (yi, xi) and ``j`` at (yj, xj) use row
    ``(yi - yj + ws - 1) * (2 * ws - 1) + (xi - xj + ws - 1)`` of the (2ws-1)^2 x heads table.
    """
    coords = np.stack(np.meshgrid(np.arange(window_size), np.arange(window_size), indexing="ij"))
    flat = coords.reshape(2, -1)  # (2, N)
    rel = (flat[:, :, None] - flat[:, None, :]).transpose(1, 2, 0)  # (N, N, 2)
    rel = rel + (window_size - 1)
    index = rel[:, :, 0] * (2 * window_size - 1) + rel[:, :, 1]
    index.setflags(write=False)
    return index


@functools.lru_cache(maxsize=64)
def shift_attention_mask(h: int, w: int, window_size: int, shift_size: int) -> np.ndarray:
    """Attention mask of shifted windows: float32 (nW, ws*ws, ws*ws) of 0 or `MASK_VALUE`.

    After a cyclic shift by ``shift_size``, a window can hold tokens from up to four image regions
    that are not neighbours; pairs from different regions get `MASK_VALUE`. ``h`` and ``w`` are
    the (padded) feature-map size, multiples of ``window_size``; windows in row-major order.
    """
    if not 0 < shift_size < window_size:
        raise ValueError(f"{shift_size=} must be in (0, {window_size=}) for a shifted window")
    region = np.zeros((h, w), np.float32)
    bounds = (slice(0, -window_size), slice(-window_size, -shift_size), slice(-shift_size, None))
    label = 0
    for hs in bounds:
        for ws in bounds:
            region[hs, ws] = label
            label += 1
    win: np.ndarray = region.reshape(h // window_size, window_size, w // window_size, window_size)
    win = win.transpose(0, 2, 1, 3).reshape(-1, window_size * window_size)
    diff = win[:, None, :] - win[:, :, None]
    mask = np.where(diff != 0, MASK_VALUE, 0.0).astype(np.float32)
    mask.setflags(write=False)
    return mask


class StochasticDepth(nnx.Module):
    """Stochastic depth: per-sample drop of residual branches, every branch from one draw.

    Each residual branch ``i`` of a network (a SwinIR block has two: attention and MLP) is dropped
    for a sample with probability ``rates[i]`` and otherwise divided by ``1 - rates[i]``, as
    timm's ``DropPath`` in the official model does, one branch at a time. Here one random draw
    decides every branch. One ``nnx.Dropout`` per block, called for each of its two branches,
    puts two random draws per block into the compiled training step (70 for the paper's 36
    blocks, the first of rate 0), which doubled the step's compile time for a GPU (the paper
    SwinIR's for a V100, batch 8: 37.0 CPU s with them, 18.6 with one draw, 17.5 with none; on
    this project's CPU target at batch 2: 25.0, 20.0 and 9.6; ``benchmarks/notes/compiles.md``).

    Call: ``keep = stochastic_depth(batch)``: float32 (len(rates), batch), a kept branch's keep
    probability ``1 - rate`` for a sample and 0 for a dropped one (`drop_branch` applies it; a
    rate of 1 always drops its branch); None in evaluation mode (``model.eval()``) and when
    every rate is 0 (nothing to drop). Draws from the ``dropout`` stream of the ``rngs`` it was
    built with.
    """

    def __init__(self, rates: Sequence[float], *, rngs: nnx.Rngs):
        self.rates = tuple(float(r) for r in rates)
        for r in self.rates:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"stochastic depth rate {r} is not in [0, 1]")
        self.deterministic = False
        self.rngs = rngs["dropout"].fork() if any(self.rates) else None

    def __call__(self, batch: int) -> jax.Array | None:
        if self.deterministic or self.rngs is None:
            return None
        keep = 1.0 - np.asarray(self.rates, np.float32)[:, None]  # broadcast: a symbolic batch
        draw = jax.random.uniform(self.rngs(), (len(self.rates), batch), jnp.float32)
        return jnp.where(draw < keep, keep, np.float32(0.0))


def drop_branch(y: jax.Array, keep: jax.Array | None) -> jax.Array:
    """A residual branch ``y`` (B, ...) with `StochasticDepth`'s per-sample ``keep`` (B,) applied
    (None: kept whole): a sample's branch divided by its keep probability, or 0 where dropped.

    Divided inside a ``where``, as ``nnx.Dropout`` computes it: for a GPU that compiles cheaper
    than a multiplication by ``1 / keep`` or 0 (the paper SwinIR's step for a V100, batch 8:
    18.6 against 22.0 CPU s; ``benchmarks/notes/compiles.md``).
    """
    if keep is None:
        return y
    keep = keep.reshape((-1,) + (1,) * (y.ndim - 1))
    kept = keep > 0  # before any cast: a small keep probability may round to 0 in float16
    return jnp.where(kept, y / jnp.where(kept, keep, 1).astype(y.dtype), 0).astype(y.dtype)


class Mlp(nnx.Module):
    """Two-layer feed-forward block with exact GELU: (..., C) -> (..., C)."""

    def __init__(self, dim: int, hidden: int, *, drop: float = 0.0, rngs: nnx.Rngs):
        self.fc1 = linear(dim, hidden, rngs=rngs)
        self.fc2 = linear(hidden, dim, rngs=rngs)
        self.drop = nnx.Dropout(drop, rngs=rngs) if drop > 0 else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = gelu(self.fc1(x))
        if self.drop is not None:
            x = self.drop(x)
        x = self.fc2(x)
        if self.drop is not None:
            x = self.drop(x)
        return x


class WindowAttention(nnx.Module):
    """Multi-head self-attention inside square windows with a learned relative position bias.

    Args:
      dim: channels C (a multiple of ``num_heads``).
      window_size: window side ws; a window holds N = ws * ws tokens.
      num_heads: attention heads; the bias table is ((2ws-1)^2, num_heads).
      qkv_bias: learn a bias for the query/key/value projection (``qkv``, heads-major: kernel
        (C, num_heads, 3 * head_dim), bias (num_heads, 3 * head_dim)).
      qk_scale: logit scale; None uses head_dim ** -0.5.
      attn_drop, proj_drop: dropout rates on the attention weights and the output (training only).
    """

    def __init__(
        self,
        dim: int,
        window_size: int,
        num_heads: int,
        *,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        rngs: nnx.Rngs,
    ):
        if dim % num_heads:
            raise ValueError(
                f"{dim=} is not divisible by {num_heads=}; choose heads that divide the width"
            )
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        table_rows = (2 * window_size - 1) ** 2
        self.relative_position_bias_table = nnx.Param(
            trunc_normal_init(0.02)(rngs.params(), (table_rows, num_heads), jnp.float32)
        )
        # Fused query/key/value projection stored heads-major: kernel (C, heads, 3 * head_dim),
        # each head's [q | k | v] columns together, so splitting the heads axis over devices
        # keeps whole heads (the official (C, 3 * C) layout is [q heads | k heads | v heads];
        # `search_spaces.swinir.load_torch_state_dict` permutes released weights into this one).
        self.qkv = nnx.LinearGeneral(
            dim,
            (num_heads, 3 * (dim // num_heads)),
            use_bias=qkv_bias,
            kernel_init=trunc_normal_init(0.02),
            bias_init=nnx.initializers.zeros_init(),
            rngs=rngs,
        )
        # Output projection over (heads, head_dim): kernel (heads, head_dim, C), so it is split
        # on the heads axis like the qkv heads and attention needs no exchange between devices.
        self.proj = nnx.LinearGeneral(
            (num_heads, dim // num_heads),
            dim,
            axis=(-2, -1),
            kernel_init=trunc_normal_init(0.02),
            bias_init=nnx.initializers.zeros_init(),
            rngs=rngs,
        )
        self.attn_drop = nnx.Dropout(attn_drop, rngs=rngs) if attn_drop > 0 else None
        self.proj_drop = nnx.Dropout(proj_drop, rngs=rngs) if proj_drop > 0 else None
        #: the softmax keeps only its output for the backward pass (`search_spaces.softmax`)
        self.save_softmax_output = True

    def relative_position_bias(self) -> jax.Array:
        """Bias added to the logits: (num_heads, N, N)."""
        n = self.window_size**2
        idx = relative_position_index(self.window_size).reshape(-1)
        bias = self.relative_position_bias_table[...][idx].reshape(n, n, self.num_heads)
        return bias.transpose(2, 0, 1)

    def __call__(self, x: jax.Array, mask: jax.Array | np.ndarray | None = None) -> jax.Array:
        """Attend within each window.

        Args:
          x: (B * nW, N, C) window tokens, windows of one image contiguous.
          mask: None, or (nW, N, N) additive mask (0 / `MASK_VALUE`) for shifted windows.
        Returns:
          (B * nW, N, C).
        """
        bw, n, c = x.shape
        hd = c // self.num_heads
        qkv = self.qkv(x).reshape(bw, n, self.num_heads, 3, hd).transpose(3, 0, 2, 1, 4)
        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.swapaxes(-2, -1)  # (B*nW, heads, N, N)
        attn = attn + self.relative_position_bias()[None]
        if mask is not None:
            n_win = mask.shape[0]
            attn = attn.reshape(bw // n_win, n_win, self.num_heads, n, n)
            attn = attn + jnp.asarray(mask)[None, :, None]
            attn = attn.reshape(bw, self.num_heads, n, n)
        with softmax_derivative(self.save_softmax_output):
            attn = jax.nn.softmax(attn, axis=-1)
        if self.attn_drop is not None:
            attn = self.attn_drop(attn)
        x = self.proj((attn @ v).transpose(0, 2, 1, 3))  # (B*nW, N, heads, hd) -> (B*nW, N, C)
        if self.proj_drop is not None:
            x = self.proj_drop(x)
        return x


def effective_window(input_resolution: tuple[int, ...], window_size: int, shift_size: int):
    """(window, shift) a block really uses: the official model stops partitioning (one window
    of side min(resolution), no shift) when the configured resolution is not above the window."""
    if min(input_resolution) <= window_size:
        return min(input_resolution), 0
    return window_size, shift_size


class SwinTransformerBlock(nnx.Module):
    """Pre-norm transformer block on (shifted) windows with stochastic depth.

    Args:
      dim: channels C.
      input_resolution: (H, W) the block is built for (``img_size // patch_size``); decides the
        window collapse of `effective_window`. Other sizes run too (mask computed per size).
      num_heads, window_size, shift_size: attention heads, window side, cyclic shift (0 or ws/2).
      mlp_ratio: hidden width of the MLP relative to ``dim`` (``int(dim * mlp_ratio)``).
      drop, attn_drop: dropout rates; drop_path: stochastic-depth rate of both residual branches
        (kept as ``drop_path``; what is dropped comes with the call, drawn by the model's
        `StochasticDepth` from these rates: a block called without it, alone, drops nothing).
    """

    def __init__(
        self,
        dim: int,
        input_resolution: tuple[int, int],
        num_heads: int,
        *,
        window_size: int = 7,
        shift_size: int = 0,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.dim = dim
        self.input_resolution = tuple(input_resolution)
        self.window_size, self.shift_size = effective_window(
            self.input_resolution, window_size, shift_size
        )
        if not 0 <= self.shift_size < self.window_size:
            raise ValueError(f"shift_size={self.shift_size} must be in [0, {self.window_size})")
        self.norm1 = layer_norm(dim, rngs=rngs)
        self.attn = WindowAttention(
            dim,
            self.window_size,
            num_heads,
            qkv_bias=qkv_bias,
            qk_scale=qk_scale,
            attn_drop=attn_drop,
            proj_drop=drop,
            rngs=rngs,
        )
        if not 0.0 <= drop_path <= 1.0:
            raise ValueError(f"{drop_path=} is not a stochastic-depth rate in [0, 1]")
        self.drop_path = float(drop_path)
        self.norm2 = layer_norm(dim, rngs=rngs)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop, rngs=rngs)

    def __call__(self, x: jax.Array, x_size: tuple[int, int],
                 drop: jax.Array | None = None) -> jax.Array:
        """x: (B, H*W, C) tokens of an (H, W) = ``x_size`` map, H and W window multiples;
        ``drop``: None, or (2, B) `StochasticDepth` draws of the attention and MLP branches."""
        h, w = x_size
        b, _, c = x.shape
        ws, shift = self.window_size, self.shift_size
        y = self.norm1(x).reshape(b, h, w, c)
        if shift:
            y = jnp.roll(y, (-shift, -shift), axis=(1, 2))
        windows = window_partition(y, ws).reshape(-1, ws * ws, c)
        mask = shift_attention_mask(h, w, ws, shift) if shift else None
        windows = self.attn(windows, mask)
        y = window_reverse(windows.reshape(-1, ws, ws, c), ws, h, w)
        if shift:
            y = jnp.roll(y, (shift, shift), axis=(1, 2))
        attn_drop, mlp_drop = (None, None) if drop is None else (drop[0], drop[1])
        x = x + drop_branch(y.reshape(b, h * w, c), attn_drop)
        return x + drop_branch(self.mlp(self.norm2(x)), mlp_drop)


class BasicLayer(nnx.Module):
    """A stack of Swin blocks alternating regular and shifted windows (shift ws // 2)."""

    def __init__(
        self,
        dim: int,
        input_resolution: tuple[int, int],
        depth: int,
        num_heads: int,
        window_size: int,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: Sequence[float] | float = 0.0,
        rngs: nnx.Rngs,
    ):
        rates = list(drop_path) if isinstance(drop_path, Sequence) else [drop_path] * depth
        if len(rates) != depth:
            raise ValueError(f"{len(rates)} drop-path rates given for {depth=}; give one per block")
        self.blocks = nnx.List(
            [
                SwinTransformerBlock(
                    dim,
                    input_resolution,
                    num_heads,
                    window_size=window_size,
                    shift_size=0 if i % 2 == 0 else window_size // 2,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    qk_scale=qk_scale,
                    drop=drop,
                    attn_drop=attn_drop,
                    drop_path=rates[i],
                    rngs=rngs,
                )
                for i in range(depth)
            ]
        )

    def branch_rates(self) -> tuple[float, ...]:
        """Stochastic-depth rates of the blocks' residual branches, two per block in order."""
        return tuple(r for blk in self.blocks for r in (blk.drop_path, blk.drop_path))

    def __call__(self, x: jax.Array, x_size: tuple[int, int],
                 drop: jax.Array | None = None) -> jax.Array:
        """x: (B, H*W, C) -> (B, H*W, C); ``drop``: None, or `StochasticDepth` draws
        (2 * depth, B) in the order of `branch_rates`."""
        for i, blk in enumerate(self.blocks):
            x = blk(x, x_size, None if drop is None else drop[2 * i : 2 * i + 2])
        return x


def residual_conv(dim: int, kind: str, *, rngs: nnx.Rngs) -> nnx.Module:
    """The convolution closing a residual group: ``'1conv'`` (one 3x3) or ``'3conv'``
    (3x3 to dim/4, LeakyReLU 0.2, 1x1, LeakyReLU 0.2, 3x3 back to dim; fewer parameters)."""
    if kind == "1conv":
        return conv2d(dim, dim, 3, rngs=rngs)
    if kind == "3conv":
        if dim < 4:
            raise ValueError(f"resi_connection='3conv' needs embed_dim >= 4, got {dim}")
        q = dim // 4
        return nnx.Sequential(
            conv2d(dim, q, 3, rngs=rngs),
            leaky_relu_02,
            conv2d(q, q, 1, rngs=rngs),
            leaky_relu_02,
            conv2d(q, dim, 3, rngs=rngs),
        )
    raise ValueError(f"resi_connection={kind!r} is not supported; use '1conv' or '3conv'")


class RSTB(nnx.Module):
    """Residual Swin transformer block: Swin blocks, a convolution, and a skip connection.

    Tokens (B, H*W, C) in and out; the convolution runs on the (B, H, W, C) map.
    """

    def __init__(
        self,
        dim: int,
        input_resolution: tuple[int, int],
        depth: int,
        num_heads: int,
        window_size: int,
        *,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: Sequence[float] | float = 0.0,
        resi_connection: str = "1conv",
        rngs: nnx.Rngs,
    ):
        self.residual_group = BasicLayer(
            dim,
            input_resolution,
            depth,
            num_heads,
            window_size,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            qk_scale=qk_scale,
            drop=drop,
            attn_drop=attn_drop,
            drop_path=drop_path,
            rngs=rngs,
        )
        self.conv = residual_conv(dim, resi_connection, rngs=rngs)

    def branch_rates(self) -> tuple[float, ...]:
        """Stochastic-depth rates of its blocks' residual branches (`BasicLayer.branch_rates`)."""
        return self.residual_group.branch_rates()

    def __call__(self, x: jax.Array, x_size: tuple[int, int],
                 drop: jax.Array | None = None) -> jax.Array:
        """x: (B, H*W, C) with (H, W) = ``x_size`` -> (B, H*W, C); ``drop``: None, or
        `StochasticDepth` draws (2 * depth, B) in the order of `branch_rates`."""
        b, _, c = x.shape
        y = self.residual_group(x, x_size, drop).reshape(b, x_size[0], x_size[1], c)
        return self.conv(y).reshape(b, -1, c) + x


class PatchEmbed(nnx.Module):
    """(B, H, W, C) map -> (B, H*W, C) tokens, optionally layer-normed (SwinIR's patch size 1)."""

    def __init__(self, embed_dim: int, *, norm: bool, rngs: nnx.Rngs):
        self.norm = layer_norm(embed_dim, rngs=rngs) if norm else None

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        return x if self.norm is None else self.norm(x)


def patch_unembed(x: jax.Array, x_size: tuple[int, int]) -> jax.Array:
    """(B, H*W, C) tokens -> (B, H, W, C) map with (H, W) = ``x_size``."""
    return x.reshape(x.shape[0], x_size[0], x_size[1], x.shape[-1])


def pixel_shuffle(x: jax.Array, r: int) -> jax.Array:
    """NHWC depth-to-space matching ``torch.nn.PixelShuffle``: (N, H, W, C*r*r) -> (N, rH, rW, C).

    Input channel ``c * r * r + i * r + j`` becomes output pixel (r*h + i, r*w + j), channel c.
    """
    n, h, w, crr = x.shape
    c = crr // (r * r)
    x = x.reshape(n, h, w, c, r, r).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(n, h * r, w * r, c)


@dataclass(frozen=True)
class PixelShuffle:
    """`pixel_shuffle` by ``r`` as a layer of an ``nnx.Sequential``.

    A static attribute of the model: unlike a ``functools.partial`` (equal only to itself),
    two of them with the same ``r`` are equal, so two builds of one configuration have equal
    graph definitions and share what is compiled and cached for that architecture.
    """

    r: int

    def __call__(self, x: jax.Array) -> jax.Array:
        return pixel_shuffle(x, self.r)
