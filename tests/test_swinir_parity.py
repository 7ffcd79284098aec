"""The Flax SwinIR computes the official PyTorch SwinIR's function, given the same weights.

The reference is the unmodified official ``network_swinir.py`` kept in ``tests/reference/`` (see
its README). It needs PyTorch (CPU), which ``scripts/setup.sh test`` installs.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from _requirements import require_module
from flax import nnx

from search_spaces import swinir as fx

torch = require_module(
    "torch", "PyTorch is the reference here: run `scripts/setup.sh test` to install it"
)

REFERENCE = Path(__file__).parent / "reference" / "network_swinir.py"


def _timm_stand_in() -> dict[str, types.ModuleType]:
    """The three names the reference imports from ``timm.models.layers``, without timm."""

    class DropPath(torch.nn.Module):
        def __init__(self, drop_prob: float = 0.0):
            super().__init__()
            self.drop_prob = drop_prob

        def forward(self, x):
            if not self.training or self.drop_prob == 0.0:
                return x
            keep = 1.0 - self.drop_prob
            mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
            return x * mask / keep

    def to_2tuple(v):
        return tuple(v) if isinstance(v, (tuple, list)) else (v, v)

    def trunc_normal_(t, std=1.0):
        return torch.nn.init.trunc_normal_(t, std=std)

    layers = types.ModuleType("timm.models.layers")
    layers.DropPath, layers.to_2tuple, layers.trunc_normal_ = DropPath, to_2tuple, trunc_normal_
    models = types.ModuleType("timm.models")
    models.layers = layers
    timm = types.ModuleType("timm")
    timm.models = models
    return {"timm": timm, "timm.models": models, "timm.models.layers": layers}


@pytest.fixture(scope="module")
def ref():
    """The official module, imported with the timm stand-in (sys.modules restored after)."""
    saved = {k: sys.modules.get(k) for k in ("timm", "timm.models", "timm.models.layers")}
    sys.modules.update(_timm_stand_in())
    try:
        spec = importlib.util.spec_from_file_location("_official_network_swinir", REFERENCE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def _build_torch(ref, **kw):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # torch.meshgrid without indexing= warns; the reference predates that argument.
        warnings.filterwarnings("ignore", message=".*meshgrid.*", category=UserWarning)
        model = ref.SwinIR(**kw)
    # Random values everywhere (biases, norms, bias tables) so every weight is exercised.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def _state_dict(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


TINY = dict(embed_dim=12, depths=(2,), num_heads=(3,), mlp_ratio=2.0)

CASES = {
    # name: (constructor kwargs, input H, input W); each compiles once, so the list stays short.
    "pixelshuffle-x2-two-groups-pad": (
        dict(upsampler="pixelshuffle", upscale=2, window_size=4, depths=(2, 2), num_heads=(2, 3)),
        12, 13),
    "pixelshuffle-x4-3conv": (
        dict(upsampler="pixelshuffle", upscale=4, window_size=4, resi_connection="3conv"), 8, 8),
    "pixelshuffle-x3": (dict(upsampler="pixelshuffle", upscale=3, window_size=4), 9, 7),
    "direct-x3-3conv-one-channel": (
        dict(upsampler="pixelshuffledirect", upscale=3, window_size=4, resi_connection="3conv",
             in_chans=1), 12, 13),
    "nearest-conv-x4": (dict(upsampler="nearest+conv", upscale=4, window_size=4), 9, 10),
    "denoise-x1": (dict(upsampler="", upscale=1, window_size=4), 12, 13),
    # Window larger than the input: padded to one 8x8 window, shifted blocks masked inside it.
    "window-above-input": (dict(upsampler="pixelshuffledirect", upscale=2, window_size=8), 5, 6),
    # Resolution not above the window: blocks collapse to one unshifted window of img_size.
    "window-collapse": (
        dict(upsampler="pixelshuffledirect", upscale=2, window_size=8, img_size=8), 6, 7),
    "ape-no-patch-norm-img-range": (
        dict(upsampler="pixelshuffle", upscale=2, window_size=4, img_size=8, ape=True,
             patch_norm=False, img_range=255.0), 8, 8),
}

#: Agreement required, relative to the output's magnitude: a few float32 ulps accumulated over
#: ~30 layers computed in a different order (XLA fusion vs PyTorch kernels).
RTOL_OF_MAX = 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_official(ref, name):
    kw, h, w = CASES[name]
    kw = {**TINY, **kw}
    tmodel = _build_torch(ref, **kw)
    model = fx.SwinIR(**kw, rngs=nnx.Rngs(0))
    fx.load_torch_state_dict(model, _state_dict(tmodel))
    model.eval()
    c = kw.get("in_chans", 3)
    x = np.random.default_rng(2).uniform(0, 1, (2, h, w, c)).astype(np.float32)
    with torch.no_grad():
        want = tmodel(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy().transpose(0, 2, 3, 1)
    got = np.asarray(nnx.jit(lambda m, v: m(v))(model, jnp.asarray(x)))
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=RTOL_OF_MAX)


def test_mask_and_index_match_official(ref):
    tmodel = _build_torch(
        ref, **TINY, window_size=4, img_size=16, upsampler="pixelshuffledirect"
    )
    blk = tmodel.layers[0].residual_group.blocks[1]
    assert blk.shift_size == 2
    np.testing.assert_array_equal(
        fx.relative_position_index(4), blk.attn.relative_position_index.numpy()
    )
    np.testing.assert_array_equal(fx.shift_attention_mask(16, 16, 4, 2), blk.attn_mask.numpy())
    np.testing.assert_array_equal(
        fx.shift_attention_mask(8, 12, 4, 2), blk.calculate_mask((8, 12)).numpy()
    )


def test_parameter_count_matches_official(ref):
    kw = dict(embed_dim=60, depths=(6, 6, 6, 6), num_heads=(6, 6, 6, 6), window_size=8,
              mlp_ratio=2.0, upsampler="pixelshuffledirect", img_size=64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*meshgrid.*", category=UserWarning)
        tmodel = ref.SwinIR(**kw)
    want = sum(p.numel() for p in tmodel.parameters())
    abstract = nnx.eval_shape(lambda: fx.SwinIR(**kw, rngs=nnx.Rngs(0)))
    assert fx.count_params(abstract) == want
