"""Compile the supernet pipeline's stage step, report its memory, then train on that compile.

Under ``mpirun -n S`` every rank holds one stage (`MPIPipelineExecutor`); as a plain process
with ``--stages S`` the single-process executor runs the S stages on S CPU devices. Writes, as
JSON, ``compiled_memory`` per stage (every rank's under MPI), the weights hash of a short CSP
run on the executor compiled by it, and how many times the executor's jitted tick was traced
afterwards (0: the run used the executable ``compiled_memory`` built).

    python tests/mpi_scripts/compiled_memory.py --stages 2 --out single.json
    mpirun -n 2 python tests/mpi_scripts/compiled_memory.py --out mpi.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, help="single-process stages (default: MPI ranks)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from scamp_jax.devices import configure_cpu_devices
    from scamp_jax.distributed.mpi import launched_under_mpi

    mpi = launched_under_mpi()
    configure_cpu_devices(1 if mpi else args.stages)

    import numpy as np

    from scamp_jax.pipeline import build_executor, build_program, make_schedule, split_layers
    from scamp_jax.pipeline.trainer import train_supernet
    from search_spaces.supernet import SupernetConfig, SupernetLayout, sample_subnets

    config = SupernetConfig(num_layers=4, num_choices=3, width=8, scale=2, window_size=4)
    layout = SupernetLayout(config)
    rng = np.random.default_rng(7)
    n, batch, side = 6, 2, 4
    lr = rng.random((n, batch, side, side, 3), dtype=np.float32)
    hr = rng.random((n, batch, 2 * side, 2 * side, 3), dtype=np.float32)
    subnets = [s.choices for s in sample_subnets(n, config, 3)]
    rank, comm = 0, None
    if mpi:
        import functools

        from scamp_jax.distributed.mpi import import_mpi4py
        from scamp_jax.distributed.pipeline import MPIPipelineExecutor

        comm = import_mpi4py().COMM_WORLD
        rank, stages = comm.Get_rank(), comm.Get_size()
        factory = functools.partial(MPIPipelineExecutor, comm=comm)
    else:
        from scamp_jax.pipeline import PipelineExecutor

        stages, factory = args.stages, PipelineExecutor
    bounds = split_layers(config.num_layers, stages)
    program = build_program(make_schedule("csp", subnets, bounds), subnets, bounds)
    ex = build_executor(layout, [program], num_stages=stages, batch_size=batch, lr_side=side,
                        offload=True, executor_class=factory)
    memory = ex.compiled_memory((batch, side, side, 3), (batch, 2 * side, 2 * side, 3))
    per_stage = comm.allgather(memory) if comm is not None else [memory] * stages
    result = train_supernet(layout, subnets, lr, hr, schedule="csp", num_stages=stages,
                            seed=3, executor=ex)
    jitted = ex._tick if not mpi else ex._tick[0]
    traced = jitted._cache_size()
    if comm is not None:
        traced = max(comm.allgather(traced))
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "stages": stages,
            "memory": per_stage,
            "params_sha256": result.params_sha256,
            "traced_after_compile": traced,
        }))


if __name__ == "__main__":
    main()
