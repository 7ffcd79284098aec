"""Super-resolution data: bundled photographs, folders, MATLAB-style bicubic, patch sampling."""

from __future__ import annotations

import numpy as np
import pytest
from _requirements import shared_data
from PIL import Image

from search_spaces import sr_data


def test_sixteen_bit_grey_pngs_keep_their_values(tmp_path):
    """A 16-bit grey PNG (PIL mode "I;16") is scaled by 65,535; PIL's conversion to RGB would
    clip every sample above 255 to white."""
    ramp = np.linspace(787, 64185, 6 * 7).reshape(6, 7).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "deep.png")  # uint16: mode "I;16"
    with Image.open(tmp_path / "deep.png") as im:
        assert im.mode in ("I;16", "I")  # what PIL makes of the file
    (image,) = sr_data.load_image_dir(tmp_path)
    assert image.shape == (6, 7, 3) and image.dtype == np.float32
    np.testing.assert_allclose(image[..., 0], ramp / 65535.0, rtol=1e-6)
    assert np.array_equal(image[..., 0], image[..., 2])


def test_default_split_is_real_disjoint_photos():
    train, held = sr_data.default_split()
    assert len(train) == 6 and len(held) == 2
    for im in train + held:
        assert im.ndim == 3 and im.shape[-1] == 3 and im.dtype == np.float32
        assert 0.0 <= im.min() and im.max() <= 1.0 and min(im.shape[:2]) >= 256
        assert im.std() > 0.05  # a photograph, not a flat image
    shapes = {im.shape for im in train}
    assert not shapes & {im.shape for im in held}
    # the best model's test photographs: grey (as RGB), in neither set
    test = sr_data.bundled_test_images()
    assert len(test) == 2 and not set(sr_data.BUNDLED_TEST) & set(
        sr_data.BUNDLED_TRAIN + sr_data.BUNDLED_EVAL)
    for im in test:
        assert im.shape[-1] == 3 and np.array_equal(im[..., 0], im[..., 2])
        assert min(im.shape[:2]) >= 256 and im.std() > 0.05
        assert not any(im.shape == other.shape and np.allclose(im, other)
                       for other in train + held)


def test_load_image_dir_reads_grey_rgba_and_sorts(tmp_path):
    Image.fromarray(np.full((5, 6), 255, np.uint8), "L").save(tmp_path / "b.png")
    rgba = np.zeros((4, 3, 4), np.uint8)
    rgba[..., 0] = 51
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    (tmp_path / "notes.txt").write_text("not an image")
    a, b = sr_data.load_image_dir(tmp_path)
    assert a.shape == (4, 3, 3) and np.allclose(a[..., 0], 0.2) and np.allclose(a[..., 1:], 0)
    assert b.shape == (5, 6, 3) and np.allclose(b, 1.0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sr_data.load_image_dir(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no images"):
        sr_data.load_image_dir(empty)


def test_imresize_shapes_constants_and_antialiasing():
    flat = np.full((10, 14, 3), 0.3, np.float32)
    np.testing.assert_allclose(sr_data.bicubic_downscale(flat, 2), 0.3, atol=1e-6)
    np.testing.assert_allclose(sr_data.bicubic_upscale(flat, 3), 0.3, atol=1e-6)
    assert sr_data.bicubic_downscale(np.zeros((11, 9, 3)), 2).shape == (5, 4, 3)
    assert sr_data.bicubic_upscale(np.zeros((5, 4, 3)), 4).shape == (20, 16, 3)
    # Stripes one pixel wide: antialiased shrinking averages them to grey (no aliasing).
    stripes = np.zeros((32, 32, 3), np.float32)
    stripes[:, ::2] = 1.0
    small = sr_data.bicubic_downscale(stripes, 2)
    np.testing.assert_allclose(small[4:-4, 4:-4], 0.5, atol=1e-6)
    with pytest.raises(ValueError, match="positive integer"):
        sr_data.bicubic_downscale(stripes, 0)


def test_downscale_matches_matlab_set5_lr():
    """Our degradation reproduces the MATLAB-made Set5 LR images to within 8-bit rounding."""
    set5 = shared_data("set5")
    hr = sr_data.load_image_dir(set5 / "HR")[0]
    lr = sr_data.load_image_dir(set5 / "LR_bicubic_X2")[0]
    ours = np.round(sr_data.bicubic_downscale(hr, 2) * 255)
    diff = np.abs(ours - np.round(lr * 255))
    assert ours.shape == lr.shape
    assert diff.max() <= 2 and diff.mean() < 0.2


def test_dihedral_gives_eight_distinct_views():
    img = np.arange(12, dtype=np.float32).reshape(3, 4, 1)
    views = [sr_data.dihedral(img, t) for t in range(8)]
    assert len({v.tobytes() + bytes(v.shape) for v in views}) == 8
    np.testing.assert_array_equal(views[0], img)


def test_patch_sampler_pairs_are_aligned_and_reproducible():
    rng = np.random.default_rng(0)
    images = [rng.uniform(size=(60, 70, 3)).astype(np.float32), np.zeros((40, 40, 3), np.float32)]
    sampler = sr_data.PatchSampler(images, scale=2, hr_patch=24, seed=3)
    lr, hr = sampler.batch(16)
    assert lr.shape == (16, 12, 12, 3) and hr.shape == (16, 24, 24, 3)
    # Away from the patch edge (kernel reach 2 LR pixels) the LR patch is the degraded HR patch,
    # whatever flip/rotation was drawn.
    for lo, hi in zip(lr, hr, strict=True):
        np.testing.assert_allclose(
            sr_data.bicubic_downscale(hi, 2)[2:-2, 2:-2], lo[2:-2, 2:-2], atol=1e-5
        )
    again = sr_data.PatchSampler(images, scale=2, hr_patch=24, seed=3).batch(16)
    np.testing.assert_array_equal(again[0], lr)
    with pytest.raises(ValueError, match="multiple of scale"):
        sr_data.PatchSampler(images, scale=3, hr_patch=20)
    with pytest.raises(ValueError, match="smaller than hr_patch"):
        sr_data.PatchSampler(images, scale=2, hr_patch=48)


def test_grey_images_are_sampled_as_rgb_and_other_shapes_refused():
    """A grey image, (H, W) or (H, W, 1), gives the patches of its RGB version with three equal
    channels; an image of two or four channels is refused with its index."""
    rng = np.random.default_rng(4)
    grey = rng.uniform(size=(40, 44)).astype(np.float32)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    want = sr_data.PatchSampler([rgb], scale=2, hr_patch=24, seed=1).batch(6)
    for form in (grey, grey[:, :, None]):
        got = sr_data.PatchSampler([form], scale=2, hr_patch=24, seed=1).batch(6)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
    for channels in (2, 4):
        with pytest.raises(ValueError, match=rf"image 1 has shape \(40, 44, {channels}\)"):
            sr_data.PatchSampler([rgb, np.zeros((40, 44, channels), np.float32)], 2, 24)


def _patches_one_at_a_time(sampler: sr_data.PatchSampler, n: int) -> tuple[np.ndarray, ...]:
    """Patches as a per-patch loop draws them: image, then row, column and symmetry of each
    patch with one scalar draw apiece (the reference `PatchSampler.batch` must equal)."""
    lp, s, rng = sampler.lr_patch, sampler.scale, sampler._rng
    lr_out = np.empty((n, lp, lp, 3), np.float32)
    hr_out = np.empty((n, lp * s, lp * s, 3), np.float32)
    for k, i in enumerate(rng.choice(len(sampler.hr), size=n, p=sampler._p)):
        lr = sampler.lr[i]
        y = int(rng.integers(0, lr.shape[0] - lp + 1))
        x = int(rng.integers(0, lr.shape[1] - lp + 1))
        t = int(rng.integers(0, 8))
        lr_out[k] = sr_data.dihedral(lr[y:y + lp, x:x + lp], t)
        hr_out[k] = sr_data.dihedral(sampler.hr[i][y * s:(y + lp) * s, x * s:(x + lp) * s], t)
    return lr_out, hr_out


def test_batches_equal_patches_drawn_one_at_a_time():
    """Batches of every size, one after another, are what the per-patch loop gives from the
    same seed, pixel for pixel, and leave the generator where it leaves it: an image as large
    as the patch (one place to start), odd sizes, a crop of a larger array."""
    rng = np.random.default_rng(1)
    wide = rng.uniform(size=(70, 90, 3)).astype(np.float32)
    images = [rng.uniform(size=(61, 75, 3)).astype(np.float32), wide[5:29, 3:57],
              rng.uniform(size=(24, 24, 3)).astype(np.float32)]
    fast = sr_data.PatchSampler(images, scale=2, hr_patch=24, seed=5)
    slow = sr_data.PatchSampler(images, scale=2, hr_patch=24, seed=5)
    for n in (1, 7, 64, 300):
        for ours, reference in zip(fast.batch(n), _patches_one_at_a_time(slow, n), strict=True):
            np.testing.assert_array_equal(ours, reference)
        assert fast._rng.bit_generator.state == slow._rng.bit_generator.state


def test_a_sampler_copies_and_pickles_at_the_size_of_its_images():
    """The patch views a batch reads are made per batch, not kept: a copy or pickle of the
    sampler (a task sent to another process) holds its images, not every window of them."""
    import copy
    import pickle

    rng = np.random.default_rng(2)
    images = [rng.uniform(size=(96, 96, 3)).astype(np.float32)]
    sampler = sr_data.PatchSampler(images, scale=2, hr_patch=24, seed=0)
    held = sum(im.nbytes for im in sampler.hr + sampler.lr)
    assert len(pickle.dumps(sampler)) < 2 * held
    twin = copy.deepcopy(sampler)
    for a, b in zip(twin.batch(5), sampler.batch(5), strict=True):
        np.testing.assert_array_equal(a, b)
