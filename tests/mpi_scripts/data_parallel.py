"""Train a tiny ViT for a few steps and write the loss curve as JSON.

Under ``mpirun -n R`` the trial is data parallel across the R ranks (each rank one device and
B / R samples of every global batch, gradients averaged with mpi4jax); as a plain process it
trains on the whole batch in one process. The MPI tests compare the two curves.

    python tests/mpi_scripts/data_parallel.py --out single.json
    mpirun -n 2 python tests/mpi_scripts/data_parallel.py --out mpi.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="global batch (a multiple of ranks)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from scamp_jax.devices import configure_cpu_devices

    configure_cpu_devices(1)

    import jax
    import numpy as np
    import optax
    from flax import nnx

    from scamp_jax.distributed.mpi import launched_under_mpi, world
    from search_spaces.vit import SyntheticClassificationTask, ViT

    task = SyntheticClassificationTask(image_size=8, num_classes=4, eval_size=8, seed=1)
    model = ViT(image_size=8, patch_size=4, num_classes=4, embed_dim=16, depth=1, num_heads=2,
                mlp_ratio=2.0, rngs=nnx.Rngs(0))
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)
    batches = list(itertools.islice(task.batches(args.batch, seed=2), args.steps))
    w = world()
    if launched_under_mpi():
        from scamp_jax.distributed.data_parallel import train_data_parallel

        losses, params = train_data_parallel(model, optimizer, task.loss_fn, batches)
        # Every replica must hold the same weights after the averaged updates.
        flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(params))])
        replicas = w.comm.allgather(hashlib.sha256(flat.tobytes()).hexdigest())
    else:
        from scamp_jax.distributed.data_parallel import one_device_shardings
        from scamp_jax.planning.train_step import jit_train_step, place_train_state

        shardings = one_device_shardings(model, optimizer)
        graphdef, params, opt_state, rest = place_train_state(model, optimizer, shardings)
        step = jit_train_step(graphdef, optimizer, task.loss_fn, shardings)
        out = []
        for batch in batches:
            params, opt_state, rest, loss = step(params, opt_state, rest, batch)
            out.append(loss)
        losses = np.asarray(jax.device_get(out), np.float32)
        replicas = []
    if w.rank == 0:
        Path(args.out).write_text(json.dumps(
            {"ranks": w.size, "losses": losses.tolist(), "replica_hashes": replicas}
        ))


if __name__ == "__main__":
    main()
