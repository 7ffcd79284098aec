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
      grid: every parameter ``suggest`` draws (``trial.suggest_*``), with the discrete values
        Optuna may draw for it (for Optuna's ``GridSampler``; continuous ones list a few
        representative values): the draws, which a results row's ``drawn`` holds where
        ``suggest`` changed them, not its configuration. ``suggest`` is tried at each point
        before the study stores anything.
      largest: the configuration with the largest training memory (the fixed-resource baseline
        sizes its single batch size for it).
    """

    name: str
    suggest: Callable[[Any], dict[str, Any]]
    build: Callable[[Config, nnx.Rngs], nnx.Module]
    grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    largest: Config = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"SearchSpace name={self.name!r} must be a non-empty string")
        for what, fn, example in (("suggest", self.suggest, "suggest(trial) -> dict"),
                                  ("build", self.build, "build(config, rngs) -> nnx.Module")):
            if not callable(fn):
                raise TypeError(f"SearchSpace {what}={fn!r} is not callable; pass a function "
                                f"{example}")

    def model(self, config: Config, rngs: nnx.Rngs) -> nnx.Module:
        """``build(config, rngs)``, checked to be an ``nnx.Module`` (what every trial, plan
        and evaluation builds its model with)."""
        model = self.build(config, rngs)
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"search space {self.name!r}: build(config, rngs) returned a "
                f"{type(model).__name__}, not an nnx.Module; it must construct the model, e.g. "
                "return MyModel(config['width'], rngs=rngs)")
        return model


class Task(Protocol):
    """What candidates train on and how they are scored. Arrays are NHWC float32 for images."""

    #: Name of the score `evaluate` returns as the study objective (e.g. ``"psnr"``).
    metric: str
    #: ``"maximize"`` or ``"minimize"`` for `metric`.
    direction: str
    # Optional: ``parallel_streams = True`` says that streams of different seeds share no
    # mutable state, so that a fused group may draw its members' batches at once on several
    # threads (`scamp_jax.hpo.member_streams`); without it they are drawn one after another.
    # Optional: ``test(model) -> {name: float}``, scores on data no trial is chosen by (a test
    # split). A study chooses its best trial by `evaluate`'s held-out scores, so that score is
    # optimistic; at the end of each run the best model (``best_model/``) is tested once more
    # and its ``test`` scores printed beside them and kept in ``results.json`` (``"test"``).

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
        """Held-out scores; must contain `metric` (and may add baselines, e.g. ``bicubic_psnr``).
        ``model`` is a copy in evaluation mode (``model.eval()``: dropout off, batch norm on its
        running averages)."""
        ...


@dataclass(frozen=True, kw_only=True)
class FunctionTask:
    """A `Task` made of plain functions, for users who have a loss, a data stream and a scorer.

    Example (``examples/digits.py`` has the whole study)::

        task = scamp_jax.FunctionTask(
            metric="accuracy", direction="maximize",
            loss_fn=lambda model, batch: optax.softmax_cross_entropy_with_integer_labels(
                model(batch[0]), batch[1]).mean(),
            batches=lambda batch_size, seed: my_stream(batch_size, seed),
            evaluate=lambda model: {"accuracy": float((model(x_val).argmax(-1) == y_val).mean())},
        )

    Attributes:
      metric: name of the score `evaluate` returns as the study objective (e.g. ``"accuracy"``).
      direction: ``"maximize"`` or ``"minimize"`` for ``metric``.
      loss_fn: ``loss_fn(model, batch) -> scalar``: the training loss of ``model`` on one batch
        (the tuple ``batches`` yields, as device arrays); traced inside the jitted step.
      batches: ``batches(batch_size, seed) -> iterator``: an endless, seeded stream of tuples of
        numpy arrays whose leading axis is ``batch_size`` (e.g. ``(inputs, labels)``).
      evaluate: ``evaluate(model) -> {name: float}``: held-out scores; must contain ``metric``.
        ``model`` comes in evaluation mode (``model.eval()`` was called on a copy: dropout off,
        batch norm on its running averages).
      sample_batch: ``sample_batch(batch_size) -> tuple of jax.ShapeDtypeStruct`` for planning
        (None: the shapes and device dtypes of the first batch of ``batches(1, 0)``, with the
        leading axis set to ``batch_size``).
      parallel_streams: True when streams of different seeds share no mutable state (each its
        own generator, shared data read only): a fused group then draws its members' batches
        at once on several threads. Default False: one after another.
      test: ``test(model) -> {name: float}``: scores on test data that no trial is chosen by,
        taken of the study's best model at the end of each run (the held-out scores chose it,
        so they flatter it); model as for ``evaluate``. None (the default): no test.
    """

    metric: str
    direction: str
    loss_fn: Callable[[nnx.Module, Any], jax.Array]
    batches: Callable[[int, int], Iterator[tuple[np.ndarray, ...]]]
    evaluate: Callable[[nnx.Module], Mapping[str, float]]
    sample_batch: Callable[[int], tuple[jax.ShapeDtypeStruct, ...]] | None = None
    parallel_streams: bool = False
    test: Callable[[nnx.Module], Mapping[str, float]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"metric={self.metric!r} must be a non-empty string naming the "
                             "score evaluate returns, e.g. metric='accuracy'")
        if self.direction not in ("maximize", "minimize"):
            raise ValueError(f"direction={self.direction!r} must be 'maximize' or 'minimize'")
        for name in ("loss_fn", "batches", "evaluate", "test"):
            if name == "test" and self.test is None:
                continue
            if not callable(getattr(self, name)):
                raise TypeError(f"{name}={getattr(self, name)!r} is not callable; pass a "
                                f"function (see FunctionTask's docstring for its signature)")
        if self.sample_batch is None:
            object.__setattr__(self, "sample_batch", _ShapesOfFirstBatch(self.batches))


#: What an exhausted stream gives `next` (a batch may be None-like, so no None).
_NONE = object()


class _ShapesOfFirstBatch:
    """``sample_batch`` read off a task's data: the first batch of ``batches(1, 0)``."""

    def __init__(self, batches: Callable[[int, int], Iterator[Any]]) -> None:
        self._batches = batches
        self._shapes: list[tuple[tuple[int, ...], np.dtype]] | None = None
        self._treedef: Any = None

    def __call__(self, batch_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        if self._shapes is None:
            first = next(iter(self._batches(1, 0)), _NONE)
            if first is _NONE:
                raise ValueError(
                    "the task's batches(1, 0) yielded no batch (read for the shapes to plan "
                    "with); it must yield batches for as long as it is asked (e.g. draw them in "
                    "a `while True:` loop), or pass sample_batch")
            leaves, self._treedef = jax.tree.flatten(first)
            shapes = []
            for leaf in leaves:
                array = np.asarray(leaf)
                if array.ndim == 0 or array.shape[0] != 1:
                    raise ValueError(
                        f"batches(1, 0) yielded an array of shape {array.shape}; every array of "
                        "a batch must have the batch size as its leading axis (here 1), or "
                        "pass sample_batch"
                    )
                # The dtype the array gets on a device (float64 becomes float32 unless x64 is on).
                shapes.append((array.shape[1:], jax.dtypes.canonicalize_dtype(array.dtype)))
            self._shapes = shapes
        return jax.tree.unflatten(self._treedef, [
            jax.ShapeDtypeStruct((batch_size, *shape), dtype) for shape, dtype in self._shapes
        ])
