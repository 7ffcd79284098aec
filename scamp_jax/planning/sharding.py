"""Tensor-parallel sharding rules, the ('data', 'model') mesh, and per-device byte counts.

Rules (``param_partition_specs``), applied to each parameter on its own:

- Parameters with fewer than ``min_shard_elements`` elements (biases, norms, relative position
  bias tables, small kernels) and 1-D parameters are replicated: splitting them saves almost no
  memory and costs a collective.
- Dense kernels ``(in, out)``: shard the larger of the two feature dimensions on ``'model'`` (ties:
  the output). An expanding layer is split by columns and the following contracting layer by rows,
  so a transformer MLP gets the usual column-then-row split and only one all-reduce.
- Convolution kernels ``(kh, kw, in, out)`` (and 1-D/3-D ones, ``(k..., in, out)``): the same
  rule on the ``in`` and ``out`` dimensions; spatial dimensions are never split.
- Attention projections keep whole heads on a device: ``nnx.MultiHeadAttention``'s query, key
  and value kernels ``(in, heads, head_dim)`` and biases ``(heads, head_dim)``, and a fused
  heads-major ``qkv`` ``nnx.LinearGeneral`` (kernel ``(in, heads, 3 * head_dim)``, as SwinIR's
  window attention stores it), are split on the heads axis; the output kernel
  ``(heads, head_dim, out)`` (``out``, or a ``proj`` ``LinearGeneral`` over (heads, head_dim))
  on its heads axis. So attention runs per device on its own heads
  with no exchange between devices; the only collective is the all-reduce after the output
  projection. When the heads do not divide by the degree, the input (projections) or output
  (``out``) features are split instead; ``head_dim`` is never split.
- When the preferred dimension is not divisible by the model-parallel degree, the next candidate is
  tried, and a parameter none of whose candidates divides is replicated.

Any choice is correct (XLA inserts the collectives); the rules decide memory and communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PyTree = Any

#: Parameters smaller than this many elements are replicated (16 KiB of float32).
MIN_SHARD_ELEMENTS = 4096
DATA_AXIS = "data"
MODEL_AXIS = "model"
_ATTENTION_INPUT_NAMES = ("query", "key", "value", "qkv", "q_proj", "k_proj", "v_proj")
_ATTENTION_OUTPUT_NAMES = ("out", "proj", "o_proj", "out_proj")


def make_mesh(devices: Sequence[jax.Device], data_parallel: int, model_parallel: int) -> Mesh:
    """A ``Mesh`` of shape ``(data_parallel, model_parallel)`` with axes ``('data', 'model')``.

    Devices fill the mesh row by row, so each model-parallel group is ``model_parallel``
    consecutive devices (neighbours on a node share the fastest links). The axes are of the
    automatic type, so ``jax.jit`` with ``NamedSharding`` arguments works without extra context.
    """
    devices = list(devices)
    if data_parallel < 1 or model_parallel < 1:
        raise ValueError(
            f"{data_parallel=} and {model_parallel=} must both be at least 1"
        )
    if data_parallel * model_parallel != len(devices):
        raise ValueError(
            f"data_parallel * model_parallel = {data_parallel * model_parallel} must equal the "
            f"number of devices ({len(devices)}); pick degrees whose product is {len(devices)}"
        )
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid.reshape(data_parallel, model_parallel), (DATA_AXIS, MODEL_AXIS))


def _path_names(path: tuple[Any, ...]) -> list[str]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
    return names


def _leaf_names(names: list[str]) -> list[str]:
    """``names`` without the trailing ``value`` field that ``nnx.Variable`` adds to a path.

    Only the last entry is dropped: a module called ``value`` (the value projection of
    ``nnx.MultiHeadAttention``) stays in the path.
    """
    if len(names) >= 2 and names[-1] == "value":
        return names[:-1]
    return names


def _candidate_dims(names: list[str], shape: tuple[int, ...]) -> list[int]:
    """Dimensions to try, best first, for a parameter at ``names`` of ``shape``."""
    ndim = len(shape)
    lowered = [n.lower() for n in _leaf_names(names)]
    leaf = lowered[-1] if lowered else ""
    owner = lowered[-2] if len(lowered) >= 2 else ""
    if owner in _ATTENTION_INPUT_NAMES:
        if ndim == 3 and leaf == "kernel":
            return [1, 0]  # (in, heads, head_dim): heads, else the input features
        if ndim == 2 and leaf == "bias":
            return [0]  # (heads, head_dim): heads only
    if owner in _ATTENTION_OUTPUT_NAMES and ndim == 3 and leaf == "kernel":
        return [0, 2]  # (heads, head_dim, out): heads, else the output features
    if ndim >= 2:
        # Dense (in, out) and conv (k..., in, out): the larger feature dimension first.
        inp, out = ndim - 2, ndim - 1
        return [inp, out] if shape[inp] > shape[out] else [out, inp]
    return []


def partition_spec_for(
    path: tuple[Any, ...],
    shape: tuple[int, ...],
    model_parallel: int,
    min_shard_elements: int = MIN_SHARD_ELEMENTS,
) -> PartitionSpec:
    """The ``PartitionSpec`` of one parameter of ``shape`` at pytree ``path`` (see module rules)."""
    if model_parallel == 1 or len(shape) < 2 or math.prod(shape) < min_shard_elements:
        return PartitionSpec()
    for dim in _candidate_dims(_path_names(path), shape):
        if shape[dim] % model_parallel == 0:
            spec: list[str | None] = [None] * len(shape)
            spec[dim] = MODEL_AXIS
            return PartitionSpec(*spec)
    return PartitionSpec()


def param_partition_specs(
    params_state: PyTree, model_parallel: int, *, min_shard_elements: int = MIN_SHARD_ELEMENTS
) -> PyTree:
    """A ``PartitionSpec`` for every parameter, as a tree matching ``params_state``.

    ``params_state`` is ``nnx.state(model, nnx.Param)`` (real or abstract arrays); each leaf's
    spec names ``'model'`` on at most one dimension (see the module docstring for the rules).
    """
    if model_parallel < 1:
        raise ValueError(f"{model_parallel=} must be at least 1")
    return jax.tree.map_with_path(
        lambda path, x: partition_spec_for(
            path, tuple(x.shape), model_parallel, min_shard_elements
        ),
        params_state,
    )


def named_shardings(mesh: Mesh, specs: PyTree) -> PyTree:
    """``NamedSharding(mesh, spec)`` for every ``PartitionSpec`` leaf of ``specs``."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def replicated_shardings(mesh: Mesh, tree: PyTree) -> PyTree:
    """A replicated ``NamedSharding`` for every leaf of ``tree``."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda _: replicated, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Split each batch leaf's leading (sample) axis over ``'data'``; replicate over ``'model'``."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def opt_state_shardings(
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    params: PyTree,
    param_shardings: PyTree,
    mesh: Mesh,
) -> PyTree:
    """Shardings for ``opt_state``: copies of the parameter tree get ``param_shardings``.

    Per-parameter moments (Adam's ``mu``/``nu``, momentum traces) are sharded like their parameter;
    counters, hyperparameters and anything else are replicated. ``optax.tree_map_params`` finds the
    parameter-shaped subtrees; for optimizers it cannot trace (ones whose ``init`` inspects the
    parameters), leaves are matched to parameters by path suffix and shape instead.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def same_shape(leaf: Any, param: Any, sharding: NamedSharding) -> NamedSharding:
        # Factored statistics (Adafactor's row/column moments) sit where a parameter copy would
        # but have other shapes: replicate those.
        return sharding if tuple(leaf.shape) == tuple(param.shape) else replicated

    try:
        # ``init`` traced, not run: an eager init computes its hyperparameters, a few
        # compiles of tiny programs in every process
        return optax.tree_map_params(
            lambda p: jax.eval_shape(optimizer.init, p),
            same_shape,
            opt_state,
            params,
            param_shardings,
            transform_non_params=lambda _: replicated,
        )
    except Exception:  # noqa: BLE001 - any failure of the tracing route: use path matching
        pass
    shape_by_path = {
        tuple(_path_names(path)): tuple(leaf.shape)
        for path, leaf in jax.tree.leaves_with_path(params)
    }
    sharding_by_path = {
        tuple(_path_names(path)): s
        for path, s in jax.tree.leaves_with_path(
            param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding)
        )
    }

    def match(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        names = tuple(_path_names(path))
        for start in range(len(names)):
            suffix = names[start:]
            if shape_by_path.get(suffix) == tuple(leaf.shape):
                return sharding_by_path[suffix]
        return replicated

    return jax.tree.map_with_path(match, opt_state)


def bytes_per_device(tree: PyTree, shardings: PyTree) -> int:
    """Bytes that ``tree`` (arrays or ``ShapeDtypeStruct``s) takes on a device under ``shardings``.

    Uses the shard shape of each leaf (the largest shard for uneven splits), so the figure is the
    per-device footprint, not the global size.
    """
    leaves = jax.tree.leaves(tree)
    sharding_leaves = jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    if len(sharding_leaves) == 1 and len(leaves) != 1:
        sharding_leaves = sharding_leaves * len(leaves)
    if len(sharding_leaves) != len(leaves):
        raise ValueError(
            f"shardings have {len(sharding_leaves)} leaves but the tree has {len(leaves)}; "
            "pass one sharding per array (or a single sharding for all)"
        )
    total = 0
    for leaf, sharding in zip(leaves, sharding_leaves, strict=True):
        shard_shape = sharding.shard_shape(tuple(leaf.shape))
        total += math.prod(shard_shape) * _element_bytes(leaf)
    return total


def _element_bytes(leaf: Any) -> int:
    """Bytes per element of ``leaf``; a typed PRNG key counts its raw key data (e.g. 2 x uint32)."""
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raw = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(raw.shape) * np.dtype(raw.dtype).itemsize
    return np.dtype(dtype).itemsize
