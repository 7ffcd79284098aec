"""Supernet NAS with one pipeline stage per MPI rank: the MPI twin of `run_nas`.

Every rank draws the same subnets and patches (same seed) and trains its stage through
`train_supernet_mpi`; rank 0 then evaluates the subnets, prints the tables and writes
``results.json`` / ``results.png`` exactly as the single-process `run_nas` does (the same
`scamp_jax.pipeline.nas.train_for_nas` and `scamp_jax.pipeline.nas.evaluate_and_save`), plus
``mpi_ranks`` and the ``rank`` of every stage. ``losses`` and ``params_sha256`` equal those of
the single-process run with the same number of stages.
"""

from __future__ import annotations

import functools
from typing import Any

from scamp_jax.distributed.mpi import World, world
from scamp_jax.distributed.pipeline import train_supernet_mpi
from scamp_jax.pipeline.nas import NASConfig, evaluate_and_save, train_for_nas


def run_nas_mpi(
    config: NASConfig, *, json_path: str | None = None, show: bool = True,
    mpi_world: World | None = None,
) -> dict[str, Any] | None:
    """`scamp_jax.pipeline.nas.run_nas` with stage ``s`` on MPI rank ``s`` (collective).

    ``config.stages`` must equal the number of ranks. Returns the summary on rank 0 and None on
    the other ranks (which only train).
    """
    from rich.console import Console

    w = mpi_world or world()
    if config.stages != w.size:
        raise ValueError(
            f"stages={config.stages} but {w.size} MPI ranks; the MPI pipeline runs one stage per "
            f"rank: launch with mpirun -n {config.stages} or pass --stages {w.size}"
        )
    console = Console(quiet=not show or not w.is_root)
    console.print(f"one pipeline stage per MPI rank: {w.size} ranks")
    layout, result = train_for_nas(
        config, train_fn=functools.partial(train_supernet_mpi, comm=w.comm), console=console
    )
    if not w.is_root:
        return None
    extra = {"mpi_ranks": w.size, "stage_ranks": list(range(w.size))}
    return evaluate_and_save(
        config, layout, result, json_path=json_path, console=console, extra=extra
    )
