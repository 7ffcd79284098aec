"""PSNR / SSIM on the Y channel, as SwinIR reports them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _requirements import shared_data
from skimage.metrics import structural_similarity

from search_spaces import metrics, sr_data


def test_rgb_to_y_bt601_range():
    px = np.array([[0, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float64)
    np.testing.assert_allclose(
        metrics.rgb_to_y(px), [16.0, 235.0, 16 + 65.481, 16 + 128.553, 16 + 24.966]
    )
    with pytest.raises(ValueError, match="RGB"):
        metrics.rgb_to_y(np.zeros((4, 4, 2)))


def test_psnr_known_value_and_border():
    rng = np.random.default_rng(0)
    grey = np.round(rng.uniform(0.1, 0.9, (20, 24, 1)) * 255) / 255
    hr = np.repeat(grey, 3, axis=-1)
    sr = hr + 1.0 / 255.0  # every pixel one 8-bit level brighter: Y moves by 219/255
    want = 20 * math.log10(255.0 / (219.0 / 255.0))
    assert metrics.psnr_y(sr, hr, border=2) == pytest.approx(want, abs=1e-9)
    assert metrics.psnr_y(hr, hr) == math.inf
    edged = hr.copy()
    edged[:2] = 0.0  # differences only inside the cropped border
    assert metrics.psnr_y(edged, hr, border=2) == math.inf
    assert metrics.psnr_y(edged, hr, border=1) < 40
    batch = metrics.psnr_y(np.stack([sr, sr]), np.stack([hr, hr]), border=2)
    assert batch == pytest.approx(want, abs=1e-9)


def test_psnr_quantizes_like_saved_images():
    hr = np.full((16, 16, 3), 0.5)
    sr = hr + 0.001  # below half an 8-bit step: identical once saved
    assert metrics.psnr_y(sr, hr) == math.inf
    assert metrics.psnr_y(sr, hr, quantize=False) < math.inf


def test_ssim_matches_scikit_image_gaussian_ssim():
    rng = np.random.default_rng(1)
    hr = rng.uniform(size=(40, 36, 3))
    sr = np.clip(hr + rng.normal(scale=0.05, size=hr.shape), 0, 1)
    ours = metrics.ssim_y(sr, hr, border=3)
    ys = metrics.rgb_to_y(np.round(sr * 255) / 255)[3:-3, 3:-3]
    yh = metrics.rgb_to_y(np.round(hr * 255) / 255)[3:-3, 3:-3]
    ref = structural_similarity(
        ys, yh, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255.0
    )
    assert ours == pytest.approx(ref, abs=1e-9)
    assert metrics.ssim_y(hr, hr) == pytest.approx(1.0)


def test_metric_errors_name_the_problem():
    a = np.zeros((16, 16, 3))
    with pytest.raises(ValueError, match="differ"):
        metrics.psnr_y(a, np.zeros((16, 15, 3)))
    with pytest.raises(ValueError, match="border"):
        metrics.psnr_y(a, a, border=8)
    with pytest.raises(ValueError, match="11x11"):
        metrics.ssim_y(a, a, border=4)


def test_set5_bicubic_x2_baseline():
    """Bicubic x2 on Set5 (MATLAB-made LR, our upscaling): literature 33.66-33.69 dB."""
    set5 = shared_data("set5")
    hrs = sr_data.load_image_dir(set5 / "HR")
    lrs = sr_data.load_image_dir(set5 / "LR_bicubic_X2")
    psnr, ssim = [], []
    for hr, lr in zip(hrs, lrs, strict=True):
        hr = sr_data.crop_to_multiple(hr, 2)
        up = sr_data.bicubic_upscale(lr, 2)
        psnr.append(metrics.psnr_y(up, hr, border=2))
        ssim.append(metrics.ssim_y(up, hr, border=2))
    # Measured: 33.678 dB, SSIM 0.9304.
    assert np.mean(psnr) == pytest.approx(33.67, abs=0.03)
    assert np.mean(ssim) == pytest.approx(0.930, abs=0.002)
