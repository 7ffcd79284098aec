"""A vision-transformer family (Dosovitskiy et al., ICLR 2021) for ScaMP's synthetic benchmarks.

`ViT` is a standard pre-norm ViT on NHWC images: patch embedding (a strided convolution), a
class token, learned position embeddings, ``depth`` transformer blocks, a final LayerNorm and a
linear head on the class token. `space` varies patch size, width, depth, heads and MLP ratio;
`SyntheticClassificationTask` is a learnable classification task made of generated images, so
memory and throughput benchmarks need no data set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from scamp_jax.space import Config, SearchSpace
from search_spaces.softmax import softmax_derivative

__all__ = [
    "SyntheticClassification",
    "SyntheticClassificationTask",
    "ViT",
    "ViTBlock",
    "space",
]

_INIT = nnx.initializers.truncated_normal(stddev=0.02)


class ViTBlock(nnx.Module):
    """Pre-norm transformer block: x + MHSA(LN(x)), then x + MLP(LN(x)). (B, L, C) -> (B, L, C)."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: float, *, dropout: float = 0.0, rngs: nnx.Rngs
    ):
        if dim % num_heads:
            raise ValueError(f"{dim=} is not divisible by {num_heads=}; choose a divisor")
        hidden = int(dim * mlp_ratio)
        self.norm1 = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=dim,
            kernel_init=_INIT,
            dropout_rate=dropout,
            decode=False,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)
        self.fc1 = nnx.Linear(dim, hidden, kernel_init=_INIT, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, kernel_init=_INIT, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None
        #: the attention softmax keeps only its output for the backward pass
        #: (`search_spaces.softmax`)
        self.save_softmax_output = True

    def _dropped(self, x: jax.Array) -> jax.Array:
        return x if self.drop is None else self.drop(x)

    def __call__(self, x: jax.Array) -> jax.Array:
        with softmax_derivative(self.save_softmax_output):
            x = x + self._dropped(self.attn(self.norm1(x)))
        y = self.fc2(jax.nn.gelu(self.fc1(self.norm2(x)), approximate=False))
        return x + self._dropped(y)


class ViT(nnx.Module):
    """Vision transformer classifier.

    Call: ``model(x)`` with x (B, image_size, image_size, in_chans) float32 returns logits
    (B, num_classes). ``image_size`` must be a multiple of ``patch_size``; the sequence has
    (image_size / patch_size)^2 + 1 tokens of width ``embed_dim``.
    """

    def __init__(
        self,
        *,
        image_size: int = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        rngs: nnx.Rngs,
    ):
        if image_size % patch_size:
            raise ValueError(
                f"{image_size=} is not a multiple of {patch_size=}; pick a patch size that "
                "divides the image"
            )
        if depth < 1:
            raise ValueError(f"{depth=} must be at least 1")
        self.image_size, self.patch_size, self.in_chans = image_size, patch_size, in_chans
        tokens = (image_size // patch_size) ** 2
        self.patch_embed = nnx.Conv(
            in_chans,
            embed_dim,
            kernel_size=(patch_size, patch_size),
            strides=(patch_size, patch_size),
            padding="VALID",
            rngs=rngs,
        )
        self.cls_token = nnx.Param(jnp.zeros((1, 1, embed_dim), jnp.float32))
        self.pos_embed = nnx.Param(_INIT(rngs.params(), (1, tokens + 1, embed_dim), jnp.float32))
        self.blocks = nnx.List(
            [ViTBlock(embed_dim, num_heads, mlp_ratio, dropout=dropout, rngs=rngs)
             for _ in range(depth)]
        )
        self.norm = nnx.LayerNorm(embed_dim, epsilon=1e-6, rngs=rngs)
        self.head = nnx.Linear(
            embed_dim, num_classes, kernel_init=nnx.initializers.zeros_init(), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        expected = (self.image_size, self.image_size, self.in_chans)
        if x.ndim != 4 or tuple(x.shape[1:]) != expected:
            raise ValueError(f"expected NHWC input (B, {expected}), got shape {x.shape}")
        x = self.patch_embed(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = jnp.broadcast_to(self.cls_token[...], (b, 1, c))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def _cross_entropy(model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
    images, labels = batch[0], batch[1]
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class SyntheticClassificationTask:
    """Generated images, ``num_classes`` classes (the `scamp_jax.space.Task` protocol).

    Each class owns a fixed random smooth template; a sample is its template at a random
    contrast plus Gaussian noise, so the task is learnable but not trivial. Metric:
    ``accuracy`` on ``eval_size`` fixed held-out samples (maximize); `test` scores as many
    other samples, which no trial is chosen by.

    Args:
      image_size, in_chans, num_classes: image side (pixels), channels, classes.
      noise: standard deviation of the per-pixel noise (templates have unit scale).
      eval_size: held-out samples; seed: seed of the templates and the held-out set.
    """

    metric = "accuracy"
    direction = "maximize"
    #: streams of different seeds share only the read-only templates: a fused group draws its
    #: members' batches at once (`scamp_jax.hpo.member_streams`)
    parallel_streams = True

    def __init__(
        self,
        image_size: int = 32,
        in_chans: int = 3,
        num_classes: int = 10,
        *,
        noise: float = 1.0,
        eval_size: int = 256,
        seed: int = 0,
    ):
        self.image_size, self.in_chans, self.num_classes = image_size, in_chans, num_classes
        self.noise = noise
        rng = np.random.default_rng(seed)
        coarse = rng.normal(size=(num_classes, 4, 4, in_chans))
        # Smooth templates: 4x4 random fields upsampled, so patches of any size carry signal.
        reps = -(-image_size // 4)
        big = np.repeat(np.repeat(coarse, reps, axis=1), reps, axis=2)
        self.templates = big[:, :image_size, :image_size].astype(np.float32)
        self._eval = self._draw(rng, eval_size, float64_noise=True)
        # a stream of its own (neither the held-out nor a training one): drawn as the held-out
        self._test = self._draw(np.random.default_rng([seed, 2]), eval_size, float64_noise=True)

    def _draw(self, rng: np.random.Generator, n: int, *, float64_noise: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, self.num_classes, size=n)
        contrast = rng.uniform(0.5, 1.5, size=(n, 1, 1, 1)).astype(np.float32)
        shape = (n, *self.templates.shape[1:])
        if float64_noise:  # the held-out set, drawn once: as every version of the task drew it
            noise = rng.normal(scale=self.noise, size=shape)
            return ((self.templates[labels] * contrast + noise).astype(np.float32),
                    labels.astype(np.int32))
        # Training batches: float32 noise drawn as such and summed in place, a quarter less
        # host time than float64 noise cast down (one member at batch 512: 16.5 against 22.5
        # ms), the same distribution.
        images = rng.standard_normal(size=shape, dtype=np.float32)
        images *= np.float32(self.noise)
        images += self.templates[labels] * contrast
        return images, labels.astype(np.int32)

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """Abstract (images (B, S, S, C) float32, labels (B,) int32)."""
        s, c = self.image_size, self.in_chans
        return (
            jax.ShapeDtypeStruct((batch_size, s, s, c), jnp.float32),
            jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        )

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Endless stream of fresh (images, labels) batches; same seed, same stream."""
        rng = np.random.default_rng([seed, 1])  # never the held-out stream
        while True:
            yield self._draw(rng, batch_size)

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        """Mean softmax cross-entropy of the logits against the integer labels."""
        return _cross_entropy(model, batch)

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        """``accuracy`` (fraction correct) and ``loss`` on the held-out samples."""
        images, _ = self._eval
        return self.score([np.asarray(_logits(model, jnp.asarray(images)))])

    def test(self, model: nnx.Module) -> dict[str, float]:
        """`evaluate`'s scores on the test samples, which no trial is chosen by."""
        images, labels = self._test
        return _scores(np.asarray(_logits(model, jnp.asarray(images))), labels)

    def eval_inputs(self) -> list[np.ndarray]:
        """The held-out images, one group (eval_size, H, W, C)."""
        return [self._eval[0]]

    def eval_forward(self, model: nnx.Module, x: jax.Array) -> jax.Array:
        """Logits of ``model`` for images ``x``."""
        return model(x)

    def score(self, outputs: list[np.ndarray]) -> dict[str, float]:
        """`evaluate`'s scores from the held-out logits (the one group of `eval_inputs`)."""
        return _scores(np.asarray(outputs[0]), self._eval[1])


def _scores(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """``accuracy`` and mean cross-entropy ``loss`` of ``logits`` against ``labels``."""
    loss = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), labels).mean()
    return {"accuracy": float((logits.argmax(-1) == labels).mean()), "loss": float(loss)}


#: Shorter name for `SyntheticClassificationTask`.
SyntheticClassification = SyntheticClassificationTask


@nnx.jit
def _logits(model: nnx.Module, images: jax.Array) -> jax.Array:
    return model(images)


_SMALL = {
    "patch_size": (4, 8),
    "embed_dim": (32, 64, 96, 128),
    "depth": (2, 4, 6),
    "num_heads": (2, 4),
    "mlp_ratio": (2.0, 4.0),
    "learning_rate": (1e-4, 1e-3, 3e-3),
}
_PAPER = {
    "patch_size": (16, 32),
    "embed_dim": (192, 384, 768),
    "depth": (6, 12),
    "num_heads": (3, 6, 12),
    "mlp_ratio": (4.0,),
    "learning_rate": (1e-4, 3e-4, 1e-3),
}


def space(variant: str = "small", *, num_classes: int = 10) -> SearchSpace:
    """ViT search space: ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``, ``mlp_ratio``
    and ``learning_rate`` (log-uniform).

    ``"small"``: 32x32 images (CPU benchmarks); ``"paper"``: 224x224 images, ViT-Ti/S/B widths.
    Every width in a space is divisible by every head count in it.
    """
    if variant not in ("small", "paper"):
        raise ValueError(f"{variant=} is not a ViT space; use 'small' or 'paper'")
    table = _SMALL if variant == "small" else _PAPER
    image_size = 32 if variant == "small" else 224
    lr_low, lr_high = min(table["learning_rate"]), max(table["learning_rate"])

    def suggest(trial: Any) -> dict[str, Any]:
        cfg = {k: trial.suggest_categorical(k, list(v)) for k, v in table.items()
               if k != "learning_rate"}
        cfg["learning_rate"] = trial.suggest_float("learning_rate", lr_low, lr_high, log=True)
        return cfg

    def build(config: Config, rngs: nnx.Rngs) -> ViT:
        return ViT(
            image_size=int(config.get("image_size", image_size)),
            patch_size=int(config["patch_size"]),
            num_classes=int(config.get("num_classes", num_classes)),
            embed_dim=int(config["embed_dim"]),
            depth=int(config["depth"]),
            num_heads=int(config["num_heads"]),
            mlp_ratio=float(config["mlp_ratio"]),
            rngs=rngs,
        )

    largest = {k: (min(v) if k == "patch_size" else max(v)) for k, v in table.items()}
    return SearchSpace(
        name=f"vit-{variant}",
        suggest=suggest,
        build=build,
        grid={k: list(v) for k, v in table.items()},
        largest=largest,
    )
