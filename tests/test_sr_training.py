"""The super-resolution task and training loop; a small SwinIR beats bicubic (slow)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from scamp_jax.hpo.runner import make_optimizer
from scamp_jax.planning.evaluation import EvalCompiler
from scamp_jax.planning.memory import default_step_shardings
from scamp_jax.planning.sharding import make_mesh
from scamp_jax.planning.train_step import (
    abstract_state,
    jit_train_step,
    place_train_state,
    split_model,
)
from search_spaces.sr_data import bicubic_upscale
from search_spaces.sr_task import SRTask, l1_loss, train
from search_spaces.swinir import SwinIR


def _write_photos(folder, n, size, seed):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(n):
        freq = rng.uniform(1, 4, size=3)
        img = 0.5 + 0.4 * np.sin(2 * np.pi * (freq[:, None, None] * (xx + yy * (i + 1) / 3)))
        img = np.clip(img.transpose(1, 2, 0) + rng.normal(scale=0.02, size=(size, size, 3)), 0, 1)
        Image.fromarray((img * 255).round().astype(np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def small_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("sr")
    return SRTask(
        scale=2,
        hr_patch=16,
        train_dir=_write_photos(root / "train", 3, 48, 0),
        eval_dir=_write_photos(root / "eval", 2, 40, 1),
        eval_size=32,
    )


def _tiny_swinir(drop_path_rate=0.0):
    return SwinIR(img_size=8, embed_dim=8, depths=(2,), num_heads=(2,), window_size=4,
                  mlp_ratio=1.0, upsampler="pixelshuffledirect", drop_path_rate=drop_path_rate,
                  rngs=nnx.Rngs(0))


def test_task_shapes_and_streams(small_task):
    assert (small_task.metric, small_task.direction) == ("psnr", "maximize")
    lr, hr = small_task.sample_batch(4)
    assert lr.shape == (4, 8, 8, 3) and hr.shape == (4, 16, 16, 3)
    a = next(small_task.batches(4, seed=1))
    b = next(small_task.batches(4, seed=1))
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0].shape == (4, 8, 8, 3) and a[1].shape == (4, 16, 16, 3)
    assert [im.shape for im in small_task.eval_hr] == [(32, 32, 3)] * 2


def test_evaluate_reports_model_and_bicubic_scores(small_task):
    model = _tiny_swinir(drop_path_rate=0.5)
    model.train()
    scores = small_task.evaluate(model)
    assert set(scores) == {"psnr", "ssim", "bicubic_psnr", "bicubic_ssim"}
    assert 20 < scores["bicubic_psnr"] < 60 and 0 < scores["bicubic_ssim"] <= 1
    assert scores["psnr"] < scores["bicubic_psnr"]  # untrained
    # evaluate() scores in eval mode and hands the model back in the mode it was in.
    assert not model.stochastic_depth.deterministic


def test_the_test_scores_other_images_than_the_held_out_ones(tmp_path):
    """`SRTask.test` scores a model as `evaluate` does, on the test images (``test_dir``):
    bicubic upscaling as the model scores bicubic's own baseline there, and the held-out
    scores stay the held-out images'. A test image too small to score is refused up front."""
    class Bicubic(nnx.Module):  # the task's own bicubic upscaling, on the host
        def __call__(self, lr):
            out = jax.ShapeDtypeStruct((lr.shape[0], 2 * lr.shape[1], 2 * lr.shape[2], 3),
                                       lr.dtype)
            return jax.pure_callback(lambda x: np.stack(
                [bicubic_upscale(np.asarray(im), 2) for im in x]).astype(np.float32), out, lr)

    task = SRTask(scale=2, hr_patch=16, train_dir=_write_photos(tmp_path / "train", 3, 48, 0),
                  eval_dir=_write_photos(tmp_path / "eval", 2, 40, 1),
                  test_dir=_write_photos(tmp_path / "test", 3, 36, 5), eval_size=32)
    held, tested = task.evaluate(Bicubic()), task.test(Bicubic())
    assert set(tested) == set(held) == {"psnr", "ssim", "bicubic_psnr", "bicubic_ssim"}
    assert tested["psnr"] == pytest.approx(tested["bicubic_psnr"], abs=1e-4)
    assert held["psnr"] == pytest.approx(held["bicubic_psnr"], abs=1e-4)
    assert abs(tested["bicubic_psnr"] - held["bicubic_psnr"]) > 0.1  # other images
    (tmp_path / "tiny").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "tiny" / "a.png")
    with pytest.raises(ValueError, match=r"smaller than the 16 pixels a test score at x2 needs"):
        SRTask(scale=2, hr_patch=16, test_dir=tmp_path / "tiny")


def test_l1_loss_and_train_records(small_task):
    model = _tiny_swinir()
    lr, hr = next(small_task.batches(2, seed=0))
    loss = l1_loss(model, (jnp.asarray(lr), jnp.asarray(hr)))
    assert loss.shape == () and float(loss) > 0
    history = train(model, small_task, steps=4, batch_size=2, learning_rate=1e-3, log_every=2)
    assert [r["step"] for r in history] == [2, 4]
    assert "psnr" in history[-1] and "psnr" not in history[0]
    assert history[-1]["elapsed_s"] >= history[0]["elapsed_s"] > 0
    with pytest.raises(ValueError, match="steps"):
        train(model, small_task, steps=0, batch_size=2)


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_data_parallel_swinir_trains_and_evaluates_as_on_one_device(tmp_path):
    """A SwinIR trial split over 2 devices ('data') computes what one device does: the same
    losses step by step and, from the same weights, the same held-out outputs through the
    chunked evaluation (3 images: the 2-device chunk pads the last one)."""
    task = SRTask(scale=2, hr_patch=16, train_dir=_write_photos(tmp_path / "train", 3, 48, 0),
                  eval_dir=_write_photos(tmp_path / "eval", 3, 40, 1), eval_size=32)
    model = _tiny_swinir()
    model.train()
    tx = make_optimizer({"learning_rate": 3e-3})
    stream = task.batches(4, seed=3)
    batches = [next(stream) for _ in range(4)]
    groups = task.eval_inputs()
    assert [g.shape[0] for g in groups] == [3]
    runs = {}
    for n in (1, 2):
        mesh = make_mesh(jax.devices()[:n], n, 1)
        shardings = default_step_shardings(mesh, *abstract_state(model, tx), tx)
        graphdef, p, o, r = place_train_state(model, tx, shardings)
        o.hyperparams["learning_rate"] = jax.device_put(
            jnp.float32(3e-3), shardings.opt_state.hyperparams["learning_rate"])
        step = jit_train_step(graphdef, tx, task.loss_fn, shardings)
        losses = []
        for batch in batches:
            placed = jax.device_put(batch, shardings.batch)
            assert {s.data.shape[0] for s in placed[0].addressable_shards} == {4 // n}
            p, o, r, loss = step(p, o, r, placed)
            losses.append(float(loss))
        runs[n] = (losses, jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, r), shardings,
                   EvalCompiler(graphdef, task.eval_forward, p, r, shardings.params,
                                shardings.rest, mesh))
    (losses, params, rest, _, _), (losses_2, params_2, _, _, _) = runs[1], runs[2]
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses_2, losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params_2), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # The same weights (the one-device run's) through each device count's evaluation.
    outputs, psnr = {}, {}
    for n, chunk in ((1, 3), (2, 2)):
        shardings, evaluator = runs[n][3], runs[n][4]
        on_mesh = jax.device_put((params, rest), (shardings.params, shardings.rest))
        outputs[n] = evaluator.run(chunk, *on_mesh, groups)
        psnr[n] = task.score(outputs[n])["psnr"]
    assert [o.shape[0] for o in outputs[2]] == [3]
    np.testing.assert_allclose(outputs[2][0], outputs[1][0], rtol=1e-5, atol=1e-6)
    assert psnr[2] == pytest.approx(psnr[1], abs=1e-4)
    whole = nnx.merge(split_model(model)[0], params, rest)
    assert task.evaluate(whole)["psnr"] == pytest.approx(psnr[1], abs=1e-4)


@pytest.mark.slow
def test_small_swinir_beats_bicubic_on_held_out_photos():
    """1,000 steps of batch 16 at lr 2e-3: held-out PSNR crosses bicubic (31.65 dB) near step
    500 and ends near 32.0 dB; about 2 CPU-minutes of compute."""
    task = SRTask(scale=2, hr_patch=48)
    model = SwinIR(img_size=24, embed_dim=24, depths=(2,), num_heads=(2,), window_size=8,
                   mlp_ratio=2.0, upsampler="pixelshuffledirect", drop_path_rate=0.0,
                   rngs=nnx.Rngs(0))
    history = train(model, task, steps=1000, batch_size=16, learning_rate=2e-3, log_every=100)
    final = history[-1]
    assert final["psnr"] > final["bicubic_psnr"], final
    assert final["ssim"] > final["bicubic_ssim"], final


def test_one_folder_for_two_image_sets_is_warned_of_and_the_command_line_says_so(
        tmp_path, caplog):
    """A folder given as two of the task's image sets (held-out and test here) makes one of
    their scores say less than it seems: warned of once per pair, naming what it costs; the
    command line prints the warning as its words alone; folders of their own: no warning."""
    import subprocess
    import sys
    from pathlib import Path

    photos = _write_photos(tmp_path / "photos", 2, 40, 1)
    with caplog.at_level("WARNING", logger="search_spaces.sr_task"):
        SRTask(scale=2, hr_patch=16, eval_dir=photos, test_dir=photos, eval_size=32)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"the held-out and test images are one folder, {photos.resolve()}: the best "
                    "model is tested on the images it was chosen by, which is no independent "
                    "test; give each set a folder of its own"], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="search_spaces.sr_task"):
        SRTask(scale=2, hr_patch=16, eval_dir=photos, eval_size=32,
               test_dir=_write_photos(tmp_path / "test", 2, 40, 2))
    assert not caplog.records
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke", "--trials", "1",
         "--steps", "1", "--eval-dir", str(photos), "--test-dir", str(photos), "--study-dir",
         str(tmp_path / "study"), "--memory-per-device", "1KiB"], cwd=root,
        capture_output=True, text=True, timeout=300)
    assert proc.stderr.splitlines()[0] == said[0], proc.stderr
