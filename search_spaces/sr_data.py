"""Super-resolution data: real photographs, bicubic degradation, augmented patch batches.

Images are HxWx3 float32 arrays in [0, 1]. Without a data set on disk the photographs that ship
inside scikit-image are used (no download); `load_image_dir` reads any folder (DIV2K, Set5, ...).

Degradation: low-resolution images come from MATLAB-style ``imresize`` bicubic downscaling
(Keys cubic, a = -0.5, antialiased: the kernel is widened by the scale when shrinking, symmetric
border), the standard in SR benchmarks and SwinIR's training data. `bicubic_upscale` is the same
interpolation upward and gives the bicubic baseline.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "PatchSampler",
    "bicubic_downscale",
    "bicubic_upscale",
    "bundled_images",
    "bundled_test_images",
    "default_split",
    "imresize",
    "load_image_dir",
]

_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"}

#: Colour photographs shipped inside scikit-image: `skimage.data` loader names, except
#: "motorcycle_left", the left view of `skimage.data.stereo_motorcycle()`.
BUNDLED_TRAIN = ("astronaut", "coffee", "hubble_deep_field", "immunohistochemistry",
                 "motorcycle_left", "retina")
BUNDLED_EVAL = ("chelsea", "rocket")
#: Photographs for the test of a study's best model (`SRTask.test`): grey, so their Y channel is
#: all there is, and neither trained on nor used to choose a trial.
BUNDLED_TEST = ("camera", "coins")


#: PIL's modes of 16-bit grey images (a 16-bit PNG opens as "I;16" or as 32-bit "I").
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


def _to_float_rgb(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.shape[-1] == 4:
        arr = arr[..., :3]
    if arr.dtype == np.uint8:
        out = arr.astype(np.float32) / 255.0
    elif arr.dtype == np.uint16:
        out = arr.astype(np.float32) / 65535.0
    else:
        out = np.clip(arr.astype(np.float32), 0.0, 1.0)
    return np.ascontiguousarray(out)


def _bundled(name: str) -> np.ndarray:
    from skimage import data

    if name == "motorcycle_left":
        # One view of the stereo pair; the right view is nearly the same photograph.
        return data.stereo_motorcycle()[0]
    return getattr(data, name)()


def bundled_images(names: Sequence[str] = BUNDLED_TRAIN + BUNDLED_EVAL) -> list[np.ndarray]:
    """The named scikit-image photographs as HxWx3 float32 in [0, 1] (shipped, no download)."""
    return [_to_float_rgb(_bundled(n)) for n in names]


def load_image_dir(path: str | Path, min_size: int | None = None,
                   needs: str = "the training patch") -> list[np.ndarray]:
    """Every image file in folder ``path`` (sorted by name) as HxWx3 float32 in [0, 1].

    Grey images are repeated to 3 channels and alpha is dropped. Raises ``ValueError`` naming
    the file for a file that is not a readable image, or (``min_size``, pixels) an image whose
    shorter side is smaller than ``min_size`` (what ``needs`` that size, for the message).
    """
    from PIL import Image, UnidentifiedImageError

    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"image folder {str(folder)!r} is a file; pass the directory "
                                 "that holds the images")
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {str(folder)!r} does not exist; pass a directory")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES)
    if not files:
        raise ValueError(
            f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) in {str(folder)!r}; pass a "
            "folder that holds some, or leave the flag out for the built-in images"
        )
    images = []
    for f in files:
        try:
            with Image.open(f) as im:
                if im.mode in _SIXTEEN_BIT_MODES:  # convert("RGB") would clip them to 255
                    samples = np.clip(np.asarray(im), 0, 65535).astype(np.uint16)
                    images.append(_to_float_rgb(samples))
                else:
                    images.append(_to_float_rgb(np.asarray(im.convert("RGB"))))
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(
                f"{str(f)!r} is not a readable image ({type(err).__name__}: {err}); remove it "
                f"from {str(folder)!r} or convert it to PNG"
            ) from None
        height, width = images[-1].shape[:2]
        if min_size is not None and min(height, width) < min_size:
            raise ValueError(
                f"{str(f)!r} is {height}x{width} pixels, smaller than the {min_size} pixels "
                f"{needs} needs; remove it from {str(folder)!r} or use larger images"
            )
    return images


def default_split() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(train, eval) bundled photographs: 6 for training, 2 held out (chelsea, rocket)."""
    return bundled_images(BUNDLED_TRAIN), bundled_images(BUNDLED_EVAL)


def bundled_test_images() -> list[np.ndarray]:
    """The bundled photographs a study's best model is tested on (camera, coins): in neither
    set of `default_split`."""
    return bundled_images(BUNDLED_TEST)


def _cubic(x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    ax2, ax3 = ax * ax, ax * ax * ax
    return (1.5 * ax3 - 2.5 * ax2 + 1.0) * (ax <= 1) + (
        -0.5 * ax3 + 2.5 * ax2 - 4.0 * ax + 2.0
    ) * ((ax > 1) & (ax <= 2))


def _resize_taps(in_len: int, out_len: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Input indices and weights, each (out_len, taps), of MATLAB's bicubic ``imresize`` on one
    axis: output pixel o is ``sum_t weights[o, t] * input[indices[o, t]]``."""
    shrink = scale < 1
    width = 4.0 / scale if shrink else 4.0
    x = np.arange(1, out_len + 1, dtype=np.float64)
    u = x / scale + 0.5 * (1.0 - 1.0 / scale)  # output pixel centre in input coordinates (1-based)
    left = np.floor(u - width / 2.0)
    taps = int(math.ceil(width)) + 2
    idx = left[:, None] + np.arange(taps)[None, :]
    dist = u[:, None] - idx
    w = scale * _cubic(scale * dist) if shrink else _cubic(dist)
    w = w / w.sum(axis=1, keepdims=True)
    # Symmetric (mirror) padding, as MATLAB: index i outside [1, n] reflects, edge repeated.
    mirror = np.concatenate([np.arange(in_len), np.arange(in_len)[::-1]])
    cols = mirror[np.mod(idx.astype(np.int64) - 1, 2 * in_len)]
    return cols, w


def _resize_axis(img: np.ndarray, out_len: int, scale: float, axis: int) -> np.ndarray:
    cols, w = _resize_taps(img.shape[axis], out_len, scale)
    moved = np.moveaxis(img, axis, 0)
    out = np.zeros((out_len,) + moved.shape[1:], np.float64)
    expand = (slice(None),) + (None,) * (moved.ndim - 1)
    for t in range(cols.shape[1]):
        out += w[:, t][expand] * moved[cols[:, t]]
    return np.moveaxis(out, 0, axis)


def imresize(img: np.ndarray, scale: float, *, clip: bool = True) -> np.ndarray:
    """MATLAB-compatible bicubic resize of ``img`` (H, W, C) by ``scale``.

    Output (ceil(H * scale), ceil(W * scale), C) float32, antialiased when shrinking, clipped to
    [0, 1] unless ``clip=False``.
    """
    img = np.asarray(img, np.float64)
    if img.ndim != 3:
        raise ValueError(f"imresize expects (H, W, C), got shape {img.shape}")
    if scale <= 0:
        raise ValueError(f"{scale=} must be positive")
    h, w = img.shape[:2]
    oh, ow = int(math.ceil(h * scale - 1e-9)), int(math.ceil(w * scale - 1e-9))
    out = _resize_axis(_resize_axis(img, oh, scale, 0), ow, scale, 1)
    if clip:
        out = np.clip(out, 0.0, 1.0)
    return out.astype(np.float32)


def _check_scale(scale: int) -> None:
    if not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"{scale=} must be a positive integer SR factor (2, 3, 4, ...)")


def crop_to_multiple(img: np.ndarray, scale: int) -> np.ndarray:
    """Crop the bottom/right of ``img`` so H and W are multiples of ``scale`` (pixels)."""
    h, w = img.shape[0] - img.shape[0] % scale, img.shape[1] - img.shape[1] % scale
    return img[:h, :w]


def bicubic_downscale(img: np.ndarray, scale: int) -> np.ndarray:
    """LR image of HR ``img`` (H, W, C): (H // scale, W // scale, C) float32, antialiased bicubic.

    ``img`` is first cropped to a multiple of ``scale``.
    """
    _check_scale(scale)
    return imresize(crop_to_multiple(img, scale), 1.0 / scale)


def bicubic_upscale(img: np.ndarray, scale: int) -> np.ndarray:
    """Bicubic upscaling (H, W, C) -> (H * scale, W * scale, C): the SR baseline."""
    _check_scale(scale)
    return imresize(img, float(scale))


def _as_rgb(img: Any, index: int) -> np.ndarray:
    """Image ``index`` as float32 (H, W, 3): a grey one ((H, W) or (H, W, 1)) with its channel
    repeated; any other shape is refused."""
    img = np.asarray(img, np.float32)
    if img.ndim == 2:
        img = img[:, :, None]
    if img.ndim != 3 or img.shape[2] not in (1, 3):
        raise ValueError(f"image {index} has shape {img.shape}; PatchSampler takes RGB images "
                         "(H, W, 3) or grey ones (H, W) / (H, W, 1)")
    return np.repeat(img, 3, axis=2) if img.shape[2] == 1 else img


class PatchSampler:
    """Random aligned (LR, HR) training patches with the 8 dihedral augmentations.

    Every image's LR version is made once (`bicubic_downscale`); a patch is an HR crop of
    ``hr_patch`` pixels at a position aligned to ``scale`` and the matching LR crop of
    ``hr_patch // scale``, then one of the 8 flips/rotations applied to both.

    Args:
      images: HR images (H, W, 3) float32 in [0, 1], each at least ``hr_patch`` on both sides
        (a grey image, (H, W) or (H, W, 1), is taken as RGB with three equal channels).
      scale: SR factor; ``hr_patch`` must be a multiple of it.
      hr_patch: HR patch side in pixels.
      seed: seed of the sampler's generator (same seed, same stream of batches).
    """

    def __init__(self, images: Sequence[np.ndarray], scale: int, hr_patch: int, seed: int = 0):
        _check_scale(scale)
        if hr_patch % scale:
            raise ValueError(
                f"{hr_patch=} must be a multiple of {scale=}; "
                f"use {hr_patch // scale * scale or scale}"
            )
        if not images:
            raise ValueError("PatchSampler needs at least one image")
        self.scale, self.hr_patch, self.lr_patch = scale, hr_patch, hr_patch // scale
        self.hr = [crop_to_multiple(_as_rgb(im, i), scale) for i, im in enumerate(images)]
        for i, im in enumerate(self.hr):
            if min(im.shape[:2]) < hr_patch:
                raise ValueError(
                    f"image {i} is {im.shape[0]}x{im.shape[1]}, smaller than {hr_patch=}; "
                    "use a smaller patch or drop the image"
                )
        self.lr = [np.ascontiguousarray(bicubic_downscale(im, scale)) for im in self.hr]
        self.hr = [np.ascontiguousarray(im) for im in self.hr]
        # Sample images in proportion to their area, so every pixel is equally likely.
        area = np.array([im.shape[0] * im.shape[1] for im in self.hr], np.float64)
        self._p = area / area.sum()
        self._rng = np.random.default_rng(seed)
        # Where a patch may start in each image: LR rows, columns.
        self._starts = np.array([(im.shape[0] - self.lr_patch + 1, im.shape[1] - self.lr_patch + 1)
                                 for im in self.lr], np.int64)

    def batch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` patches: LR (n, p, p, 3) and HR (n, p * scale, p * scale, 3) float32.

        Per patch: its image (in proportion to area), its row and column, its symmetry, drawn
        in that order from the sampler's generator (one ``integers`` call with a bound per
        draw gives what as many scalar calls would, and leaves the generator where they would:
        `tests/test_sr_data.py` holds it to a loop of scalar calls); the copies are made for
        all patches of one image and symmetry at once, in a large batch on the host's cores
        (they write apart: the same bytes in any order).
        """
        lp, s, rng = self.lr_patch, self.scale, self._rng
        picks = rng.choice(len(self.hr), size=n, p=self._p)
        bounds = np.empty((n, 3), np.int64)
        bounds[:, :2] = self._starts[picks]
        bounds[:, 2] = 8
        ys, xs, ts = rng.integers(0, bounds).T
        lr_out = np.empty((n, lp, lp, 3), np.float32)
        hr_out = np.empty((n, lp * s, lp * s, 3), np.float32)
        copies = []
        for i in np.unique(picks):
            mine = picks == i
            # views of every patch, made here (not kept: a copy or pickle of the sampler would
            # write each window out in full)
            lr_patches, hr_patches = _patches(self.lr[i], lp), _patches(self.hr[i], lp * s)
            for t in np.unique(ts[mine]):
                at = np.flatnonzero(mine & (ts == t))
                y, x = ys[at], xs[at]
                copies.append((lr_out, at, lr_patches, (y, x * 3), int(t)))
                copies.append((hr_out, at, hr_patches, (y * s, x * s * 3), int(t)))
        if n >= _PATCHES_ON_THREADS:
            for done in [_copy_pool().submit(_place, *c) for c in copies]:
                done.result()
        else:
            for c in copies:
                _place(*c)
        return lr_out, hr_out


#: Patches of a batch from which its copies are spread over the host's cores (below it a
#: thread's hand-off costs more than the copies it takes over).
_PATCHES_ON_THREADS = 256
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    """The process's threads for patch copies, one per core it may run on: a pool of their
    own, since the threads that draw a fused group's batches (`scamp_jax.hpo.member_streams`)
    wait on these copies and would otherwise wait on themselves."""
    from scamp_jax.scheduling.host import host_cores

    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=host_cores(), thread_name_prefix="patch-copies")
        return _POOL


#: One RGB float32 pixel as a single item: symmetries move pixels, not channels.
_PIXEL = np.dtype((np.void, 12))


def _patches(img: np.ndarray, size: int) -> np.ndarray:
    """Every ``size`` x ``size`` patch of contiguous RGB ``img`` (H, W, 3) as a view (no copy),
    indexed ``[row, 3 * column]``: each is (size, 3 * size), its rows contiguous."""
    h, w, c = img.shape
    return np.lib.stride_tricks.sliding_window_view(img.reshape(h, w * c), (size, size * c))


def _place(out: np.ndarray, at: np.ndarray, patches: np.ndarray, where: tuple[np.ndarray, ...],
           t: int) -> None:
    """``out[at] = dihedral(patch, t)`` for each patch ``patches[where]`` (m, p, 3 * p; a view
    of every patch, `_patches`), gathered and turned in one copy of whole pixels each."""
    n, p = out.shape[0], out.shape[1]
    pixels = patches[where].view(_PIXEL)  # (m, p, p)
    turned = np.rot90(pixels, k=t // 2, axes=(1, 2))
    out.reshape(n, p, 3 * p).view(_PIXEL)[at] = turned[:, :, ::-1] if t % 2 else turned


def dihedral(img: np.ndarray, t: int) -> np.ndarray:
    """One of the 8 symmetries of the square on (H, W, C): ``t // 2`` quarter turns, then a
    horizontal flip when ``t`` is odd (t = 0 is the identity)."""
    out = np.rot90(img, k=t // 2, axes=(0, 1))
    if t % 2:
        out = out[:, ::-1]
    return out
