"""Train a tiny supernet through the pipeline and write its losses and weight hash as JSON.

Under ``mpirun -n S`` every rank holds one stage (`train_supernet_mpi`); run as a plain process
with ``--stages S`` it uses the single-process executor on S CPU devices. The MPI tests compare
the two outputs bit for bit. With ``--disagree`` rank 1 passes other arguments than rank 0.
With ``--direct`` the ranks call `train_supernet` with an `MPIPipelineExecutor` factory instead
of `train_supernet_mpi` (the executor used directly).

    python tests/mpi_scripts/supernet_pipeline.py --stages 2 --out single.json
    mpirun -n 2 python tests/mpi_scripts/supernet_pipeline.py --out mpi.json

With ``--memory`` the script first compiles the stage step with ``compiled_memory`` (every
stage's figures go to the JSON, every rank's under MPI), then trains on that executor and
records how often its jitted stage step was traced afterwards (0: the run used that compile),
then closes it and tries to train on it again (an MPI executor refuses: its communicator is
freed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, help="single-process stages (default: MPI ranks)")
    p.add_argument("--schedule", default="csp")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--train-shared", action="store_true")
    p.add_argument("--subnets", type=int, default=6)
    p.add_argument("--out", required=True)
    p.add_argument("--memory", action="store_true",
                   help="report compiled_memory of the stage step and train on that compile")
    p.add_argument("--die-at-tick", type=int,
                   help="the last rank exits with status 3 after this tick (fault test)")
    p.add_argument("--raise-at-tick", type=int,
                   help="the last rank raises an exception after this tick (fault test)")
    p.add_argument("--disagree", choices=("subnets", "seed"),
                   help="rank 1 draws other subnets, or passes another seed (argument test)")
    p.add_argument("--direct", action="store_true",
                   help="under MPI, train_supernet on MPIPipelineExecutor, not train_supernet_mpi")
    args = p.parse_args()

    from scamp_jax.devices import configure_cpu_devices
    from scamp_jax.distributed.mpi import launched_under_mpi, world
    from scamp_jax.pipeline.determinism import use_fixed_cpu_threads

    mpi = launched_under_mpi()
    # the same CPU worker pool and devices per process either way, whatever cores mpirun binds
    # a rank to: XLA's CPU convolutions split their work by the pool's size
    use_fixed_cpu_threads(8)
    configure_cpu_devices(args.stages or world().size)

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
    rank, comm, memory, traced, closed_per_rank = 0, None, None, None, None
    built: list[Any] = []
    if mpi:
        from scamp_jax.distributed.pipeline import MPIPipelineExecutor, train_supernet_mpi

        w = world()
        rank, comm, stages = w.rank, w.comm, w.size
        if args.disagree == "subnets" and rank == 1:
            subnets = [s.choices for s in sample_subnets(n, config, 4)]
        if args.disagree == "seed" and rank == 1:
            kwargs["seed"] = 4
        factory = functools.partial(MPIPipelineExecutor, comm=comm)

        def on_tick(t: int, total: int) -> None:
            if rank == w.size - 1 and t == args.die_at_tick:
                print(f"rank {rank} exits at tick {t}", flush=True)
                os._exit(3)
            if rank == w.size - 1 and t == args.raise_at_tick:
                raise RuntimeError(f"rank {rank} raises at tick {t}")

        kwargs["on_tick"] = on_tick
        run = functools.partial(train_supernet_mpi, layout, subnets, lr, hr)
        if args.direct:
            def recorded(*a: Any, **kw: Any) -> Any:  # the executors train_supernet builds
                built.append(factory(*a, **kw))
                return built[-1]

            run = functools.partial(train_supernet, layout, subnets, lr, hr, num_stages=stages,
                                    executor=recorded)
    else:
        from scamp_jax.pipeline import PipelineExecutor

        stages, factory = args.stages, PipelineExecutor
        run = functools.partial(train_supernet, layout, subnets, lr, hr, num_stages=stages)
    if args.memory:
        from scamp_jax.pipeline import build_executor, build_program, make_schedule, split_layers

        bounds = split_layers(config.num_layers, stages)
        m = kwargs["num_microbatches"] if args.schedule == "gpipe" else 1
        program = build_program(make_schedule(args.schedule, subnets, bounds,
                                              num_microbatches=m), subnets, bounds)
        ex = build_executor(layout, [program], num_stages=stages, batch_size=batch,
                            lr_side=side, num_microbatches=m, offload=args.offload,
                            train_shared=args.train_shared, optimizer=kwargs["optimizer"],
                            executor_class=factory)
        shapes = ((batch // m, side, side, 3), (batch // m, 2 * side, 2 * side, 3))
        memory = ex.compiled_memory(*shapes)
        memory = comm.allgather(memory) if comm is not None else [memory] * stages
        result = train_supernet(layout, subnets, lr, hr, num_stages=stages, executor=ex,
                                **kwargs)
        stage_step = ex._tick[0] if mpi else ex._tick
        traced = stage_step._cache_size()
        if comm is not None:
            traced = max(comm.allgather(traced))
        # train_supernet leaves an executor passed to it open; closing it frees the MPI
        # executor's communicator, after which it refuses to run
        closed = [getattr(ex, "closed", None)]
        ex.close()
        try:
            train_supernet(layout, subnets, lr, hr, num_stages=stages, executor=ex, **kwargs)
            closed.append("ran after close")
        except RuntimeError as err:
            closed.append(str(err))
        closed.append(getattr(ex, "closed", None))
        closed_per_rank = comm.allgather(closed) if comm is not None else [closed]
    else:
        try:
            result = run(**kwargs)
        except ValueError as err:  # a refusal every rank raises: each says it, then all end
            print(f"ValueError: {err}", flush=True)
            if built:
                print(f"rank {rank}: the executors built were closed: "
                      f"{all(e.closed for e in built)}", flush=True)
            if comm is not None:
                comm.Barrier()  # no rank ends (and has mpirun end the others) before all said it
            raise SystemExit(2) from None
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "stages": stages,
            "losses": [float(x) for x in result.losses],
            "params_sha256": result.params_sha256,
            "ticks": result.ticks,
            "device_param_bytes": result.device_param_bytes,
            "host_param_bytes": result.host_param_bytes,
            "memory": memory,
            "traced_after_compile": traced,
            "closed": closed_per_rank,
        }))


if __name__ == "__main__":
    main()
