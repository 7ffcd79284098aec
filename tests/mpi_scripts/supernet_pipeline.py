"""Train a tiny supernet through the pipeline and write its losses and weight hash as JSON.

Under ``mpirun -n S`` every rank holds one stage (`train_supernet_mpi`); run as a plain process
with ``--stages S`` it uses the single-process executor on S CPU devices. The MPI tests compare
the two outputs bit for bit.

    python tests/mpi_scripts/supernet_pipeline.py --stages 2 --out single.json
    mpirun -n 2 python tests/mpi_scripts/supernet_pipeline.py --out mpi.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, help="single-process stages (default: MPI ranks)")
    p.add_argument("--schedule", default="csp")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--train-shared", action="store_true")
    p.add_argument("--subnets", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--die-at-tick", type=int,
                   help="the last rank exits with status 3 after this tick (fault test)")
    args = p.parse_args()

    from scamp_jax.devices import configure_cpu_devices
    from scamp_jax.distributed.mpi import launched_under_mpi

    mpi = launched_under_mpi()
    configure_cpu_devices(1 if mpi else args.stages)

    import numpy as np

    from scamp_jax.pipeline.stage import OptimizerSpec
    from scamp_jax.pipeline.trainer import train_supernet
    from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets

    config = SupernetConfig(num_layers=4, num_choices=3, width=8, scale=2, window_size=4)
    layout = SupernetLayout(config)
    rng = np.random.default_rng(7)
    n, batch, side = args.subnets, 2, 4
    lr = rng.random((n, batch, side, side, 3), dtype=np.float32)
    hr = rng.random((n, batch, 2 * side, 2 * side, 3), dtype=np.float32)
    subnets = [s.choices for s in sample_subnets(n, config, 3)]
    kwargs = dict(
        schedule=args.schedule, seed=3, offload=args.offload, train_shared=args.train_shared,
        num_microbatches=2, optimizer=OptimizerSpec("adam", 1e-2),
    )
    rank = 0
    if mpi:
        from scamp_jax.distributed.mpi import world
        from scamp_jax.distributed.pipeline import train_supernet_mpi

        w = world()
        rank = w.rank
        def on_tick(t: int, total: int) -> None:
            if rank == w.size - 1 and t == args.die_at_tick:
                print(f"rank {rank} exits at tick {t}", flush=True)
                os._exit(3)

        result = train_supernet_mpi(layout, subnets, lr, hr, on_tick=on_tick, **kwargs)
        stages = w.size
    else:
        result = train_supernet(layout, subnets, lr, hr, num_stages=args.stages, **kwargs)
        stages = args.stages
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "stages": stages,
            "losses": [float(x) for x in result.losses],
            "params_sha256": result.params_sha256,
            "ticks": result.ticks,
            "device_param_bytes": result.device_param_bytes,
            "host_param_bytes": result.host_param_bytes,
        }))


if __name__ == "__main__":
    main()
