"""What the pipeline needs of a supernet: the `StageModel` interface.

The pipeline (schedules, tick programs, executors, trainer) knows nothing about any particular
search space. A supernet plugs in by providing:

- sizes: ``num_layers`` (L choice layers, split evenly over the stages), ``num_choices`` (C
  candidate blocks per layer), ``block_size`` (P, floats of the largest block: every block is a
  flat float32 vector zero-padded to P), ``shared_size`` (floats of the stem and head together)
  and ``stem_size`` (the stem's part, first);
- ``init(seed)``: initial weights as numpy arrays, blocks ``(L, C, P)`` and shared ``(P_shared,)``;
- ``apply_stem`` / ``apply_layers`` / ``apply_head``: pure functions of flat weights, traced
  inside the stage program (``apply_layers`` picks each layer's candidate from a traced choice
  index, e.g. with ``lax.switch``);
- ``loss(output, target)``: the scalar training loss of a microbatch;
- ``feature_shape(batch, side)``: the shape of the features passed between stages for a
  microbatch of ``batch`` inputs of side ``side`` pixels; ``check_input(side)`` raises a
  ``ValueError`` naming the fix when inputs of that side cannot be used.

`search_spaces.supernet.SupernetLayout` (the super-resolution supernet) is one implementation.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax
import numpy as np


@runtime_checkable
class StageModel(Protocol):
    """A weight-sharing supernet in the flat-block layout the pipeline trains (module docstring).

    Attributes:
      num_layers: L choice layers.
      num_choices: C candidates per layer.
      block_size: P, floats per (zero-padded) block.
      shared_size: floats of the stem and head together (stem first).
      stem_size: floats of the stem (the first ``stem_size`` entries of the shared vector).
    """

    # read-only: a layout may compute them (`search_spaces.supernet_nas.SupernetLayout`)
    @property
    def num_layers(self) -> int: ...
    @property
    def num_choices(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def shared_size(self) -> int: ...
    @property
    def stem_size(self) -> int: ...

    def init(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Initial ``(blocks (L, C, P), shared (P_shared,))`` float32 numpy arrays."""
        ...

    def apply_stem(self, shared: jax.Array, inputs: jax.Array) -> jax.Array:
        """Microbatch inputs -> features (`feature_shape`) of the first stage."""
        ...

    def apply_layers(self, blocks: jax.Array, choices: jax.Array, x: jax.Array) -> jax.Array:
        """Consecutive choice layers: ``blocks`` (n, P), traced ``choices`` (n,), features x."""
        ...

    def apply_head(self, shared: jax.Array, h: jax.Array, inputs: jax.Array) -> jax.Array:
        """Last stage's features and the microbatch inputs -> model output."""
        ...

    def loss(self, output: jax.Array, target: jax.Array) -> jax.Array:
        """Scalar training loss of one microbatch."""
        ...

    def feature_shape(self, batch: int, side: int) -> tuple[int, ...]:
        """Shape of the features between stages for ``batch`` inputs of ``side`` pixels."""
        ...

    def check_input(self, side: int) -> None:
        """Raise ``ValueError`` (naming the fix) unless inputs of ``side`` pixels can be used."""
        ...


def check_stage_model(model: object) -> StageModel:
    """``model`` if it implements `StageModel`, else a ``TypeError`` naming what is missing."""
    missing = [
        name for name in (
            "num_layers", "num_choices", "block_size", "shared_size", "stem_size", "init",
            "apply_stem", "apply_layers", "apply_head", "loss", "feature_shape", "check_input",
        )
        if not hasattr(model, name)
    ]
    if missing:
        raise TypeError(
            f"{type(model).__name__} is not a StageModel: it lacks {', '.join(missing)}; see "
            "scamp_jax.pipeline.model.StageModel"
        )
    return model  # type: ignore[return-value]


def state_bytes(model: StageModel, optimizer_fields: int) -> int:
    """Bytes of the whole supernet's weights and optimizer state (flat layout, float32).

    Counts every (layer, candidate) block at the padded length P plus the stem and head, times
    ``optimizer_fields`` float arrays per weight, plus one int32 step count per block.
    """
    blocks = model.num_layers * model.num_choices
    floats = (blocks * model.block_size + model.shared_size) * optimizer_fields
    return 4 * floats + 4 * blocks
