"""What a search is over: a family of candidate models (`SearchSpace`) and what they learn (`Task`).

The engine only talks to these two interfaces, so a new model family or data set plugs in
without touching planning, placement or running.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx

Config = Mapping[str, Any]


@dataclass(frozen=True)
class SearchSpace:
    """A family of candidate models and how to sample one configuration.

    Attributes:
      name: short identifier, used in study names and results.
      suggest: draws one configuration from an Optuna trial (``trial.suggest_*`` calls); the result
        holds model hyperparameters and training hyperparameters (e.g. ``learning_rate``) together.
      build: ``build(config, rngs) -> nnx.Module``; ignores training-only keys. Called under
        ``nnx.eval_shape`` for planning, so it must not touch data.
      grid: every key ``suggest`` sets, with the discrete values it can take (for Optuna's
        ``GridSampler``; continuous keys list a few representative values).
      largest: the configuration with the largest training memory (the fixed-resource baseline
        sizes its single batch size for it).
    """

    name: str
    suggest: Callable[[Any], dict[str, Any]]
    build: Callable[[Config, nnx.Rngs], nnx.Module]
    grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    largest: Config = field(default_factory=dict)


class Task(Protocol):
    """What candidates train on and how they are scored. Arrays are NHWC float32 for images."""

    #: Name of the score `evaluate` returns as the study objective (e.g. ``"psnr"``).
    metric: str
    #: ``"maximize"`` or ``"minimize"`` for `metric`.
    direction: str

    def sample_batch(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract ``(inputs, targets)`` of a global batch of ``batch_size`` (for planning)."""
        ...

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[np.ndarray, ...]]:
        """Endless, seeded stream of ``(inputs, targets)`` numpy batches of ``batch_size``."""
        ...

    def loss_fn(self, model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
        """Scalar training loss of ``model`` on ``batch`` (traced inside the jitted step)."""
        ...

    def evaluate(self, model: nnx.Module) -> dict[str, float]:
        """Held-out scores; must contain `metric` (and may add baselines, e.g. ``bicubic_psnr``)."""
        ...
