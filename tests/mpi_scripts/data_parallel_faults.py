"""`train_data_parallel` on a small MLP when the ranks do not go together; prints what happens.

    mpirun -n 2 python tests/mpi_scripts/data_parallel_faults.py CASE

CASE: ``raises`` (rank 1's batches raise at step 2), ``uneven`` (rank 1 has 3 batches, rank 0
has 5; then both train again on the same 5), ``seeds`` (each rank builds the model with its own
seed; then both again with seed 0), ``indivisible`` (a batch that does not split over the
ranks; then both again on the 5 that do), ``bfloat16`` / ``float16`` (a model with parameters
of that dtype: whether the replicas are equal, and `mpi_mean` of a small tree, are printed).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    case = sys.argv[1]
    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(1)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from scamp_jax.distributed import train_data_parallel, world

    w = world()
    dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(case, jnp.float32)

    class MLP(nnx.Module):
        def __init__(self, seed: int) -> None:
            rngs = nnx.Rngs(seed)
            self.l1 = nnx.Linear(6, 16, rngs=rngs, param_dtype=dtype, dtype=dtype)
            self.l2 = nnx.Linear(16, 3, rngs=rngs, param_dtype=dtype, dtype=dtype)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.l2(jax.nn.relu(self.l1(x.astype(dtype))))

    def loss_fn(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        x, y = batch
        logits = model(x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, 8))
               for _ in range(5)]
    optimizer = optax.adam(1e-2)

    def train(seed: int, mine: list) -> None:
        losses, params = train_data_parallel(MLP(seed), optimizer, loss_fn, mine)
        flat = np.concatenate([np.ravel(np.asarray(x, np.float32))
                               for x in jax.tree.leaves(jax.device_get(params))])
        digests = w.comm.allgather(hashlib.sha256(flat.tobytes()).hexdigest())
        dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(params)})
        print(f"rank {w.rank} trained {len(losses)} steps, replicas equal "
              f"{len(set(digests)) == 1}, params {dtypes}", flush=True)

    def refused(seed: int, mine: list) -> None:
        try:
            train(seed, mine)
        except ValueError as err:
            print(f"rank {w.rank} caught ValueError: {err}", flush=True)

    if case == "raises":
        def failing():
            for i, batch in enumerate(batches):
                if w.rank == 1 and i == 2:
                    raise RuntimeError("rank 1 cannot read its batch 2")
                yield batch
        train(0, failing())
    elif case == "uneven":
        refused(0, batches if w.rank == 0 else batches[:3])
        train(0, batches)
    elif case == "seeds":
        refused(w.rank, batches)
        train(0, batches)
    elif case == "indivisible":  # a third batch of 7 samples, which 2 ranks cannot split
        refused(0, [*batches[:2], tuple(x[:7] for x in batches[2]), *batches[3:]])
        train(0, batches)
    else:
        train(0, batches)
        # the reduction alone, one call per leaf and fused: the mean over the ranks, as dtype
        from scamp_jax.distributed import mpi_mean

        tree = {"a": jnp.full((3,), 1.5 + w.rank, dtype), "b": jnp.full((), 2.0 * w.rank, dtype)}
        for fuse in (False, True):
            out = jax.jit(mpi_mean(fuse=fuse))(tree)
            print(f"rank {w.rank} fuse={fuse} mean {float(out['a'][0])} {float(out['b'])} "
                  f"{out['a'].dtype}", flush=True)


if __name__ == "__main__":
    main()
