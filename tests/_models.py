"""Small models several test modules plan and train."""

from __future__ import annotations

import jax
from flax import nnx

#: Image channels of `ConvNet`'s input and output.
CHANNELS = 3


class ConvNet(nnx.Module):
    """Two 3x3 convolutions: activations, not parameters, dominate training memory."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.a = nnx.Conv(CHANNELS, width, (3, 3), rngs=rngs)
        self.b = nnx.Conv(width, CHANNELS, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(nnx.gelu(self.a(x)))
