"""A trial that spans MPI ranks: data parallel, gradients averaged by mpi4jax inside the step.

Each rank holds a full replica of the model on one local device, takes its contiguous share of
every global batch (`local_batch`), and runs the project's training step
(`scamp_jax.planning.train_step.make_train_step`) with ``grad_reduce=mpi_mean(comm)``: after
``value_and_grad`` the gradients and the loss are summed over the ranks with ``mpi4jax.allreduce``
and divided by the number of ranks, so every replica applies the same update.

Why the reduction follows ``value_and_grad`` instead of sitting inside the loss: mpi4jax's
``allreduce`` differentiates to the identity on each rank (the cotangent is not summed across
ranks), so reducing the loss alone would leave each rank with only its own gradient.

Equal to the single-process run on the whole batch up to float32 reassociation: the mean over
B samples becomes the mean over ranks of means over B / ranks samples, which adds the same
numbers in another order (differences of a few units in the last place per step). That holds
for training without random numbers; a model that draws them (dropout, drop-path) draws
independent masks on each rank (a study's spanning trials fold the rank's share into its keys,
`scamp_jax.hpo.runner.own_random_streams`), the same distribution as one process but other
bits. Batch statistics (batch norm) are each rank's own.

One local device per rank: mpi4jax's calls run once per process, not once per device of a
sharded computation, so the step's mesh must have exactly one device (`check_one_device`).
Larger trials on one host use the planner's ``('data', 'model')`` mesh instead.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scamp_jax.distributed.mpi import failures_end_every_rank, import_mpi4jax, import_mpi4py
from scamp_jax.planning.train_step import (
    LossFn,
    PyTree,
    StepShardings,
    abstract_state,
    jit_train_step,
    place_train_state,
)


def reduced_dtype(dtype: Any) -> np.dtype:
    """The dtype `mpi_mean` reduces leaves of ``dtype`` in: float32 for the floats narrower
    than it (bfloat16, float16, float8), which MPI has no type for; else ``dtype`` itself."""
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating) and dt.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dt


def mpi_mean(comm: Any = None, *, fuse: bool = True) -> Callable[[PyTree], PyTree]:
    """``f(tree)``: every leaf summed over the ranks of ``comm`` and divided by their number.

    For use inside a jitted function (the ``grad_reduce`` of `make_train_step`). With ``fuse``
    the leaves of each dtype are flattened into one buffer and reduced by a single
    ``mpi4jax.allreduce`` (one message per step instead of one per parameter tensor, which
    bounds the number of message latencies on a slow network; ``benchmarks/mpi_comm.py``
    measures both); without, one call per leaf.
    The sums are the same either way (element-wise over the ranks), but XLA may fuse the
    update that follows differently around one call than around many, so a training run can
    differ in the last bits (measured: up to 3e-8 in a small MLP's parameters over five Adam
    steps; equal with SGD).
    Leaves of a float type narrower than float32 (bfloat16, float16), which MPI has no type
    for, are reduced as float32 and cast back (`reduced_dtype`). ``comm`` defaults to
    ``MPI.COMM_WORLD``.
    """
    mpi = import_mpi4py()
    m4j = import_mpi4jax()
    comm = mpi.COMM_WORLD if comm is None else comm
    size = comm.Get_size()

    def allreduce_mean(x: jax.Array) -> jax.Array:
        wide = reduced_dtype(x.dtype)
        summed = m4j.allreduce(x.astype(wide), op=mpi.SUM, comm=comm)
        return (summed / size).astype(x.dtype)

    def reduce(tree: PyTree) -> PyTree:
        if not fuse:
            return jax.tree.map(allreduce_mean, tree)
        leaves, treedef = jax.tree.flatten(tree)
        out: list[Any] = list(leaves)
        by_dtype: dict[Any, list[int]] = {}
        for i, leaf in enumerate(leaves):
            by_dtype.setdefault(jnp.result_type(leaf), []).append(i)
        for idx in by_dtype.values():
            flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx])
            reduced = allreduce_mean(flat)
            offset = 0
            for i in idx:
                n = int(np.prod(jnp.shape(leaves[i])))
                out[i] = reduced[offset : offset + n].reshape(jnp.shape(leaves[i]))
                offset += n
        return jax.tree.unflatten(treedef, out)

    return reduce


def mpi_mean_bytes(tree: PyTree) -> int:
    """Bytes per device that the fused `mpi_mean` of a tree shaped like ``tree`` adds to a step.

    Per dtype it holds the leaves concatenated into one send buffer and the reduced buffer the
    allreduce returns, each as large as those leaves together: twice the tree's bytes. The
    reduced leaves are slices of the second buffer, and the step's gradients stay counted in its
    own compiled peak. XLA may reuse memory and need less (on the tests' MLP of width 16, 644
    bytes of parameters, the compiled step grows by 468 bytes at a batch of 4 and 148 at 32;
    this returns 1,296); the run's ledger check measures the step it compiles, reduction
    included, against what was booked. A leaf narrower than float32, reduced as float32
    (`reduced_dtype`), counts that type's 4 bytes an element. ``tree`` may hold arrays or
    ``jax.ShapeDtypeStruct`` leaves.
    """
    total = sum(int(np.prod(jnp.shape(x))) * reduced_dtype(x.dtype).itemsize
                for x in jax.tree.leaves(tree))
    return 2 * total


def local_batch(batch: PyTree, rank: int, size: int) -> PyTree:
    """This rank's contiguous share of a global batch: rows ``rank * B / size`` onwards.

    Args:
      batch: pytree of arrays whose leading axis is the global batch B.
      rank, size: this rank and the number of ranks.
    Returns:
      the same pytree with leading axis B / size.
    """
    leaves = jax.tree.leaves(batch)
    b = int(leaves[0].shape[0])
    if b % size:
        raise ValueError(
            f"global batch {b} is not a multiple of the {size} ranks; use a batch of "
            f"{max(1, b // size) * size} (or {(b // size + 1) * size})"
        )
    per = b // size
    return jax.tree.map(lambda x: x[rank * per : (rank + 1) * per], batch)


def one_device_shardings(model: nnx.Module, optimizer: optax.GradientTransformation,
                         device: Any = None) -> StepShardings:
    """`StepShardings` that put the whole trial on one device (default the first local one)."""
    device = jax.local_devices()[0] if device is None else device
    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    rep = NamedSharding(mesh, P())
    params, opt_state, rest = abstract_state(model, optimizer)
    return StepShardings(
        params=jax.tree.map(lambda _: rep, params),
        opt_state=jax.tree.map(lambda _: rep, opt_state),
        rest=jax.tree.map(lambda _: rep, rest),
        batch=rep,
    )


def check_one_device(shardings: StepShardings) -> None:
    """Raise if the step's mesh has more than one device (see the module docstring)."""
    n = shardings.mesh.size
    if n != 1:
        raise ValueError(
            f"a cross-rank data-parallel step runs on one device per rank, got a mesh of {n}; "
            "launch one rank per device (mpirun -n <devices>) and use one_device_shardings()"
        )


def jit_data_parallel_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    shardings: StepShardings,
    comm: Any = None,
) -> jax.stages.Wrapped:
    """`scamp_jax.planning.train_step.jit_train_step` with gradients and loss averaged over
    ``comm``.

    Call it on every rank with that rank's `local_batch`; the returned loss is the global one.
    """
    check_one_device(shardings)
    return jit_train_step(graphdef, optimizer, loss_fn, shardings, grad_reduce=mpi_mean(comm))


def train_data_parallel(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    loss_fn: LossFn,
    batches: Iterable[PyTree],
    *,
    comm: Any = None,
) -> tuple[np.ndarray, PyTree]:
    """Train ``model`` on global ``batches`` split over the ranks of ``comm`` (collective).

    Every rank builds the same ``model`` (same seed) and passes the same global batches; each
    trains on its `local_batch` on its first local device. ``comm`` defaults to
    ``MPI.COMM_WORLD``.

    Before training the ranks compare digests of their starting parameters, and before each
    step whether each of them has a batch that splits over the ranks (`local_batch`): where
    they differ, or one does not split, every rank raises the same `ValueError` (catchable;
    nothing has been kept). A rank that raises anything else (its
    batches' iterator, the step) prints ``rank R failed: ...`` and aborts the job
    (`failures_end_every_rank`) instead of leaving the others waiting in the step's allreduce.

    Returns:
      ``(losses, params)``: the (steps,) global training loss before each update (float32,
      identical on every rank) and the final parameters.
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    # The ranks agree on a duplicate of ``comm``: a step's mpi4jax allreduce on ``comm`` may
    # still be running (dispatch is asynchronous) while the host asks the next question.
    agree = comm.Dup()
    refused = None
    try:
        with failures_end_every_rank(comm,
                                     stopped="this call saves nothing; its training is lost"):
            shardings = one_device_shardings(model, optimizer)
            graphdef, params, opt_state, rest = place_train_state(model, optimizer, shardings)
            refused = _check_same_start(agree, params)
            losses: list[Any] = []
            if refused is None:
                step = jit_data_parallel_step(graphdef, optimizer, loss_fn, shardings, comm)
                refused, losses, params = _train(agree, step, (params, opt_state, rest),
                                                 batches)
            # the steps run asynchronously: a failure in one surfaces here, still guarded
            curve = np.asarray(jax.device_get(losses), np.float32)
            jax.block_until_ready(params)
    finally:
        agree.Free()
    if refused is not None:
        raise ValueError(refused)
    return curve, params


def _digest(tree: PyTree) -> str:
    """Digest of a tree of arrays: its structure, and each leaf's shape, dtype and contents."""
    sha = hashlib.sha256(str(jax.tree.structure(tree)).encode())
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        a = np.ascontiguousarray(leaf)
        sha.update(f"{a.shape}{a.dtype.str}".encode())
        sha.update(a.reshape(-1).view(np.uint8))
    return sha.hexdigest()


def _check_same_start(agree: Any, params: PyTree) -> str | None:
    """Collective: None when every rank starts from the same parameters, else what every rank
    then raises."""
    every = agree.allgather(_digest(params))
    if all(d == every[0] for d in every):
        return None
    other = next(r for r, d in enumerate(every) if d != every[0])
    return (f"ranks start from different parameters: rank {other}'s differ from rank 0's; "
            "build the model with the same seed on every rank")


def _train(agree: Any, step: Any, state: tuple[PyTree, PyTree, PyTree],
           batches: Iterable[PyTree]) -> tuple[str | None, list[Any], PyTree]:
    """The steps, each after the ranks agree that all of them have a batch they can split
    (`local_batch`). Returns ``(None, losses, params)``, or first what every rank raises when
    some ran out before the others, or one's batch does not split over the ranks."""
    rank, size = agree.Get_rank(), agree.Get_size()
    params, opt_state, rest = state
    losses: list[Any] = []
    end = object()
    it = iter(batches)
    for i in itertools.count():
        batch = next(it, end)
        share, problem = None, None
        if batch is not end:
            try:
                share = local_batch(batch, rank, size)
            except ValueError as err:
                problem = f"step {i} (counting from 0): {err}"
        said = agree.allgather((batch is not end, problem))
        having = sum(1 for has, _ in said if has)
        if having == 0:
            return None, losses, params
        if having < size:
            return (f"the ranks ran out of batches apart: only {having} of the {size} had a "
                    f"batch for step {i} (counting from 0); pass every rank the same global "
                    "batches"), losses, params
        refused = next((p for _, p in said if p is not None), None)
        if refused is not None:
            return refused, losses, params
        params, opt_state, rest, loss = step(params, opt_state, rest, share)
        losses.append(loss)
    raise AssertionError("itertools.count() does not end")
