"""SwinIR (Liang et al., "SwinIR: Image Restoration Using Swin Transformer", ICCVW 2021), Flax NNX.

`SwinIR` takes the arguments, defaults and behaviour of the official PyTorch model
(``network_swinir.py``): shallow 3x3 convolution, residual Swin transformer blocks (RSTB) with
window attention, relative position bias and shifted windows, a convolution after every block
group and after the body, the four reconstruction heads (``'pixelshuffle'``,
``'pixelshuffledirect'``, ``'nearest+conv'``, ``''``), ``'1conv'``/``'3conv'``, the mean shift,
reflect padding of the input to a window multiple and cropping of the output. Images are NHWC
float32 in [0, 1] (PyTorch's are NCHW). `load_torch_state_dict` loads released PyTorch weights.

`space` is the hyperparameter search space used by ``experiments.swinir_hpo``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from scamp_jax.space import Config, SearchSpace
from search_spaces.swin_blocks import (
    RSTB,
    BasicLayer,
    Mlp,
    PatchEmbed,
    PixelShuffle,
    StochasticDepth,
    SwinTransformerBlock,
    WindowAttention,
    conv2d,
    drop_branch,
    effective_window,
    layer_norm,
    leaky_relu_001,
    leaky_relu_02,
    patch_unembed,
    pixel_shuffle,
    relative_position_index,
    residual_conv,
    shift_attention_mask,
    trunc_normal_init,
    window_partition,
    window_reverse,
)

__all__ = [
    "RSTB",
    "BasicLayer",
    "Mlp",
    "PatchEmbed",
    "PixelShuffle",
    "StochasticDepth",
    "SwinIR",
    "SwinTransformerBlock",
    "WindowAttention",
    "count_params",
    "drop_branch",
    "effective_window",
    "load_torch_state_dict",
    "pixel_shuffle",
    "qkv_to_heads_major",
    "qkv_to_official",
    "relative_position_index",
    "shift_attention_mask",
    "space",
    "window_partition",
    "window_reverse",
]

UPSAMPLERS = ("pixelshuffle", "pixelshuffledirect", "nearest+conv", "")
RGB_MEAN = (0.4488, 0.4371, 0.4040)  # DIV2K mean the official model subtracts for RGB input
NUM_FEAT = 64  # feature width of the 'pixelshuffle' and 'nearest+conv' heads (fixed upstream)


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


def _nearest_up2(x: jax.Array) -> jax.Array:
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def _upsample_pixelshuffle(scale: int, num_feat: int, rngs: nnx.Rngs) -> nnx.Sequential:
    # Same layer indices as the official nn.Sequential: convs at even positions.
    layers: list[Any] = []
    if scale & (scale - 1) == 0:
        for _ in range(int(math.log2(scale))):
            layers += [conv2d(num_feat, 4 * num_feat, 3, rngs=rngs),
                       PixelShuffle(2)]
    elif scale == 3:
        layers += [conv2d(num_feat, 9 * num_feat, 3, rngs=rngs),
                   PixelShuffle(3)]
    else:
        raise ValueError(
            f"upscale={scale} is not supported by upsampler='pixelshuffle'; use 2, 3, 4 or 8"
        )
    return nnx.Sequential(*layers)


class SwinIR(nnx.Module):
    """SwinIR image restoration / super-resolution network.

    Call: ``model(x)`` with x (B, H, W, in_chans) float32 in [0, 1] (any H, W) returns
    (B, H * upscale, W * upscale, in_chans) for the SR heads. With ``upsampler=''`` the output is
    the restored (B, Hp, Wp, in_chans) map cropped to ``H * upscale`` (as upstream, so use
    ``upscale=1`` there to get (B, H, W, C)). Hp, Wp are H, W reflect-padded up to a multiple of
    ``window_size``.

    Arguments are those of the official model. ``img_size // patch_size`` is the resolution the
    blocks are built for: when it is not larger than ``window_size`` the blocks use one window
    of that size without shift (the padding still uses ``window_size``). ``ape`` needs inputs
    whose padded size equals ``img_size``. ``drop_path_rate`` grows linearly over the blocks
    from 0; all dropouts act only in ``model.train()`` mode, ``model.eval()`` is deterministic.
    """

    def __init__(
        self,
        *,
        img_size: int | Sequence[int] = 64,
        patch_size: int | Sequence[int] = 1,
        in_chans: int = 3,
        embed_dim: int = 96,
        depths: Sequence[int] = (6, 6, 6, 6),
        num_heads: Sequence[int] = (6, 6, 6, 6),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        ape: bool = False,
        patch_norm: bool = True,
        upscale: int = 2,
        img_range: float = 1.0,
        upsampler: str = "",
        resi_connection: str = "1conv",
        rngs: nnx.Rngs,
    ):
        depths, num_heads = tuple(int(d) for d in depths), tuple(int(h) for h in num_heads)
        if len(depths) != len(num_heads):
            raise ValueError(
                f"{depths=} and {num_heads=} must have one entry per residual group each"
            )
        if upsampler not in UPSAMPLERS:
            raise ValueError(f"{upsampler=} is not one of {UPSAMPLERS}")
        if resi_connection not in ("1conv", "3conv"):
            raise ValueError(f"{resi_connection=} is not supported; use '1conv' or '3conv'")
        if upsampler == "nearest+conv" and upscale != 4:
            raise ValueError(f"upsampler='nearest+conv' only supports upscale=4, got {upscale=}")
        if window_size < 1 or upscale < 1:
            raise ValueError(f"{window_size=} and {upscale=} must be positive")
        for h in num_heads:
            if embed_dim % h:
                raise ValueError(f"{embed_dim=} is not divisible by num_heads {h}; pick a divisor")
        img_hw, patch_hw = _pair(img_size), _pair(patch_size)
        resolution = (img_hw[0] // patch_hw[0], img_hw[1] // patch_hw[1])
        self.in_chans, self.embed_dim = in_chans, embed_dim
        self.window_size, self.upscale, self.upsampler = window_size, upscale, upsampler
        self.img_range, self.ape = img_range, ape
        self.patches_resolution = resolution
        self.mean = np.asarray(RGB_MEAN if in_chans == 3 else (0.0,) * in_chans, np.float32)

        self.conv_first = conv2d(in_chans, embed_dim, 3, rngs=rngs)
        self.patch_embed = PatchEmbed(embed_dim, norm=patch_norm, rngs=rngs)
        if ape:
            self.absolute_pos_embed = nnx.Param(
                trunc_normal_init(0.02)(
                    rngs.params(), (1, resolution[0] * resolution[1], embed_dim), jnp.float32
                )
            )
        self.pos_drop = nnx.Dropout(drop_rate, rngs=rngs) if drop_rate > 0 else None
        dpr = np.linspace(0.0, drop_path_rate, sum(depths)).tolist()
        starts = np.cumsum((0,) + depths).tolist()
        self.layers = nnx.List(
            [
                RSTB(
                    embed_dim,
                    resolution,
                    depths[i],
                    num_heads[i],
                    window_size,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    qk_scale=qk_scale,
                    drop=drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=dpr[starts[i] : starts[i + 1]],
                    resi_connection=resi_connection,
                    rngs=rngs,
                )
                for i in range(len(depths))
            ]
        )
        self.norm = layer_norm(embed_dim, rngs=rngs)
        self.conv_after_body = residual_conv(embed_dim, resi_connection, rngs=rngs)

        if upsampler == "pixelshuffle":
            self.conv_before_upsample = nnx.Sequential(
                conv2d(embed_dim, NUM_FEAT, 3, rngs=rngs), leaky_relu_001
            )
            self.upsample = _upsample_pixelshuffle(upscale, NUM_FEAT, rngs)
            self.conv_last = conv2d(NUM_FEAT, in_chans, 3, rngs=rngs)
        elif upsampler == "pixelshuffledirect":
            self.upsample = nnx.Sequential(
                conv2d(embed_dim, upscale * upscale * in_chans, 3, rngs=rngs),
                PixelShuffle(upscale),
            )
        elif upsampler == "nearest+conv":
            self.conv_before_upsample = nnx.Sequential(
                conv2d(embed_dim, NUM_FEAT, 3, rngs=rngs), leaky_relu_001
            )
            self.conv_up1 = conv2d(NUM_FEAT, NUM_FEAT, 3, rngs=rngs)
            self.conv_up2 = conv2d(NUM_FEAT, NUM_FEAT, 3, rngs=rngs)
            self.conv_hr = conv2d(NUM_FEAT, NUM_FEAT, 3, rngs=rngs)
            self.conv_last = conv2d(NUM_FEAT, in_chans, 3, rngs=rngs)
        else:
            self.conv_last = conv2d(embed_dim, in_chans, 3, rngs=rngs)
        # Every block's two residual branches drawn at once (see StochasticDepth). Built last:
        # its stream is forked from ``rngs`` after every weight is drawn, so the initial
        # weights do not depend on the stochastic-depth rate.
        self.stochastic_depth = StochasticDepth(
            [r for layer in self.layers for r in layer.branch_rates()], rngs=rngs
        )

    def padded_size(self, h: int, w: int) -> tuple[int, int]:
        """(H, W) after reflect padding to a multiple of ``window_size`` (pixels)."""
        ws = self.window_size
        return h + (-h) % ws, w + (-w) % ws

    def _check_blocks(self, hp: int, wp: int) -> None:
        for layer in self.layers:
            for blk in layer.residual_group.blocks:
                if hp % blk.window_size or wp % blk.window_size:
                    raise ValueError(
                        f"padded input {hp}x{wp} is not a multiple of the block window "
                        f"{blk.window_size} (img_size gives resolution {self.patches_resolution}"
                        f" <= window_size={self.window_size}, so blocks use one window of that "
                        "size); build with img_size equal to the input size or a multiple of "
                        "window_size"
                    )
        if self.ape and (hp, wp) != tuple(self.patches_resolution):
            raise ValueError(
                f"ape=True needs inputs of padded size {tuple(self.patches_resolution)}, got "
                f"{hp}x{wp}; build the model with img_size={(hp, wp)}"
            )

    def forward_features(self, x: jax.Array) -> jax.Array:
        """Deep features of the body: (B, H, W, C) -> (B, H, W, C), H, W window multiples."""
        x_size = (x.shape[1], x.shape[2])
        x = self.patch_embed(x)
        if self.ape:
            x = x + self.absolute_pos_embed[...]
        if self.pos_drop is not None:
            x = self.pos_drop(x)
        drop = self.stochastic_depth(x.shape[0])
        start = 0
        for layer in self.layers:
            end = start + len(layer.branch_rates())
            x = layer(x, x_size, None if drop is None else drop[start:end])
            start = end
        return patch_unembed(self.norm(x), x_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        """(B, H, W, in_chans) in [0, 1] -> (B, H*upscale, W*upscale, in_chans), see the class."""
        if x.ndim != 4 or x.shape[-1] != self.in_chans:
            raise ValueError(
                f"expected NHWC input with {self.in_chans} channels, got shape {x.shape}; "
                "transpose NCHW arrays with x.transpose(0, 2, 3, 1)"
            )
        h, w = x.shape[1], x.shape[2]
        hp, wp = self.padded_size(h, w)
        self._check_blocks(hp, wp)
        if (hp, wp) != (h, w):
            x = jnp.pad(x, ((0, 0), (0, hp - h), (0, wp - w), (0, 0)), mode="reflect")
        mean = jnp.asarray(self.mean, x.dtype)
        x = (x - mean) * self.img_range

        if self.upsampler == "":
            first = self.conv_first(x)
            res = self.conv_after_body(self.forward_features(first)) + first
            x = x + self.conv_last(res)
        else:
            x = self.conv_first(x)
            x = self.conv_after_body(self.forward_features(x)) + x
            if self.upsampler == "pixelshuffle":
                x = self.conv_last(self.upsample(self.conv_before_upsample(x)))
            elif self.upsampler == "pixelshuffledirect":
                x = self.upsample(x)
            else:  # nearest+conv
                x = self.conv_before_upsample(x)
                x = leaky_relu_02(self.conv_up1(_nearest_up2(x)))
                x = leaky_relu_02(self.conv_up2(_nearest_up2(x)))
                x = self.conv_last(leaky_relu_02(self.conv_hr(x)))
        x = x / self.img_range + mean
        return x[:, : h * self.upscale, : w * self.upscale]


# --------------------------------------------------------------------------- weights


def count_params(model: nnx.Module, *, exclude_bias_tables: bool = False) -> int:
    """Number of trainable scalars in ``model`` (works on an `nnx.eval_shape` model).

    ``exclude_bias_tables`` leaves out the relative position bias tables, as the SwinIR paper's
    parameter counts do.
    """
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if exclude_bias_tables and path[-1] == "relative_position_bias_table":
            continue
        total += int(np.prod(var.shape))
    return total


_DERIVED_BUFFERS = ("relative_position_index", "attn_mask")


def _torch_names(model: nnx.Module) -> dict[str, tuple[nnx.Variable, str]]:
    """Map official PyTorch parameter names to this model's variables and their layer kind."""
    names: dict[str, tuple[nnx.Variable, str]] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        parts: list[str] = []
        node: Any = model
        parent: Any = model
        for seg in path:
            if isinstance(node, nnx.Sequential) and seg == "layers":
                node = node.layers  # torch's nn.Sequential indexes its children directly
                continue
            parts.append(str(seg))
            parent = node
            # a path's segments are ints (indices) and attribute names
            node = node[seg] if isinstance(seg, int) else getattr(node, cast(str, seg))
        leaf = parts[-1]
        if isinstance(parent, nnx.Conv):
            kind = "conv"
        elif isinstance(parent, nnx.LinearGeneral):
            kind = f"heads_{parts[-2]}"  # WindowAttention.qkv / .proj, stored by heads
        elif isinstance(parent, nnx.Linear):
            kind = "linear"
        else:
            kind = "plain"
        if leaf in ("kernel", "scale"):
            parts[-1] = "weight"
        names[".".join(parts)] = (var, kind)
    return names


def _to_flax_layout(
    value: np.ndarray, kind: str, name: str, shape: tuple[int, ...] = ()
) -> np.ndarray:
    """An official array in this model's layout; ``shape`` is the target variable's shape."""
    if kind == "conv" and name.endswith(".weight"):
        return value.transpose(2, 3, 1, 0)  # (O, I, kh, kw) -> (kh, kw, I, O)
    if kind == "linear" and name.endswith(".weight"):
        return value.T  # (O, I) -> (I, O)
    if kind == "heads_qkv":
        return qkv_to_heads_major(value, heads=shape[-2])
    if kind == "heads_proj" and name.endswith(".weight"):
        # (O, I) -> (I, O) -> (heads, hd, O): the input index is head * hd + d in both layouts.
        if value.ndim != 2 or value.shape[1] != shape[0] * shape[1]:
            raise ValueError(f"proj weight of shape {value.shape} is not (C, heads * hd = "
                             f"{shape[0] * shape[1]})")
        return value.T.reshape(shape)
    return value


def qkv_to_heads_major(value: np.ndarray, heads: int) -> np.ndarray:
    """Official fused qkv weight (3C, C) or bias (3C,) -> heads-major (C, heads, 3 * hd) or
    (heads, 3 * hd).

    The official rows are ordered [q | k | v], each split into ``heads`` blocks of ``hd``; here
    every head's q, k and v columns sit together, so a split of the heads axis keeps whole heads.
    """
    if value.ndim == 2:  # weight (3C, C) -> (C, 3, heads, hd) -> (C, heads, 3, hd)
        c = value.shape[1]
        if value.shape[0] != 3 * c or c % heads:
            raise ValueError(
                f"qkv weight of shape {value.shape} is not (3C, C) with C divisible by "
                f"{heads=}; build the model with the checkpoint's embed_dim and num_heads"
            )
        out = value.T.reshape(c, 3, heads, c // heads).transpose(0, 2, 1, 3)
        return out.reshape(c, heads, 3 * (c // heads))
    c3 = value.shape[0]
    if c3 % (3 * heads):
        raise ValueError(
            f"qkv bias of shape {value.shape} is not (3C,) with C divisible by {heads=}"
        )
    hd = c3 // 3 // heads
    return value.reshape(3, heads, hd).transpose(1, 0, 2).reshape(heads, 3 * hd)


def qkv_to_official(value: np.ndarray) -> np.ndarray:
    """Inverse of `qkv_to_heads_major`: (C, heads, 3 * hd) -> (3C, C); (heads, 3 * hd) -> (3C,)."""
    if value.ndim == 3:
        c, heads, hd3 = value.shape
        return value.reshape(c, heads, 3, hd3 // 3).transpose(0, 2, 1, 3).reshape(c, 3 * c).T
    heads, hd3 = value.shape
    return value.reshape(heads, 3, hd3 // 3).transpose(1, 0, 2).reshape(-1)


def load_torch_state_dict(model: SwinIR, state_dict: Mapping[str, Any]) -> None:
    """Load official PyTorch SwinIR weights into ``model`` in place.

    Args:
      model: a `SwinIR` built with the same architecture arguments as the checkpoint.
      state_dict: official parameter name -> array (numpy, or anything ``np.asarray`` takes, e.g.
        ``{k: v.numpy() for k, v in torch_model.state_dict().items()}``). A released checkpoint
        wrapped as ``{'params': ...}`` or ``{'params_ema': ...}`` is unwrapped (EMA preferred).
        Conv weights (O, I, kh, kw) and linear weights (O, I) are converted to Flax layouts, the
        fused ``attn.qkv`` weight and bias permuted heads-major (`qkv_to_heads_major`), the
        ``attn.proj`` weight reshaped to (heads, head_dim, C); the
        derived buffers ``relative_position_index`` and ``attn_mask`` are ignored.

    Raises:
      ValueError: listing every missing key, unexpected key and shape mismatch.
    """
    for wrapper in ("params_ema", "params"):
        if wrapper in state_dict and isinstance(state_dict[wrapper], Mapping):
            state_dict = state_dict[wrapper]
            break
    targets = _torch_names(model)
    given = {k: v for k, v in state_dict.items() if k.rsplit(".", 1)[-1] not in _DERIVED_BUFFERS}
    missing = sorted(set(targets) - set(given))
    unexpected = sorted(set(given) - set(targets))
    converted: dict[str, np.ndarray] = {}
    mismatched: list[str] = []
    for name in sorted(set(targets) & set(given)):
        var, kind = targets[name]
        try:
            arr = _to_flax_layout(np.asarray(given[name], dtype=np.float32), kind, name,
                                  tuple(var.shape))
        except ValueError as err:
            mismatched.append(f"{name}: {err}")
            continue
        if arr.shape != tuple(var.shape):
            mismatched.append(f"{name}: checkpoint {arr.shape} vs model {tuple(var.shape)}")
        converted[name] = arr
    if missing or unexpected or mismatched:
        raise ValueError(
            "state dict does not match the model (build SwinIR with the checkpoint's "
            "architecture arguments):\n"
            f"  missing keys ({len(missing)}): {missing}\n"
            f"  unexpected keys ({len(unexpected)}): {unexpected}\n"
            f"  shape mismatches ({len(mismatched)}, in Flax layout): {mismatched}"
        )
    for name, arr in converted.items():
        var = targets[name][0]
        var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))


# --------------------------------------------------------------------------- search space

_SMALL = {
    "embed_dim": (12, 24, 36, 48),
    "num_groups": (1, 2),
    "group_depth": (1, 2),
    "num_heads": (1, 2, 3, 4),
    "window_size": (4, 8),
    "mlp_ratio": (1.0, 2.0),
    # A few thousand training samples per trial: rates below ~1e-3 stay under bicubic that soon.
    "learning_rate": (1e-3, 2e-3, 5e-3),
}
_PAPER = {
    "embed_dim": (60, 96, 180),
    "num_groups": (4, 6),
    "group_depth": (4, 6),
    "num_heads": (6,),
    "window_size": (8,),
    "mlp_ratio": (2.0, 4.0),
    "learning_rate": (1e-4, 2e-4, 4e-4),
}


def build_from_config(
    config: Config, rngs: nnx.Rngs, *, scale: int = 2, img_size: int = 24,
    upsampler: str = "pixelshuffledirect", drop_path_rate: float = 0.0,
) -> SwinIR:
    """A `SwinIR` from a search-space configuration (training-only keys are ignored).

    ``num_groups`` residual groups of ``group_depth`` blocks each, ``num_heads`` in every group.
    Config keys ``upscale``, ``img_size``, ``upsampler`` override the keyword defaults.
    """
    groups, depth = int(config["num_groups"]), int(config["group_depth"])
    return SwinIR(
        img_size=int(config.get("img_size", img_size)),
        embed_dim=int(config["embed_dim"]),
        depths=(depth,) * groups,
        num_heads=(int(config["num_heads"]),) * groups,
        window_size=int(config["window_size"]),
        mlp_ratio=float(config["mlp_ratio"]),
        drop_path_rate=drop_path_rate,
        upscale=int(config.get("upscale", scale)),
        upsampler=str(config.get("upsampler", upsampler)),
        resi_connection="1conv",
        rngs=rngs,
    )


def space(variant: str = "small", *, scale: int = 2, hr_patch: int = 48) -> SearchSpace:
    """SwinIR hyperparameter search space.

    Keys: ``embed_dim``, ``num_groups`` and ``group_depth`` (depths = group_depth repeated
    num_groups times), ``num_heads`` (every group), ``window_size``, ``mlp_ratio`` and
    ``learning_rate`` (log-uniform). ``"small"`` is sized for a CPU study of a few hundred
    steps per trial (lightweight head, no stochastic depth so short runs converge);
    ``"paper"`` spans the paper's models (lightweight 60-wide to classical 180-wide, windows of
    8, 'pixelshuffle' head for widths above 60). ``hr_patch // scale`` is the LR training patch
    the models are built for (``img_size``).
    """
    if variant not in ("small", "paper"):
        raise ValueError(f"{variant=} is not a SwinIR space; use 'small' or 'paper'")
    if hr_patch % scale:
        raise ValueError(f"{hr_patch=} must be a multiple of {scale=}")
    table = _SMALL if variant == "small" else _PAPER
    img_size = hr_patch // scale
    lr_low, lr_high = min(table["learning_rate"]), max(table["learning_rate"])

    def suggest(trial: Any) -> dict[str, Any]:
        cfg: dict[str, Any] = {}
        for key in ("embed_dim", "num_groups", "group_depth", "num_heads", "window_size",
                    "mlp_ratio"):
            cfg[key] = trial.suggest_categorical(key, list(table[key]))
        cfg["learning_rate"] = trial.suggest_float("learning_rate", lr_low, lr_high, log=True)
        return cfg

    def build(config: Config, rngs: nnx.Rngs) -> SwinIR:
        upsampler = "pixelshuffledirect" if int(config["embed_dim"]) <= 60 else "pixelshuffle"
        return build_from_config(
            config, rngs, scale=scale, img_size=img_size, upsampler=upsampler,
            drop_path_rate=0.0 if variant == "small" else 0.1,
        )

    largest = {k: max(v) for k, v in table.items()}
    return SearchSpace(
        name=f"swinir-{variant}",
        suggest=suggest,
        build=build,
        grid={k: list(v) for k, v in table.items()},
        largest=largest,
    )
