"""Super-resolution quality metrics as SwinIR reports them: PSNR and SSIM on the Y channel.

Images are HxWx3 (or NxHxWx3) float arrays in [0, 1]. As in SwinIR's evaluation, both images are
first quantised to 8 bits, converted to ITU-R BT.601 luma (Y in [16, 235]), and ``border`` pixels
(the scale factor) are cropped from every side before scoring. Computed on the host in float64.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

__all__ = ["psnr_y", "rgb_to_y", "ssim_y"]

_Y_WEIGHTS = np.array([65.481, 128.553, 24.966])  # BT.601 R, G, B coefficients for [0, 1] input


def rgb_to_y(img: np.ndarray) -> np.ndarray:
    """Luma of RGB ``img`` (..., 3) in [0, 1]: ``16 + 65.481 R + 128.553 G + 24.966 B``.

    Returns float64 (...) in [16, 235] (MATLAB's ``rgb2ycbcr`` Y, unrounded).
    """
    img = np.asarray(img, np.float64)
    if img.shape[-1] != 3:
        raise ValueError(f"rgb_to_y expects RGB images (..., 3), got shape {img.shape}")
    return img @ _Y_WEIGHTS + 16.0


def _prepare(sr: np.ndarray, hr: np.ndarray, border: int, quantize: bool) -> tuple:
    sr, hr = np.asarray(sr, np.float64), np.asarray(hr, np.float64)
    if sr.shape != hr.shape:
        raise ValueError(
            f"sr {sr.shape} and hr {hr.shape} differ; crop the HR image to the SR output first"
        )
    if sr.ndim == 3:
        sr, hr = sr[None], hr[None]
    if sr.ndim != 4:
        raise ValueError(f"expected HxWxC or NxHxWxC images, got shape {sr.shape}")
    if border < 0 or 2 * border >= min(sr.shape[1:3]):
        raise ValueError(f"{border=} leaves no pixels of a {sr.shape[1]}x{sr.shape[2]} image")
    if quantize:
        # SwinIR scores saved 8-bit images: round to 1/255 steps as its test script does.
        sr = np.round(np.clip(sr, 0.0, 1.0) * 255.0) / 255.0
        hr = np.round(np.clip(hr, 0.0, 1.0) * 255.0) / 255.0
    if sr.shape[-1] == 3:
        ys, yh = rgb_to_y(sr), rgb_to_y(hr)
    elif sr.shape[-1] == 1:
        ys, yh = sr[..., 0] * 255.0, hr[..., 0] * 255.0
    else:
        raise ValueError(f"expected 1 or 3 channels, got {sr.shape[-1]}")
    if border:
        ys = ys[:, border:-border, border:-border]
        yh = yh[:, border:-border, border:-border]
    return ys, yh


def psnr_y(sr: np.ndarray, hr: np.ndarray, border: int = 0, *, quantize: bool = True) -> float:
    """PSNR in dB on the Y channel (peak 255), averaged over images if batched.

    Args:
      sr, hr: (H, W, 3) or (N, H, W, 3) in [0, 1], same shape (1-channel images are used as is).
      border: pixels cropped from each side (SwinIR uses the scale factor).
      quantize: round to 8 bits first, as SwinIR's evaluation does.
    Returns:
      mean PSNR over the N images in dB (``inf`` for identical images).
    """
    ys, yh = _prepare(sr, hr, border, quantize)
    mse = ((ys - yh) ** 2).mean(axis=(1, 2))
    with np.errstate(divide="ignore"):
        values = 20.0 * np.log10(255.0 / np.sqrt(mse))
    return float(values.mean())


#: Side of SSIM's Gaussian window (pixels): the least an image has after its border crop.
SSIM_WINDOW = 11


def _gaussian_window(size: int = SSIM_WINDOW, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size) - (size - 1) / 2.0
    g = np.exp(-(x**2) / (2.0 * sigma**2))
    return g / g.sum()


def _filter_valid(img: np.ndarray, g: np.ndarray) -> np.ndarray:
    # Separable 11x11 Gaussian, keeping only positions where the window fits ('valid'), so the
    # border mode does not matter (SwinIR filters, then crops 5 pixels).
    out = ndimage.correlate1d(img, g, axis=0, mode="reflect")
    out = ndimage.correlate1d(out, g, axis=1, mode="reflect")
    r = len(g) // 2
    return out[r:-r, r:-r]


def _ssim_single(a: np.ndarray, b: np.ndarray) -> float:
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    g = _gaussian_window()
    mu_a, mu_b = _filter_valid(a, g), _filter_valid(b, g)
    var_a = _filter_valid(a * a, g) - mu_a**2
    var_b = _filter_valid(b * b, g) - mu_b**2
    cov = _filter_valid(a * b, g) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float((num / den).mean())


def ssim_y(sr: np.ndarray, hr: np.ndarray, border: int = 0, *, quantize: bool = True) -> float:
    """SSIM on the Y channel with an 11x11 Gaussian window (sigma 1.5), as in SwinIR's utils.

    Same arguments as `psnr_y`; the cropped images must be at least 11x11. Returns the mean
    SSIM over the N images (1.0 for identical images).
    """
    ys, yh = _prepare(sr, hr, border, quantize)
    if min(ys.shape[1:3]) < SSIM_WINDOW:
        raise ValueError(f"SSIM needs at least {SSIM_WINDOW}x{SSIM_WINDOW} pixels after the "
                         f"border crop, got {ys.shape}")
    return float(np.mean([_ssim_single(a, b) for a, b in zip(ys, yh, strict=True)]))
