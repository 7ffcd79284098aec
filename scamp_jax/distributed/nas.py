"""Supernet NAS with one pipeline stage per MPI rank: the MPI twin of `run_nas`.

Every rank draws the same subnets and patches (same seed) and trains its stage through
`train_supernet_mpi`; rank 0 then evaluates the subnets, prints the tables and writes
``results.json`` / ``results.png`` exactly as the single-process `run_nas` does, plus
``mpi_ranks`` and the ``rank`` of every stage. ``losses`` and ``params_sha256`` equal those of
the single-process run with the same number of stages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from scamp_jax.distributed.mpi import World, world
from scamp_jax.distributed.pipeline import train_supernet_mpi
from scamp_jax.pipeline import nas
from scamp_jax.pipeline.stage import OptimizerSpec
from search_spaces.supernet import SupernetLayout, sample_subnets


def run_nas_mpi(
    config: nas.NASConfig, *, json_path: str | None = None, show: bool = True,
    mpi_world: World | None = None,
) -> dict[str, Any] | None:
    """`scamp_jax.pipeline.nas.run_nas` with stage ``s`` on MPI rank ``s`` (collective).

    ``config.stages`` must equal the number of ranks. Returns the summary on rank 0 and None on
    the other ranks (which only train).
    """
    from rich.console import Console

    from search_spaces.metrics import psnr_y
    from search_spaces.sr_data import bicubic_upscale

    w = mpi_world or world()
    if config.stages != w.size:
        raise ValueError(
            f"stages={config.stages} but {w.size} MPI ranks; the MPI pipeline runs one stage per "
            f"rank: launch with mpirun -n {config.stages} or pass --stages {w.size}"
        )
    console = Console(quiet=not show or not w.is_root)
    cfg = config.supernet
    layout = SupernetLayout(cfg)
    subnets = [s.choices for s in sample_subnets(config.subnets, cfg, config.seed)]
    lr, hr = nas.training_batches(config)
    console.print(
        f"supernet: {cfg.num_layers} layers x {cfg.num_choices} candidates, width {cfg.width}; "
        f"{config.subnets} subnets x batch {config.batch_size}; schedule {config.schedule} on "
        f"{config.stages} stages = {w.size} MPI ranks, offload {'on' if config.offload else 'off'}"
    )
    result = train_supernet_mpi(
        layout, subnets, lr, hr, schedule=config.schedule, seed=config.seed,
        offload=config.offload, train_shared=config.train_shared,
        num_microbatches=config.microbatches,
        optimizer=OptimizerSpec("adam", config.learning_rate), comm=w.comm,
    )
    if not w.is_root:
        return None
    eval_lr, eval_hr = nas.held_out_images(config)
    candidates = [
        s.choices for s in sample_subnets(config.eval_subnets, cfg, config.seed + 1)
    ]
    started = time.perf_counter()
    scores = nas.evaluate_subnets(
        layout, result.blocks, result.shared, candidates, eval_lr, eval_hr
    )
    bicubic = float(np.mean([
        psnr_y(np.clip(bicubic_upscale(x, 2), 0, 1), y, border=2)
        for x, y in zip(eval_lr, eval_hr, strict=True)
    ]))
    summary = nas._summary(config, result, candidates, scores, bicubic)
    summary["eval_seconds"] = time.perf_counter() - started
    summary["mpi_ranks"] = w.size
    summary["stage_ranks"] = list(range(w.size))
    nas._print_tables(console, config, result, summary)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(json_path) if json_path else out / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))
    plot = path.with_suffix(".png")
    nas.save_plot(summary, plot)
    console.print(f"wrote {path} and {plot}")
    return summary
