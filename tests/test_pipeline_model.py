"""The pipeline takes any supernet implementing `StageModel`; it imports no search space."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from scamp_jax.pipeline import StageModel, train_supernet
from scamp_jax.pipeline.executor import PipelineExecutor
from search_spaces.supernet import SupernetConfig, SupernetLayout

ROOT = Path(__file__).resolve().parents[1]


def test_library_imports_no_search_space() -> None:
    """No module of ``scamp_jax`` imports ``search_spaces`` (statically or lazily)."""
    offenders = []
    for path in sorted((ROOT / "scamp_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                if n.split(".")[0] == "search_spaces"
            ]
    assert offenders == []


def test_importing_the_pipeline_loads_no_search_space() -> None:
    code = (
        "import sys, scamp_jax.pipeline, scamp_jax.distributed.pipeline\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'search_spaces'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


class ToyModel:
    """A tiny supernet of per-pixel dense layers with a squared-error loss: not the SR one.

    Inputs (mb, side, side, 2), features (mb, side, side, 3), targets (mb, side, side, 1).
    Candidate 0: ``x + tanh(x W + b)``; candidate 1: ``x + relu(x W)`` (no bias, so blocks have
    different sizes and the padding is exercised).
    """

    num_layers, num_choices, width = 4, 2, 3
    block_size = width * width + width
    stem_size = 2 * width
    shared_size = stem_size + width

    def init(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        blocks = rng.normal(0, 0.3, (self.num_layers, self.num_choices, self.block_size))
        blocks[:, 1, self.width * self.width :] = 0.0  # candidate 1 has no bias
        shared = rng.normal(0, 0.5, self.shared_size)
        return blocks.astype(np.float32), shared.astype(np.float32)

    def apply_stem(self, shared: jax.Array, inputs: jax.Array) -> jax.Array:
        return inputs @ shared[: self.stem_size].reshape(2, self.width)

    def apply_layers(self, blocks: jax.Array, choices: jax.Array, x: jax.Array) -> jax.Array:
        w2 = self.width * self.width

        def tanh_block(v: jax.Array, h: jax.Array) -> jax.Array:
            return h + jnp.tanh(h @ v[:w2].reshape(self.width, self.width) + v[w2:])

        def relu_block(v: jax.Array, h: jax.Array) -> jax.Array:
            return h + jax.nn.relu(h @ v[:w2].reshape(self.width, self.width))

        for j in range(blocks.shape[0]):
            x = lax.switch(choices[j], [tanh_block, relu_block], blocks[j], x)
        return x

    def apply_head(self, shared: jax.Array, h: jax.Array, inputs: jax.Array) -> jax.Array:
        return h @ shared[self.stem_size :].reshape(self.width, 1) + inputs[..., :1]

    def loss(self, output: jax.Array, target: jax.Array) -> jax.Array:
        return jnp.mean((output - target) ** 2)

    def feature_shape(self, batch: int, side: int) -> tuple[int, ...]:
        return (batch, side, side, self.width)

    def check_input(self, side: int) -> None:
        if side < 1:
            raise ValueError(f"input side {side} must be at least 1 pixel")


def test_a_different_supernet_plugs_in_and_csp_equals_sequential() -> None:
    model = ToyModel()
    assert isinstance(model, StageModel) and isinstance(SupernetLayout(SupernetConfig()),
                                                        StageModel)
    rng = np.random.default_rng(0)
    n, batch, side = 6, 2, 2
    subnets = [tuple(int(c) for c in row) for row in rng.integers(0, 2, (n, 4))]
    x = rng.normal(size=(n, batch, side, side, 2)).astype(np.float32)
    y = rng.normal(size=(n, batch, side, side, 1)).astype(np.float32)
    ex = PipelineExecutor(model, num_stages=2, microbatch_size=batch, lr_side=side,
                          window_slots=6, act_slots=6, grad_slots=6, train_shared=True)
    csp = train_supernet(model, subnets, x, y, schedule="csp", num_stages=2, executor=ex,
                         train_shared=True, offload=False)
    seq = train_supernet(model, subnets, x, y, schedule="sequential", num_stages=2, executor=ex,
                         train_shared=True, offload=False)
    assert csp.params_sha256 == seq.params_sha256
    np.testing.assert_array_equal(csp.losses, seq.losses)
    # The model's own loss is what is minimised: the first subnet's loss is its MSE at init.
    blocks, shared = model.init(0)
    chosen = jnp.asarray(blocks[np.arange(4), np.asarray(subnets[0])])
    out = model.apply_head(shared, model.apply_layers(
        chosen, jnp.asarray(subnets[0]), model.apply_stem(shared, x[0])), x[0])
    np.testing.assert_allclose(csp.losses[0], float(model.loss(out, y[0])), rtol=1e-6)
    assert not np.array_equal(csp.shared, shared)  # the stem and head were trained too


def test_an_incomplete_model_is_refused_by_name() -> None:
    class NoLoss:
        num_layers = num_choices = block_size = shared_size = stem_size = 1

    with pytest.raises(TypeError, match="lacks init, apply_stem.*loss"):
        PipelineExecutor(NoLoss(), num_stages=1, microbatch_size=1, lr_side=1,  # type: ignore
                         window_slots=1, act_slots=1, grad_slots=1)
