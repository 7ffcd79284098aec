"""Single-image super-resolution as a search `Task`, and a plain training loop.

`SRTask` trains on random bicubic-degraded patches of real photographs and scores PSNR/SSIM on
the Y channel of held-out images (border = scale), next to the bicubic baseline on the same
images. `train` is the paper's recipe (L1 loss, Adam, learning rate 2e-4) on one device.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from search_spaces import metrics, sr_data

log = logging.getLogger(__name__)

__all__ = ["SRTask", "l1_loss", "train"]


def l1_loss(model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
    """Mean absolute error between ``model(lr)`` and ``hr``; batch = (lr NHWC, hr NHWC)."""
    lr, hr = batch[0], batch[1]
    return jnp.mean(jnp.abs(model(lr) - hr))


def _centre_crop(img: np.ndarray, size: int | None, scale: int) -> np.ndarray:
    img = sr_data.crop_to_multiple(img, scale)
    if size is None:
        return img
    h, w = img.shape[:2]
    s = min(size, h, w)
    s -= s % scale
    y, x = (h - s) // 2, (w - s) // 2
    return img[y : y + s, x : x + s]


def _is_training(model: nnx.Module) -> bool:
    """Whether a module of ``model`` is in training mode (``deterministic`` False: dropout,
    stochastic depth)."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and getattr(node, "deterministic", True) is False:
            return True
    return False


@nnx.jit
def _predict(model: nnx.Module, lr: jax.Array) -> jax.Array:
    return model(lr)


class _Scored:
    """Centre crops of HR images, their bicubic-downscaled inputs, and bicubic's scores on
    them: the images a task scores a model on (the held-out ones, or the test ones)."""

    def __init__(self, images: list[np.ndarray], size: int | None, scale: int) -> None:
        self.scale = scale
        self.hr = [_centre_crop(im, size, scale) for im in images]
        self.lr = [sr_data.bicubic_downscale(im, scale) for im in self.hr]
        bicubic = [sr_data.bicubic_upscale(lr, scale) for lr in self.lr]
        self.baseline = {
            "bicubic_psnr": float(np.mean(
                [metrics.psnr_y(b, h, scale) for b, h in zip(bicubic, self.hr, strict=True)])),
            "bicubic_ssim": float(np.mean(
                [metrics.ssim_y(b, h, scale) for b, h in zip(bicubic, self.hr, strict=True)])),
        }
        # Same-size crops go through the model as one batch (one compile, one call).
        self.stackable = len({im.shape for im in self.lr}) == 1

    def inputs(self) -> list[np.ndarray]:
        """The LR images as equal-shape groups: one (n, h, w, 3) stack, or one per image."""
        if self.stackable:
            return [np.stack(self.lr)]
        return [lr[None] for lr in self.lr]

    def predict(self, model: nnx.Module) -> list[np.ndarray]:
        """``model``'s outputs for the LR images, in eval mode, clipped to [0, 1]."""
        was_training = _is_training(model)
        model.eval()
        try:
            outs = [o for group in self.inputs()
                    for o in np.asarray(_predict(model, jnp.asarray(group)))]
        finally:
            if was_training:
                model.train()
        return [np.clip(o, 0.0, 1.0) for o in outs]

    def scores(self, outs: list[np.ndarray]) -> dict[str, float]:
        psnr = np.mean([metrics.psnr_y(o, h, self.scale) for o, h in
                        zip(outs, self.hr, strict=True)])
        ssim = np.mean([metrics.ssim_y(o, h, self.scale) for o, h in
                        zip(outs, self.hr, strict=True)])
        return {"psnr": float(psnr), "ssim": float(ssim), **self.baseline}


class SRTask:
    """Super-resolution by ``scale`` (the `scamp_jax.space.Task` protocol).

    Args:
      scale: SR factor.
      hr_patch: HR training patch side in pixels (multiple of ``scale``); LR patches are
        ``hr_patch // scale``.
      train_dir: folder of HR training images; None uses the bundled scikit-image photographs.
      eval_dir: folder of held-out HR images, which trials are scored and chosen by; None uses
        the bundled held-out photographs.
      test_dir: folder of HR images the study's best model is tested on (`test`), which no
        trial is chosen by; None uses the bundled test photographs.
      eval_size: side of the centre crop of every held-out and test image, HR pixels (None:
        whole images, scored one by one). The default keeps evaluation near a second on a CPU.
    """

    metric = "psnr"
    direction = "maximize"
    #: streams of different seeds share only the read-only images: a fused group draws its
    #: members' batches at once (`scamp_jax.hpo.member_streams`)
    parallel_streams = True

    def __init__(
        self,
        scale: int = 2,
        hr_patch: int = 48,
        train_dir: str | Path | None = None,
        eval_dir: str | Path | None = None,
        eval_size: int | None = 128,
        test_dir: str | Path | None = None,
    ):
        if hr_patch % scale:
            raise ValueError(f"{hr_patch=} must be a multiple of {scale=}")
        _warn_of_shared_folders(train_dir, eval_dir, test_dir)
        self.scale, self.hr_patch = scale, hr_patch
        default_train, default_eval = (
            sr_data.default_split() if train_dir is None or eval_dir is None else ([], [])
        )
        train_images = (default_train if train_dir is None
                        else sr_data.load_image_dir(train_dir, min_size=hr_patch))
        # scores crop a border of `scale` pixels and need SSIM's window inside it
        least = -(-(metrics.SSIM_WINDOW + 2 * scale) // scale) * scale
        eval_images = default_eval if eval_dir is None else sr_data.load_image_dir(
            eval_dir, min_size=least, needs=f"a held-out score at x{scale}")
        test_images = (sr_data.bundled_test_images() if test_dir is None else
                       sr_data.load_image_dir(test_dir, min_size=least,
                                              needs=f"a test score at x{scale}"))
        self._sampler = sr_data.PatchSampler(train_images, scale, hr_patch, seed=0)
        self._held_out = _Scored(eval_images, eval_size, scale)
        self._test = _Scored(test_images, eval_size, scale)
        self.eval_hr, self.eval_lr = self._held_out.hr, self._held_out.lr

    @property
    def lr_patch(self) -> int:
        """LR training patch side in pixels."""
        return self.hr_patch // self.scale

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """Abstract (lr (B, p, p, 3), hr (B, p*scale, p*scale, 3)) float32 of one global batch."""
        p, s = self.lr_patch, self.scale
        return (
            jax.ShapeDtypeStruct((batch_size, p, p, 3), jnp.float32),
            jax.ShapeDtypeStruct((batch_size, p * s, p * s, 3), jnp.float32),
        )

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Endless stream of augmented (lr, hr) numpy batches; same seed, same stream."""
        sampler = copy.copy(self._sampler)  # shares the degraded images, own generator
        sampler._rng = np.random.default_rng(seed)
        while True:
            yield sampler.batch(batch_size)

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        """L1 loss (the SwinIR paper's training loss)."""
        return l1_loss(model, batch)

    def predict(self, model: nnx.Module) -> list[np.ndarray]:
        """Model outputs for the held-out LR images, in eval mode, clipped to [0, 1]."""
        return self._held_out.predict(model)

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        """Held-out Y-channel scores (border = scale).

        Returns ``psnr`` (dB) and ``ssim`` of the model, ``bicubic_psnr`` and ``bicubic_ssim``
        of bicubic upscaling on the same images.
        """
        return self._held_out.scores(self.predict(model))

    def test(self, model: nnx.Module) -> dict[str, float]:
        """`evaluate`'s scores on the test images (``test_dir``), which no trial is chosen by:
        the study's best model was chosen by its held-out score, which its test score
        checks."""
        return self._test.scores(self._test.predict(model))

    def eval_inputs(self) -> list[np.ndarray]:
        """Held-out LR images as equal-shape groups: one (n, h, w, 3) stack, or one per image."""
        return self._held_out.inputs()

    def eval_forward(self, model: nnx.Module, x: jax.Array) -> jax.Array:
        """The SR output of an eval-mode ``model`` for LR images ``x`` (B, h, w, 3)."""
        return model(x)

    def score(self, outputs: list[np.ndarray]) -> dict[str, float]:
        """`evaluate`'s scores from the outputs of every group of `eval_inputs`."""
        outs = [np.clip(o, 0.0, 1.0) for group in outputs for o in np.asarray(group)]
        return self._held_out.scores(outs)


def train(
    model: nnx.Module,
    task: Any,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float = 2e-4,
    seed: int = 0,
    log_every: int = 50,
    eval_every: int | None = None,
) -> list[dict[str, float]]:
    """Train ``model`` in place on ``task`` with Adam, one device, and return the history.

    Args:
      model: an NNX module (trained in place, left in eval mode).
      task: a `Task` (e.g. `SRTask`); its ``loss_fn`` is minimised.
      steps: optimizer steps; batch_size: samples per step.
      learning_rate: Adam step size (2e-4 as in SwinIR).
      seed: seed of the batch stream.
      log_every: record the mean training loss every this many steps.
      eval_every: also run ``task.evaluate`` every this many steps (None: only at the end).
    Returns:
      list of records ``{"step", "loss", "elapsed_s", ...evaluation scores}``; the last record
      holds the final evaluation.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"{steps=} and {batch_size=} must be positive")
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, lr: jax.Array, hr: jax.Array):
        loss, grads = nnx.value_and_grad(task.loss_fn)(model, (lr, hr))
        optimizer.update(model, grads)
        return loss

    model.train()
    history: list[dict[str, float]] = []
    stream = task.batches(batch_size, seed)
    start = time.perf_counter()
    running: list[jax.Array] = []
    for i in range(1, steps + 1):
        lr, hr = next(stream)
        running.append(step(model, optimizer, jnp.asarray(lr), jnp.asarray(hr)))
        record: dict[str, float] = {}
        if i % log_every == 0 or i == steps:
            record = {"step": i, "loss": float(jnp.mean(jnp.stack(running)))}
            running = []
        if (eval_every and i % eval_every == 0) or i == steps:
            record = record or {"step": i}
            record.update(task.evaluate(model))
        if record:
            record["elapsed_s"] = time.perf_counter() - start
            history.append(record)
    model.eval()
    return history


def _warn_of_shared_folders(train: str | Path | None, held_out: str | Path | None,
                            test: str | Path | None) -> None:
    """Warn where one folder is given for two of the task's image sets: each set's score then
    says less than it seems (a held-out score of the training images rewards memorising them,
    a test of the held-out images is no test of the choice made by them)."""
    folders = {"training": train, "held-out": held_out, "test": test}
    given = {name: Path(f).resolve() for name, f in folders.items() if f is not None}
    for first, second, what in (
            ("training", "held-out", "trials are scored and chosen by the images they train on"),
            ("held-out", "test", "the best model is tested on the images it was chosen by, "
                                 "which is no independent test"),
            ("training", "test", "the best model is tested on the images it trained on")):
        if first in given and given[first] == given.get(second):
            log.warning("the %s and %s images are one folder, %s: %s; give each set a folder "
                        "of its own", first, second, given[first], what)
